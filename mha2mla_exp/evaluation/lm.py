"""lm-eval's HFLM around an in-memory model, with the paper's generation protocol.

Two changes to HFLM, both for generation tasks only:
- prompts longer than the window are cut in the MIDDLE (head and tail kept, as LongBench and the
  MHA2MLA code do), where HFLM keeps only the tail;
- every `generate` call gets a cache built here (latent / quantized latent for MLA models,
  Dynamic / Quantized for the original), whose bytes are measured after the call.
Loglikelihood requests go through HFLM unchanged.
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
        return torch.cat([ids[:head], ids[len(ids) - tail:]])
    return list(ids[:head]) + list(ids[len(ids) - tail:])


class EvalLM(HFLM):
    """HFLM over `model`/`tokenizer` objects; `window` is the max sequence length (prompt + generation)."""

    def __init__(self, model, tokenizer, *, batch_size: int = 1, window: int | None = None,
                 kv_quant: KVQuant | None = None, middle_truncation: bool = True):
        if tokenizer.pad_token_id is None:  # batched generation pads on the left
            tokenizer.pad_token = tokenizer.eos_token
        # backend given: lm-eval's auto-detection does not know the registered `mha2mla` model type
        # log-softmax in fp32: a bf16 model's log-likelihoods would otherwise be rounded to bf16 as well
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=window,
                         device=str(model.device), backend="causal", softmax_dtype=torch.float32)
        self.kv_quant = kv_quant
        self.middle_truncation = middle_truncation
        self.kv_meter = CacheMeter()
        self.truncated_prompts = 0

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
                input_ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
            else:
                input_ids[i, :len(r)], mask[i, :len(r)] = r, 1
        return input_ids, mask

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = new_cache(self.model, self.kv_quant)
        out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
        self.kv_meter.record(cache, context.shape[0])
        return out
