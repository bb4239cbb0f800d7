"""The runner's stages as plain functions: load -> convert (calibration and selection samples included) -> distill
-> measure -> evaluate.

Each takes its own part of the plan (the conversion's spec, the evaluation's plan, ...) and the config sections
it reads (the typed config with what the entry resolved), never the whole plan, and what the previous stage
returned, so tests can call them one by one. Fine-tuning lives in `mha2mla_exp.train`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..evaluation.plan import EvalPlan
from ..mla import convert_to_mla
from ..mla.spec import MLASpec
from ..schema.sections import EvalConfig, ModelConfig, RunConfig, TrainConfig

log = logging.getLogger(__name__)


def load(model: ModelConfig, where, device: torch.device):
    """(model, tokenizer) from a hub id, a local folder or an offline asset, in the placement's weights dtype:
    fp32 (the SVD and the master weights need it) unless model.dtype says otherwise, the untouched original
    included, so that every row's held-out perplexity runs in one precision and every row is cast to the
    suites' dtype the same way. `where`: the run's placement (`EvalPlan.placement`)."""
    from ..models import load_model

    return load_model(model, device=device, dtype=where.weights_dtype)


def source_commit(source: str, loaded) -> dict:
    """{"hub_commit": sha} for a hub model (`model.source`): the commit its weights were read at (`model.revision`
    pins it, else the hub's newest when loaded), so a record says which weights stand behind its hash; {} for other
    sources."""
    if source != "hub":
        return {}
    return {"hub_commit": getattr(loaded, "hub_commit", None)}


def load_trained(folder, device: torch.device):
    """A kept trained model (fp32, as it was saved), in eval mode."""
    from ..models import load_model

    return load_model(ModelConfig(name=str(folder), source="local", id=str(folder), dtype="float32"), device=device)


def training_rows(train: TrainConfig, tokens: int, data, seed: int):
    """The fine-tune's rows of `tokens` (the training plan's budget) for the run's seed; a budget that would repeat
    a finite corpus is refused here, before any weight is loaded, unless train.epochs_allowed says so."""
    from ..data.stream import PrefetchedRows, TrainStream
    from ..train import check_epochs

    rows = data.training_rows(train.seq_len, seed=seed)
    check_epochs(tokens, rows.tokens_available, train.epochs_allowed)
    if isinstance(rows, TrainStream):  # a stream is read one step ahead, off the training thread
        return PrefetchedRows(rows)
    return rows


def stream_offsets(spec: MLASpec | None, config: RunConfig) -> dict[str, int]:
    """Where each stage's sample starts in a streamed corpus, read in order: calibration at its head, the
    KV-budget search's after it, then layer-wise distillation's, one block per seed, so that no two stages
    (and no two seeds' distillations) read the same text. A finite corpus draws with seeds of its own instead."""
    calibration = 0
    if spec is not None and spec.needs_calibration:
        calibration = config.calibration.num_sequences * config.calibration.seq_len
    selection = 0
    if spec is not None and spec.searches:
        selection = config.svd.selection.num_sequences * config.svd.selection.seq_len
    distill = config.distill.sequences * config.distill.seq_len
    return {"calibration": 0, "selection": calibration, "distill": calibration + selection + config.seed * distill}


def convert(spec: MLASpec | None, config: RunConfig, model, data):
    """The MLA model for `spec`, or the model unchanged for the original / full-attention rows (no spec) and for a
    saved MLA folder (already converted). Its calibration sample (`calibration`: what the strategy and the init
    read, the spec says which) and a KV budget's selection sample (`svd.selection`) come from the training split."""
    if spec is None or getattr(model.config, "model_type", None) == "mha2mla":
        return model
    from ..data import calibration_batches as sample
    from ..evaluation.placement import EvalPlacement

    calibration = selection = None
    if spec.needs_calibration:
        c = config.calibration
        calibration = list(sample(data, n=c.num_sequences, seq_len=c.seq_len, batch_size=c.batch_size))
    if spec.searches:  # a seed of their own (calibration draws with 0, layer-wise distillation with `seed + 1`)
        s = config.svd.selection
        offset = stream_offsets(spec, config)["selection"]
        selection = list(
            sample(
                data,
                n=s.num_sequences,
                seq_len=s.seq_len,
                batch_size=s.batch_size,
                seed=config.seed + 2,
                stream_offset=offset,
            )
        )
    if torch.get_float32_matmul_precision() != "highest":
        log.info("conversion: calibration statistics and SVD in full fp32 (TF32 off until it ends)")
    with EvalPlacement.full_fp32():  # TF32 is on for the run on CUDA (EvalPlacement.apply_matmul_precision)
        return convert_to_mla(model, spec, calibration=calibration, selection=selection)


def distill(spec: MLASpec, config: RunConfig, teacher, student, data) -> dict:
    """Layer-wise distillation of the converted attention blocks on train-split samples."""
    from ..data import calibration_batches as sample
    from ..train.distill import distill_attention_layers

    d = config.distill
    # a different seed (a finite corpus) or offset (a stream) from the calibration sample: other text
    batches = list(
        sample(
            data,
            n=d.sequences,
            seq_len=d.seq_len,
            batch_size=d.batch_size,
            seed=config.seed + 1,
            stream_offset=stream_offsets(spec, config)["distill"],
        )
    )
    return distill_attention_layers(teacher, student, batches, epochs=d.epochs, lr=d.lr)


def teacher_for(compute_dtype: torch.dtype, original):
    """The frozen original model as the distillation teacher, in the fine-tune's compute dtype (bf16 where it is
    used)."""
    return original.to(compute_dtype).eval().requires_grad_(False)


@torch.no_grad()
def measure_kv(kv_quant, measure_tokens: int, model, data) -> dict:
    """Bytes per token actually held by the model's cache (latent or K/V, quantized as `kv_quant` says or not)
    after a prefill of `measure_tokens` held-out tokens, next to the nominal ratio."""
    from ..evaluation.kv import CacheMeter, kv_record, new_cache

    tokens = data.held_out.reshape(-1)[:measure_tokens].unsqueeze(0).to(model.device)
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


def evaluate(
    plan: EvalPlan,
    evaluation: EvalConfig,
    model,
    tokenizer,
    data,
    *,
    window=None,
    run_dir=None,
    also=None,
    process_group=None,
) -> dict:
    """The record's `eval` block: held-out perplexity always, plus the suites the `eval` section enables (its
    dtype as the entry resolved it), placed and KV-quantized as the evaluation's `plan` (EvalPlan) says; their
    per-document results go into `run_dir` (evaluation.samples.SAMPLES_FILE). `also`: {name: rows} of other
    held-out text scored the same way (`also_held_out`); `window`: the model's fine-tuning length. Under several
    processes every one calls this: the lm-eval suites split their documents between them (their collectives
    on `process_group`), and the main process's return value holds the whole result (the others' hold theirs)."""
    from ..evaluation import run_evaluation
    from ..evaluation.samples import SAMPLES_FILE

    started = time.perf_counter()
    model.eval()
    result = run_evaluation(
        model,
        tokenizer,
        evaluation,
        held_out=data.held_out,
        held_out_documents=data.held_out_documents(),
        kv_quant=plan.kv_quant,
        window=window,
        samples_path=None if run_dir is None else Path(run_dir) / SAMPLES_FILE,
        extra_held_out=also,
        placement=plan.placement(model.device),
        process_group=process_group,
    )
    log.info("evaluation took %.1f s", time.perf_counter() - started)
    return result


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
