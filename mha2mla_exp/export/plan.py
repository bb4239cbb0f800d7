"""Which converted models export exactly to DeepSeek-V3, decided from the config alone (before weights load).

DeepSeek's attention (HF DeepseekV3Attention, vLLM deepseek_v2.py) has one rope key of qk_rope_head_dim dims
read by every head, rotated in interleaved pairs at rope_theta^(-2j/d_r); NoPE queries/keys of
qk_nope_head_dim per head from a latent of kv_lora_rank behind an RMSNorm; no q/k/v/o biases; one latent width
and one rope width for every layer; the dense MLP a SiLU-gated Llama MLP. Our 'shared' layout (RoRoPE) is that
attention when its kept frequencies are a geometric set from pair 0, {0, s, ..., (K-1)s} with one stride s
(then rope_theta' = theta^(s*2K/d_h)); anything else is refused here, or approximated on request.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# the source families whose blocks are Llama's (RMSNorm, SiLU-gated MLP); qwen2's biases are refused below
LLAMA_BLOCK_SOURCES = ("llama", "mistral", "qwen2")


class ExportError(ValueError):
    """A converted model that DeepSeek's format cannot hold exactly; the message names why."""


@dataclass(frozen=True)
class ExportPlan:
    """How a converted model maps onto DeepSeek-V3 (the same for every layer)."""

    pairs: list[int]  # kept frequency pairs of the shared rope key, sorted (source head-dim pairs)
    stride: int | None  # s of the geometric set {0, s, ...}; None when approximated
    rope_dim: int  # qk_rope_head_dim = 2 * len(pairs)
    nope_dim: int  # qk_nope_head_dim = d_h (the whole query head meets the NoPE keys)
    latent: int  # kv_lora_rank
    theta: float  # the source's rope_theta
    theta_export: float  # DeepSeek's rope_theta: its rope dims' frequencies
    exact: bool  # False: the kept frequencies were moved to the nearest geometric set (approximate=True)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_export(config, approximate: bool = False) -> ExportPlan:
    """The export plan of a converted model's config (an MLAConfig); ExportError naming why it cannot be exact.
    `approximate=True` accepts kept frequencies that are not a geometric set, moving each to the nearest set."""
    if getattr(config, "model_type", None) != "mha2mla":
        raise ExportError(f"not a converted model: model_type={getattr(config, 'model_type', None)!r}, not 'mha2mla'")
    mla = config.mla or {}
    source = mla.get("source_model_type")
    if source not in LLAMA_BLOCK_SOURCES:
        raise ExportError(
            f"source_model_type={source!r}: DeepSeek's blocks are Llama's ({', '.join(LLAMA_BLOCK_SOURCES)})"
        )
    if config.rope_layout != "shared":
        raise ExportError(
            f"rope_layout={config.rope_layout!r}: each KV head keeps its own rope key; DeepSeek has one rope key "
            "read by every head (convert with rope=rorope-geometric, layout 'shared')"
        )
    biases = [name for name in ("q_bias", "kv_bias", "o_bias") if getattr(config, name)]
    if biases or getattr(config, "mlp_bias", False):
        raise ExportError(
            f"{', '.join(biases + ['mlp_bias'] * bool(config.mlp_bias))}: DeepSeek's attention and MLP have no biases"
        )
    # families beyond Llama's attention (mla/families.py): norms on q/k, logit soft-capping, sliding windows
    extras = [k for k in ("q_norm", "k_norm", "attn_softcap", "sliding_windows") if getattr(config, k, None)]
    if extras:
        raise ExportError(f"{', '.join(extras)}: DeepSeek's attention has no such part")
    if config.hidden_act != "silu":
        raise ExportError(f"hidden_act={config.hidden_act!r}: vLLM's DeepSeek MLP is SiLU-gated only")
    if config.latent_dims and len(set(config.latent_dims)) > 1:
        raise ExportError(f"latent_dims={config.latent_dims}: DeepSeek has one kv_lora_rank for every layer")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ExportError(
            f"rope_type={rope_type!r}: vLLM's DeepSeek maps every non-default rope_type onto its own YaRN or "
            "llama-4 scaling, not the source's"
        )
    layers = config.rope_pairs
    widths = {len(layer[0]) for layer in layers}
    if len(widths) > 1:
        raise ExportError(
            f"rope key widths differ between layers ({sorted(2 * w for w in widths)} dims): DeepSeek has one"
        )
    pairs = sorted(layers[0][0])
    d_h, n_kv = config.head_dim, config.num_key_value_heads
    if not pairs:
        raise ExportError("no rope pairs kept: DeepSeek's attention needs a rope key (qk_rope_head_dim > 0)")
    if 2 * len(pairs) >= n_kv * d_h:
        raise ExportError("every pair keeps RoPE: no NoPE keys are left for DeepSeek's qk_nope_head_dim")
    if any(sorted(layer[0]) != pairs for layer in layers[1:]):
        if not approximate:
            raise ExportError(
                "the kept frequencies differ between layers: DeepSeek's rope key turns at one set of frequencies "
                "(approximate=True moves them to the nearest geometric set and measures the change)"
            )
    if config.svd == "none":
        latent = n_kv * d_h * 2 - 2 * len(pairs)
    else:
        latent = config.latent_dims[0] if config.latent_dims else n_kv * config.d_kv
    theta = float(config.rope_parameters["rope_theta"])
    stride = geometric_stride(pairs)
    rope_dim = 2 * len(pairs)
    if stride is not None and all(sorted(layer[0]) == pairs for layer in layers):
        return ExportPlan(pairs, stride, rope_dim, d_h, latent, theta, theta ** (stride * rope_dim / d_h), True)
    if not approximate:
        raise ExportError(
            f"kept frequency pairs {pairs} are not a geometric set {{0, s, 2s, ...}}: DeepSeek's rope dims turn at "
            "rope_theta^(-2j/d_r) (approximate=True moves them to the nearest such set and measures the change)"
        )
    return ExportPlan(pairs, None, rope_dim, d_h, latent, theta, fitted_theta(pairs, theta, d_h), False)


def geometric_stride(pairs: list[int]) -> int | None:
    """s when `pairs` (sorted) are {0, s, 2s, ...}, else None."""
    if pairs[0] != 0:
        return None
    s = pairs[1] if len(pairs) > 1 else 1
    return s if s > 0 and pairs == [j * s for j in range(len(pairs))] else None


def fitted_theta(pairs: list[int], theta: float, head_dim: int) -> float:
    """The rope_theta whose DeepSeek frequencies theta'^(-2j/d_r) are nearest the kept pairs' theta^(-2f_j/d_h) in
    log space (least squares through j = 0, which always turns at frequency 1)."""
    d_r = 2 * len(pairs)
    if len(pairs) == 1:
        return theta
    # log inv_freq_j = -(2 f_j / d_h) log theta = -(2 j / d_r) log theta'  =>  log theta' = c log theta
    c = sum(j * f for j, f in enumerate(pairs)) / sum(j * j for j in range(len(pairs))) * d_r / head_dim
    return math.exp(c * math.log(theta))
