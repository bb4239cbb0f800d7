"""The runner's stages as plain functions: load -> data -> calibrate -> convert -> measure -> evaluate.

Each takes the section it reads, or the run's plan where it reads several (`plan.config`: the typed config
with what the entry resolved), and what the previous stage returned, so tests can call them one by one; the
layers they call receive their own section only. Fine-tuning lives in `mha2mla_exp.train`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from ..mla import convert_to_mla
from ..schema.sections import ModelConfig, TrainConfig
from .config import RunPlan

log = logging.getLogger(__name__)


def placement(model: ModelConfig, eval_dtype: str, device: torch.device):
    """Where and in what dtype every model this run evaluates runs, whatever made it (evaluation/placement.py):
    the suites in the resolved `eval.dtype`, the weights in `model.dtype`."""
    from ..evaluation.placement import EvalPlacement

    return EvalPlacement.decide(device, suites_dtype=eval_dtype, model_dtype=model.dtype)


def load(model: ModelConfig, where, device: torch.device):
    """(model, tokenizer) from a hub id, a local folder or an offline asset, in the placement's weights dtype:
    fp32 (the SVD and the master weights need it) unless model.dtype says otherwise, the untouched original
    included, so that every row's held-out perplexity runs in one precision and every row is cast to the
    suites' dtype the same way. `where`: the run's `placement`."""
    from ..models import load_model

    return load_model(model, device=device, dtype=where.weights_dtype)


def source_commit(model: ModelConfig, loaded) -> dict:
    """{"hub_commit": sha} for a hub model: the commit its weights were read at (`model.revision` pins it, else the
    hub's newest when loaded), so a record says which weights stand behind its hash; {} for other sources."""
    if model.source != "hub":
        return {}
    return {"hub_commit": getattr(loaded, "hub_commit", None)}


def load_trained(folder, device: torch.device):
    """A kept trained model (fp32, as it was saved), in eval mode."""
    from ..models import load_model

    return load_model(ModelConfig(name=str(folder), source="local", id=str(folder), dtype="float32"), device=device)


def prepare_training_data(train: TrainConfig, tokenizer):
    """The fine-tune's own corpus when `train.data` names one (e.g. text the teacher writes), else None."""
    from ..data import prepare_data

    return prepare_data(train.data, tokenizer) if train.enabled and train.data is not None else None


def training_rows(plan: RunPlan, data, num_processes: int):
    """The fine-tune's rows (train section, run seed, the model's pretraining tokens); a budget that would repeat
    a finite corpus is refused here, before any weight is loaded, unless train.epochs_allowed says so."""
    from ..data.stream import PrefetchedRows, TrainStream
    from ..train import check_epochs, plan_budget

    config = plan.config
    rows = data.training_rows(config.train.seq_len, seed=config.seed)
    budget = plan_budget(config.train, pretrain_tokens=config.model.pretrain_tokens, num_processes=num_processes)
    check_epochs(budget.tokens, rows.tokens_available, config.train.epochs_allowed)
    if isinstance(rows, TrainStream):  # a stream is read one step ahead, off the training thread
        return PrefetchedRows(rows)
    return rows


def calibration_batches(plan: RunPlan, data) -> list[torch.Tensor] | None:
    """Calibration samples for the RoPE strategy and low-rank init that read statistics (the spec says
    which), drawn from the training split; None when neither does."""
    if plan.spec is None or not plan.spec.needs_calibration:
        return None
    from ..data import calibration_batches as sample

    c = plan.config.calibration
    return list(sample(data, n=c.num_sequences, seq_len=c.seq_len, batch_size=c.batch_size))


def stream_offsets(plan: RunPlan) -> dict[str, int]:
    """Where each stage's sample starts in a streamed corpus, read in order: calibration at its head, the
    KV-budget search's after it, then layer-wise distillation's, one block per seed, so that no two stages
    (and no two seeds' distillations) read the same text. A finite corpus draws with seeds of its own instead."""
    config = plan.config
    calibration = 0
    if plan.spec is not None and plan.spec.needs_calibration:
        calibration = config.calibration.num_sequences * config.calibration.seq_len
    selection = 0
    if plan.spec is not None and plan.spec.searches:
        selection = config.svd.selection.num_sequences * config.svd.selection.seq_len
    distill = config.distill.sequences * config.distill.seq_len
    return {"calibration": 0, "selection": calibration, "distill": calibration + selection + config.seed * distill}


def selection_batches(plan: RunPlan, data) -> list[torch.Tensor] | None:
    """The rows a KV-budget search scores its candidate splits on (`svd.selection`): train split, a seed of
    their own (calibration draws with 0, layer-wise distillation with `seed + 1`); None when nothing is searched."""
    if plan.spec is None or not plan.spec.searches:
        return None
    from ..data import calibration_batches as sample

    s = plan.config.svd.selection
    return list(
        sample(
            data,
            n=s.num_sequences,
            seq_len=s.seq_len,
            batch_size=s.batch_size,
            seed=plan.config.seed + 2,
            stream_offset=stream_offsets(plan)["selection"],
        )
    )


def convert(plan: RunPlan, model, calibration, selection=None):
    """The MLA model for `plan.spec`, or the model unchanged for the original / full-attention rows and for a
    saved MLA folder (already converted)."""
    if plan.spec is None or getattr(model.config, "model_type", None) == "mha2mla":
        return model
    from ..evaluation.placement import EvalPlacement

    if torch.get_float32_matmul_precision() != "highest":
        log.info("conversion: calibration statistics and SVD in full fp32 (TF32 off until it ends)")
    with EvalPlacement.full_fp32():  # TF32 is on for the run on CUDA (EvalPlacement.apply_matmul_precision)
        return convert_to_mla(model, **plan.spec.to_dict(), calibration=calibration, selection=selection)


def distill(plan: RunPlan, teacher, student, data) -> dict:
    """Layer-wise distillation of the converted attention blocks on train-split samples."""
    from ..data import calibration_batches as sample
    from ..train.distill import distill_attention_layers

    d = plan.config.distill
    # a different seed (a finite corpus) or offset (a stream) from the calibration sample: other text
    batches = list(
        sample(
            data,
            n=d.sequences,
            seq_len=d.seq_len,
            batch_size=d.batch_size,
            seed=plan.config.seed + 1,
            stream_offset=stream_offsets(plan)["distill"],
        )
    )
    return distill_attention_layers(teacher, student, batches, epochs=d.epochs, lr=d.lr)


def heldout_probe(plan: RunPlan, data):
    """The in-training recovery probe: held-out perplexity on `train.eval_batches` batches of held-out rows,
    chosen as the final evaluation chooses its rows (`eval.perplexity.rows`, data/held_out.py; the same rows for
    every run), before the first step, every `train.eval_every` steps (0: none in between) and after the last."""
    from ..evaluation.perplexity import perplexity
    from ..evaluation.run import held_out_sample

    probe = dataclasses.replace(plan.config.eval.perplexity, max_batches=plan.config.train.eval_batches)
    batches, _ = held_out_sample(data.held_out, data.held_out_documents(), probe)
    batches = list(batches)
    return lambda model: {"heldout_ppl_probe": perplexity(model, batches)}


def teacher_for(plan: RunPlan, original):
    """The frozen original model as the distillation teacher, in the compute dtype (bf16 where it is used)."""
    return original.to(plan.precision.compute_dtype).eval().requires_grad_(False)


@torch.no_grad()
def measure_kv(plan: RunPlan, model, data) -> dict:
    """Bytes per token actually held by the model's cache (latent or K/V, quantized or not) after a
    prefill of `kv_measure_tokens` held-out tokens, next to the nominal ratio."""
    from ..evaluation.kv import CacheMeter, kv_record, new_cache

    kv_quant = plan.kv_quant
    tokens = data.held_out.reshape(-1)[: plan.config.kv_measure_tokens].unsqueeze(0).to(model.device)
    cache, meter = new_cache(model, kv_quant), CacheMeter()
    model(input_ids=tokens, cache=cache, use_cache=True)
    meter.record(cache, batch_size=1)
    record = kv_record(model, kv_quant, meter)
    record["measured_at_tokens"] = tokens.shape[1]
    record["note"] = (
        f"cache_nbytes() after one prefill of {tokens.shape[1]} held-out tokens (quantization "
        "scales, group padding and residual full-precision tokens included)"
    )
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
        raise ValueError(
            f"train.data.held_out_fraction: the held-out split of {train_data.name!r} has "
            f"{train_data.stream('held_out').numel()} tokens, not one row of {length} to score"
        )
    return {train_data.name: (rows, train_data.held_out_documents(length))}


def evaluate(plan: RunPlan, model, tokenizer, data, run_dir=None, also=None, where=None, process_group=None) -> dict:
    """The record's `eval` block: held-out perplexity always, plus the suites the `eval` section enables (its
    dtype as the entry resolved it);
    their per-document results go into `run_dir` (evaluation.samples.SAMPLES_FILE). `also`: {name: rows} of
    other held-out text scored the same way (`also_held_out`). `where`: the run's `placement` (default: the
    model's device). Under several processes every one calls this: the lm-eval suites split their documents
    between them (their collectives on `process_group`), and the main process's return value holds the whole
    result (the others' hold theirs)."""
    from ..evaluation import run_evaluation
    from ..evaluation.samples import SAMPLES_FILE

    started = time.perf_counter()
    model.eval()
    result = run_evaluation(
        model,
        tokenizer,
        plan.config.eval,
        held_out=data.held_out,
        held_out_documents=data.held_out_documents(),
        kv_quant=plan.kv_quant,
        window=plan.config.model.finetune_length,
        samples_path=None if run_dir is None else Path(run_dir) / SAMPLES_FILE,
        extra_held_out=also,
        placement=where if where is not None else placement(plan.config.model, plan.eval_dtype, model.device),
        process_group=process_group,
    )
    log.info("evaluation took %.1f s", time.perf_counter() - started)
    return result


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
