"""lm-eval's HFLM around an in-memory model, with the paper's generation protocol.

Two changes to HFLM, both for generation tasks only:
- prompts longer than the window are cut in the MIDDLE (head and tail kept, as LongBench and the
  MHA2MLA code do), where HFLM keeps only the tail;
- every `generate` call gets a cache built here (latent / quantized latent for MLA models,
  Dynamic / Quantized for the original), whose bytes are measured after the call.
Loglikelihood requests go through HFLM unchanged.

Under several processes (torch.distributed initialised: torchrun, accelerate launch) every process holds its own
copy of the model on its own device and takes its share of each task's documents: lm-eval's evaluator splits
them by `rank` / `world_size` and gathers the results onto rank 0. HFLM sets both to one process for a model
passed as an object, so they are set here, with the collectives lm-eval asks of them, on `process_group` when
given (the runner's long-timeout gloo group: ranks whose shares end minutes apart wait for each other there,
not in a training collective's short timeout).
"""

from __future__ import annotations

import torch
from lm_eval.models.huggingface import HFLM

from .kv import CacheMeter, KVQuant, new_cache


def middle_truncate(ids, max_len: int):
    """Keep the first `max_len - max_len // 2` and the last `max_len // 2` items when too long."""
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if len(ids) <= max_len:
        return ids
    tail = max_len // 2
    head = max_len - tail
    if isinstance(ids, torch.Tensor):
        return torch.cat([ids[:head], ids[len(ids) - tail :]])
    return list(ids[:head]) + list(ids[len(ids) - tail :])


def process_rank_and_count() -> tuple[int, int]:
    """(this process's rank, the number of processes) of the launch; (0, 1) without torch.distributed."""
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        return td.get_rank(), td.get_world_size()
    return 0, 1


class EvalLM(HFLM):
    """HFLM over `model`/`tokenizer` objects; `window` is the max sequence length (prompt + generation).
    `placement` (evaluation/placement.py): puts the model on its device in the suites' dtype (None: as it is).
    `data_parallel`: under several processes, this one evaluates its share (False: all of it, alone);
    `process_group`: the group of the evaluation's collectives (None: the default one)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 1,
        window: int | None = None,
        kv_quant: KVQuant | None = None,
        middle_truncation: bool = True,
        placement=None,
        data_parallel: bool = True,
        process_group=None,
    ):
        if tokenizer.pad_token_id is None:  # batched generation pads on the left
            tokenizer.pad_token = tokenizer.eos_token
        if placement is not None:
            placement.place(model, "suites")
        # backend given: lm-eval's auto-detection does not know the registered `mha2mla` model type
        # log-softmax in fp32: a bf16 model's log-likelihoods would otherwise be rounded to bf16 as well
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=window,
            device=str(placement.device if placement is not None else model.device),
            backend="causal",
            softmax_dtype=torch.float32,
        )
        self._rank, self._world_size = process_rank_and_count() if data_parallel else (0, 1)
        self.process_group = process_group
        self.kv_quant = kv_quant
        self.middle_truncation = middle_truncation
        self.kv_meter = CacheMeter()
        self.truncated_prompts = 0
        self.requests_served = 0  # by this process (lm-eval's padding requests for even ranks included)

    # ---- the collectives lm-eval's evaluator and HFLM use when world_size > 1 (HFLM's own need an Accelerator).
    # They carry a few counts and the logged samples: objects through `process_group`, which may be gloo (CPU)
    def all_gather(self, tensor):
        """lm-eval's request counts of every process, concatenated (as accelerate's gather)."""
        if self.world_size <= 1:
            return tensor
        parts = self.per_rank((tensor if tensor.dim() else tensor[None]).cpu())
        return torch.cat(parts).to(tensor.device)

    def gather_object(self, obj, dst=0):
        if self.world_size <= 1:
            return [obj]
        import torch.distributed as td

        every = [None] * self.world_size if self.rank == dst else None
        td.gather_object(obj, every, dst=dst, group=self.process_group)
        return every

    def barrier(self):
        if self.world_size > 1:
            import torch.distributed as td

            td.barrier(group=self.process_group)

    def per_rank(self, value) -> list:
        """`value` of every process, in rank order (collective)."""
        if self.world_size <= 1:
            return [value]
        import torch.distributed as td

        every = [None] * self.world_size
        td.all_gather_object(every, value, group=self.process_group)
        return every

    def sum_over_ranks(self, *counts):
        """Each of `counts` summed over the processes (each process's own on one process)."""
        return tuple(sum(column) for column in zip(*self.per_rank(list(counts))))

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self.requests_served += len(requests)
        return super().loglikelihood(requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self.requests_served += len(requests)
        return super().loglikelihood_rolling(requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        self.requests_served += len(requests)
        return super().generate_until(requests, disable_tqdm)

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        if not (self.middle_truncation and left_truncate_len):
            return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        # encode one by one (HFLM's own BOS handling), cut each in the middle, then pad
        rows = []
        for s in strings:
            ids = super().tok_batch_encode([s], padding_side, None, truncation)[0][0]
            if len(ids) > left_truncate_len:
                self.truncated_prompts += 1
                ids = middle_truncate(ids, left_truncate_len)
            rows.append(ids)
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if padding_side == "left":
                input_ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
            else:
                input_ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return input_ids, mask

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = new_cache(self.model, self.kv_quant)
        out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
        self.kv_meter.record(cache, context.shape[0])
        return out
