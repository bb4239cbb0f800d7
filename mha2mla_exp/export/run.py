"""The export end to end: check OUT and the target, plan (refuse early), load, norm scale, map, save into a
temporary sibling, verify, record (`export.json`), rename into place."""

from __future__ import annotations

import copy
import platform
import warnings
from pathlib import Path

import torch

from .. import mla  # noqa: F401  (registers the mha2mla model type with the Auto classes)
from ..atomic import write_json
from ..mla.spec import MLASpec, ModelShape, kv_elements_per_token
from . import norm
from .place import RECORD, check_out, staged
from .plan import ExportError, plan_export
from .targets import check_target, fitting_targets, gpu_backends
from .weights import deepseek_config, deepseek_state

# the fixed text the norm is calibrated on and the logits are compared on (with a seeded random-token sequence)
FIXED_TEXT = (
    "The method exists to make inference cheaper. A converted model caches a low-rank latent and a small rope key "
    "instead of every head's keys and values; the serving engine reads the latent directly. Memory and throughput "
    "are measured in the engine, not assumed: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89."
)


def _sample_ids(tokenizer, vocab_size: int, seed: int = 0, random_len: int = 128) -> list[torch.Tensor]:
    """The fixed text's ids (when a tokenizer came with the model) and a seeded random-token sequence."""
    g = torch.Generator().manual_seed(seed)
    sample = [torch.randint(0, vocab_size, (1, random_len), generator=g)]
    if tokenizer is not None:
        sample.insert(0, torch.tensor([tokenizer(FIXED_TEXT)["input_ids"]]))
    return sample


@torch.no_grad()
def _max_dlogit(model, other, sample: list[torch.Tensor]) -> tuple[float, float]:
    """(max |dlogit|, max |logit| of `model`) over the sample, both models run as they are (fp32 here)."""
    diff, peak = 0.0, 0.0
    for ids in sample:
        ours = model(input_ids=ids, use_cache=False).logits
        diff = max(diff, (ours - other(input_ids=ids, use_cache=False).logits).abs().max().item())
        peak = max(peak, ours.abs().max().item())
    return diff, peak


def _logit_change(model, out: Path, sample: list[torch.Tensor]) -> dict:
    """Max |dlogit| (fp32) of the exported folder, loaded by stock transformers, against `model` (fp32)."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if type(exported).__module__.split(".")[1] != "models":  # stock transformers' class, not remote code
        raise RuntimeError(f"the export loaded as {type(exported)}, not a stock transformers model")
    diff, peak = _max_dlogit(model, exported, sample)
    return {
        "loaded_as": type(exported).__name__,
        "tokens": [int(ids.shape[1]) for ids in sample],
        "max_abs_dlogit_fp32": diff,
        "max_abs_logit_fp32": peak,
        "relative": diff / peak if peak else 0.0,
    }


def _mapping_change(model, ds_config, plan, weights, sample: list[torch.Tensor]) -> float:
    """Max |dlogit| of the mapping kept in fp32 (a 16-bit folder adds the rounding of the rows it rescales)."""
    from transformers import DeepseekV3ForCausalLM

    config = copy.deepcopy(ds_config)
    config.dtype = torch.float32
    target = DeepseekV3ForCausalLM(config).eval()
    target.load_state_dict(deepseek_state(model, plan, weights, torch.float32))
    return _max_dlogit(model, target, sample)[0]


def export(
    src: str | Path,
    out: str | Path,
    *,
    target: str | None = None,
    approximate: bool = False,
    margin: float = 1e-6,
) -> dict:
    """Write `src` (a converted model folder) to `out` as a stock DeepSeek-V3 folder; return the record.

    `out` may only be a new or empty folder or an earlier export (place.py); it is replaced only once the new
    export is complete. `target` (targets.TARGETS): refuse widths its MLA backends cannot serve, warn where only
    some can. `approximate`: accept kept frequencies that are not a geometric set (moved to the nearest one; the
    record says so and measures the logit change). `margin`: the latent norm's mean((s c)^2)/eps on calibration.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    src, out = Path(src), Path(out)
    check_out(src, out)  # before anything is read
    if not (src / "config.json").is_file():  # a local folder, never a hub id
        raise ExportError(f"SRC {src} has no config.json: not a saved model folder")
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    plan = plan_export(config, approximate=approximate)  # refuses before any weight is read
    target_warnings = check_target(plan, config, target) if target else []
    for warning in target_warnings:
        warnings.warn(warning, stacklevel=2)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True).eval()
    model.config.absorb = False
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    sample = _sample_ids(tokenizer, config.vocab_size)

    eps = config.rms_norm_eps
    peaks = [max(p) for p in zip(*(norm.latent_mean_squares(model, ids) for ids in sample))]
    weights = norm.identity_weights(peaks, eps, margin)
    ds_config = DeepseekV3Config(**deepseek_config(config, plan))
    ds_config.dtype = dtype
    with torch.device("meta"):
        deepseek = DeepseekV3ForCausalLM(ds_config)
    state = deepseek_state(model, plan, weights, dtype)
    missing, unexpected = deepseek.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"the DeepSeek-V3 model's weights did not match: missing={missing} unexpected={unexpected}")
    with staged(out) as folder:
        deepseek.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        record = _record(src, config, plan, dtype, eps, margin, peaks, weights)
        record["targets"] |= {"asked": target, "warnings": target_warnings}
        record["verification"] = _logit_change(model, folder, sample)
        if dtype != torch.float32:
            record["verification"]["mapping_max_abs_dlogit_fp32"] = _mapping_change(
                model, ds_config, plan, weights, sample
            )
        write_json(folder / RECORD, record)
    return record


def _record(src: Path, config, plan, dtype, eps: float, margin: float, peaks: list, weights: list) -> dict:
    """export.json less the verification: what was exported, how, and where it can be served."""
    shape = ModelShape.from_config(config)
    spec = MLASpec.recorded(config.mla)
    record = {
        "source": str(src),
        "format": "deepseek_v3 (stock transformers DeepseekV3ForCausalLM; vLLM DeepseekV3ForCausalLM, MLA cache)",
        "dtype": str(dtype).removeprefix("torch."),
        "conversion": {k: v for k, v in config.mla.items() if k in ("rope", "r", "svd", "d_kv", "score", "init")},
        "plan": plan.to_dict(),
        "rope_pairs_per_layer": [sorted(layer[0]) for layer in config.rope_pairs],
        "kv_elements_per_token": kv_elements_per_token(shape, spec) if spec.kv_elements or spec.d_kv else None,
        "cache_elements_per_token": plan.latent + plan.rope_dim,
        "original_kv_elements_per_token": 2 * shape.num_kv_heads * shape.head_dim,
        "targets": {"fits": fitting_targets(plan), "vllm_gpu_backends": gpu_backends(plan)},
        "rope": "YaRN at factor 1: the default rope's frequencies and scale on vLLM's exact path (weights.py)",
        "mapping": {
            "q_proj": "per head [q_h; q_h[rope pairs] * q_rope_scale (interleaved)] * sqrt((d_h + d_r) / d_h)",
            "kv_a_proj_with_mqa": "[kv_down_proj * s; k_rope_proj (interleaved)]",
            "kv_a_layernorm": "weight sqrt(eps)/s (a power of two): the identity to `norm.residual`",
            "kv_b_proj": "per head [k_up; v_up] of its KV group over the whole latent",
            "mlp": "first_k_dense_replace = num_hidden_layers: every layer's dense MLP is the Llama MLP",
            "lm_head": "written untied",
        },
        "norm": {"eps": eps, "margin": margin, "weights": weights, "peak_mean_square": peaks},
        "verification": {},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
    }
    record["norm"]["residual"] = norm.residual(peaks, weights)
    return record


__all__ = ["ExportError", "export"]
