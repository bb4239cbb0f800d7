"""The runner's stages as plain functions: load -> data -> calibrate -> convert -> measure -> evaluate.

Each takes the composed config (and what the previous stage returned), so tests can call them one
by one. Fine-tuning lives in `mha2mla_exp.train`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..mla import convert_to_mla
from .config import RunPlan

log = logging.getLogger(__name__)


def load_tokenizer(cfg: DictConfig):
    """The tokenizer alone (cheap), so data and budget are checked before any weight is loaded."""
    from ..models import load_tokenizer as load

    return load(cfg.model)


def placement(cfg: DictConfig, plan: RunPlan, device: torch.device):
    """Where and in what dtype every model this run evaluates runs, whatever made it (evaluation/placement.py)."""
    from ..evaluation.placement import EvalPlacement

    return EvalPlacement.decide(device, suites_dtype=plan.eval_dtype, model_dtype=cfg.model.get("dtype", "auto"))


def load(cfg: DictConfig, plan: RunPlan, device: torch.device):
    """(model, tokenizer) from a hub id, a local folder or an offline asset, in the placement's weights dtype:
    fp32 (the SVD and the master weights need it) unless model.dtype says otherwise, the untouched original
    included, so that every row's held-out perplexity runs in one precision and every row is cast to the
    suites' dtype the same way."""
    from ..models import load_model

    return load_model(cfg.model, device=device, dtype=placement(cfg, plan, device).weights_dtype)


def load_trained(folder, device: torch.device):
    """A kept trained model (fp32, as it was saved), in eval mode."""
    from ..models import load_model

    return load_model({"source": "local", "id": str(folder), "dtype": "float32"}, device=device)


def prepare_data(cfg: DictConfig, tokenizer):
    """Tokenized, packed train / held-out splits (split by document: never train on held-out text), or a
    streamed corpus with its held-out rows."""
    from ..data import prepare_data as prepare

    return prepare(cfg.data, tokenizer)


def prepare_training_data(cfg: DictConfig, tokenizer):
    """The fine-tune's own corpus when `train.data` names one (e.g. text the teacher writes), else None."""
    from ..data import prepare_data as prepare
    from .config import training_data_cfg

    train_data = training_data_cfg(cfg) if cfg.train.enabled else None
    return None if train_data is None else prepare(train_data, tokenizer)


def training_rows(cfg: DictConfig, data, num_processes: int):
    """The fine-tune's rows; a budget that would repeat a finite corpus is refused here, before any weight
    is loaded, unless train.epochs_allowed says so."""
    from ..data.stream import PrefetchedRows, TrainStream
    from ..train import check_epochs, plan_budget

    rows = data.training_rows(int(cfg.train.seq_len), seed=cfg.seed)
    budget = plan_budget(cfg.train, pretrain_tokens=cfg.model.get("pretrain_tokens"), num_processes=num_processes)
    check_epochs(budget.tokens, rows.tokens_available, cfg.train.get("epochs_allowed", False))
    if isinstance(rows, TrainStream):  # a stream is read one step ahead, off the training thread
        return PrefetchedRows(rows)
    return rows


def calibration_batches(cfg: DictConfig, plan: RunPlan, data) -> list[torch.Tensor] | None:
    """Calibration samples for the RoPE strategy and low-rank init that read statistics (the spec says
    which), drawn from the training split; None when neither does."""
    if plan.spec is None or not plan.spec.needs_calibration:
        return None
    from ..data import calibration_batches as sample

    c = cfg.calibration
    return list(sample(data, n=c.num_sequences, seq_len=c.seq_len, batch_size=c.batch_size))


def stream_offsets(cfg: DictConfig, plan: RunPlan) -> dict[str, int]:
    """Where each stage's sample starts in a streamed corpus, read in order: calibration at its head, the
    KV-budget search's after it, then layer-wise distillation's, one block per seed, so that no two stages
    (and no two seeds' distillations) read the same text. A finite corpus draws with seeds of its own instead."""
    calibration = 0
    if plan.spec is not None and plan.spec.needs_calibration:
        calibration = int(cfg.calibration.num_sequences) * int(cfg.calibration.seq_len)
    selection = 0
    if plan.spec is not None and plan.spec.searches:
        selection = int(cfg.svd.selection.num_sequences) * int(cfg.svd.selection.seq_len)
    distill = int(cfg.distill.sequences) * int(cfg.distill.seq_len)
    return {"calibration": 0, "selection": calibration,
            "distill": calibration + selection + int(cfg.seed) * distill}


def selection_batches(cfg: DictConfig, plan: RunPlan, data) -> list[torch.Tensor] | None:
    """The rows a KV-budget search scores its candidate splits on (`svd.selection`): train split, a seed of
    their own (calibration draws with 0, layer-wise distillation with `seed + 1`); None when nothing is searched."""
    if plan.spec is None or not plan.spec.searches:
        return None
    from ..data import calibration_batches as sample

    s = cfg.svd.selection
    return list(sample(data, n=s.num_sequences, seq_len=s.seq_len, batch_size=s.batch_size, seed=cfg.seed + 2,
                       stream_offset=stream_offsets(cfg, plan)["selection"]))


def convert(plan: RunPlan, model, calibration, selection=None):
    """The MLA model for `plan.spec`, or the model unchanged for the original / full-attention rows and for a
    saved MLA folder (already converted)."""
    if plan.spec is None or getattr(model.config, "model_type", None) == "mha2mla":
        return model
    return convert_to_mla(model, **plan.spec.to_dict(), calibration=calibration, selection=selection)


def distill(cfg: DictConfig, plan: RunPlan, teacher, student, data) -> dict:
    """Layer-wise distillation of the converted attention blocks on train-split samples."""
    from ..data import calibration_batches as sample
    from ..train.distill import distill_attention_layers

    d = cfg.distill
    # a different seed (a finite corpus) or offset (a stream) from the calibration sample: other text
    batches = list(sample(data, n=d.sequences, seq_len=d.seq_len, batch_size=d.batch_size, seed=cfg.seed + 1,
                          stream_offset=stream_offsets(cfg, plan)["distill"]))
    return distill_attention_layers(teacher, student, batches, epochs=d.epochs, lr=d.lr)


def heldout_probe(cfg: DictConfig, data):
    """The in-training recovery probe: held-out perplexity on `train.eval_batches` batches of held-out rows,
    chosen as the final evaluation chooses its rows (`eval.perplexity.rows`, data/held_out.py; the same rows for
    every run), before the first step, every `train.eval_every` steps (0: none in between) and after the last."""
    from ..evaluation.perplexity import perplexity
    from ..evaluation.run import held_out_sample

    p = cfg.eval.get("perplexity", {})
    probe = {"batch_size": int(p.get("batch_size", 8)), "max_batches": int(cfg.train.get("eval_batches", 2)),
             "rows": p.get("rows", "stratified"), "row_seed": int(p.get("row_seed", 0))}
    batches, _ = held_out_sample(data.held_out, data.held_out_documents(), probe)
    batches = list(batches)
    return lambda model: {"heldout_ppl_probe": perplexity(model, batches)}


def teacher_for(plan: RunPlan, original):
    """The frozen original model as the distillation teacher, in the compute dtype (bf16 where it is used)."""
    return original.to(plan.precision.compute_dtype).eval().requires_grad_(False)


@torch.no_grad()
def measure_kv(cfg: DictConfig, plan: RunPlan, model, data) -> dict:
    """Bytes per token actually held by the model's cache (latent or K/V, quantized or not) after a
    prefill of `kv_measure_tokens` held-out tokens, next to the nominal ratio."""
    from ..evaluation.kv import CacheMeter, KVQuant, kv_record, new_cache

    kv_quant = KVQuant.from_cfg(plan.kv_quant)
    tokens = data.held_out.reshape(-1)[: cfg.kv_measure_tokens].unsqueeze(0).to(model.device)
    cache, meter = new_cache(model, kv_quant), CacheMeter()
    model(input_ids=tokens, cache=cache, use_cache=True)
    meter.record(cache, batch_size=1)
    record = kv_record(model, kv_quant, meter)
    record["measured_at_tokens"] = tokens.shape[1]
    record["note"] = (f"cache_nbytes() after one prefill of {tokens.shape[1]} held-out tokens (quantization "
                      "scales, group padding and residual full-precision tokens included)")
    return record


def also_held_out(data, train_data) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{name: (rows, each row's document)} of the fine-tune's own corpus's held-out split, cut to the run's
    held-out row length, scored beside the run's held-out rows; ValueError (before any training) when it holds
    not one such row."""
    if train_data is None:
        return {}
    from ..data import pack

    length = data.held_out.shape[1]
    rows = pack(train_data.stream("held_out"), length).rows
    if rows.shape[0] == 0:
        raise ValueError(f"train.data.held_out_fraction: the held-out split of {train_data.name!r} has "
                         f"{train_data.stream('held_out').numel()} tokens, not one row of {length} to score")
    return {train_data.name: (rows, train_data.held_out_documents(length))}


def evaluate(cfg: DictConfig, plan: RunPlan, model, tokenizer, data, run_dir=None, also=None, where=None,
             process_group=None) -> dict:
    """The record's `eval` block: held-out perplexity always, plus the suites `cfg.eval` enables;
    their per-document results go into `run_dir` (evaluation.samples.SAMPLES_FILE). `also`: {name: rows} of
    other held-out text scored the same way (`also_held_out`). `where`: the run's `placement` (default: the
    model's device). Under several processes every one calls this: the lm-eval suites split their documents
    between them (their collectives on `process_group`), and the main process's return value holds the whole
    result (the others' hold theirs)."""
    from ..evaluation import run_evaluation
    from ..evaluation.samples import SAMPLES_FILE

    started = time.perf_counter()
    model.eval()
    eval_cfg = OmegaConf.to_container(cfg.eval, resolve=True) | {"dtype": plan.eval_dtype}
    result = run_evaluation(
        model, tokenizer, eval_cfg,
        held_out=data.held_out, held_out_documents=data.held_out_documents(),
        kv_quant=plan.kv_quant, window=cfg.model.get("finetune_length"),
        samples_path=None if run_dir is None else Path(run_dir) / SAMPLES_FILE, extra_held_out=also,
        placement=where if where is not None else placement(cfg, plan, model.device), process_group=process_group,
    )
    log.info("evaluation took %.1f s", time.perf_counter() - started)
    return result


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
