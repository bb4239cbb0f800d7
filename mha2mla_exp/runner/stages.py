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


def resolve_device(cfg: DictConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def load(cfg: DictConfig, device: torch.device):
    """(model, tokenizer) from a hub id, a local folder or an offline asset."""
    from ..models import load_model

    return load_model(cfg.model, device=device)


def prepare_data(cfg: DictConfig, tokenizer):
    """Tokenized, packed train / held-out splits (split by document: never train on held-out text)."""
    from ..data import prepare_data as prepare

    return prepare(cfg.data, tokenizer)


def calibration_batches(cfg: DictConfig, plan: RunPlan, data) -> list[torch.Tensor] | None:
    """Calibration samples for 2-norm and activation-aware SVD, drawn from the training split;
    None when neither needs them."""
    if plan.spec is None or (plan.spec.rope != "2-norm" and plan.spec.init != "activation"):
        return None
    from ..data import calibration_batches as sample

    c = cfg.calibration
    return list(sample(data, n=c.num_sequences, seq_len=c.seq_len, batch_size=c.batch_size))


def convert(plan: RunPlan, model, calibration):
    """The MLA model for `plan.spec`, or the model unchanged for the original / full-attention rows and for a
    saved MLA folder (already converted)."""
    if plan.spec is None or getattr(model.config, "model_type", None) == "mha2mla":
        return model
    s = plan.spec
    return convert_to_mla(model, rope=s.rope, r=s.r, svd=s.svd, d_kv=s.d_kv, score=s.score, sigma=s.sigma,
                          init=s.init, calibration=calibration)


def distill(cfg: DictConfig, teacher, student, data) -> dict:
    """Layer-wise distillation of the converted attention blocks on train-split samples."""
    from ..data import calibration_batches as sample
    from ..train.distill import distill_attention_layers

    d = cfg.distill
    # a different seed from the calibration sample, so the two stages see different text
    batches = list(sample(data, n=d.sequences, seq_len=d.seq_len, batch_size=d.batch_size, seed=cfg.seed + 1))
    return distill_attention_layers(teacher, student, batches, epochs=d.epochs, lr=d.lr)


def heldout_probe(cfg: DictConfig, data):
    """The in-training recovery probe (`train.eval_every` > 0): held-out perplexity on the first
    `train.eval_batches` batches of the held-out rows, the same rows for every run."""
    if not cfg.train.get("eval_every"):
        return None
    from ..evaluation.perplexity import perplexity
    from ..evaluation.run import held_out_batches

    batch_size = int(cfg.eval.get("perplexity", {}).get("batch_size", 8))
    batches = held_out_batches(data.held_out, batch_size)[: int(cfg.train.get("eval_batches", 2))]
    return lambda model: {"heldout_ppl_probe": perplexity(model, batches)}


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


def evaluate(cfg: DictConfig, plan: RunPlan, model, tokenizer, data, run_dir=None) -> dict:
    """The record's `eval` block: held-out perplexity always, plus the suites `cfg.eval` enables;
    their per-document results go into `run_dir` (evaluation.samples.SAMPLES_FILE)."""
    from ..evaluation import run_evaluation
    from ..evaluation.samples import SAMPLES_FILE

    started = time.perf_counter()
    model.eval()
    result = run_evaluation(
        model, tokenizer, OmegaConf.to_container(cfg.eval, resolve=True),
        held_out=data.held_out, kv_quant=plan.kv_quant, window=cfg.model.get("finetune_length"),
        samples_path=None if run_dir is None else Path(run_dir) / SAMPLES_FILE,
    )
    log.info("evaluation took %.1f s", time.perf_counter() - started)
    return result


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
