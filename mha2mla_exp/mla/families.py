"""The decoder families the converter takes, and how each one's attention is read.

Everything but attention stays the base architecture's own (its MLP or MoE, norms, embedding scale, logit
soft-capping, sliding windows, per-layer rope bases): the converted model is the stock transformers model with
its attention modules swapped (mla/modeling.py). What differs between families is only how their attention
computes the pre-RoPE queries and keys, which `SourceAttention` presents in one form:
- separate or fused (Phi-3's `qkv_proj`) projections;
- QK-norm: an RMSNorm of the queries and keys before RoPE, per head (Qwen3, Gemma-3) or over the whole
  projection (OLMo-2), with a gain `w` (Gemma scales by 1 + w);
- the score scale (Gemma's query_pre_attn_scalar) and a tanh soft cap on the scores (Gemma-2).

A key norm is exact in MLA as a scalar per token and norm group (KV head, or one for the whole projection):
RoPE rotates pairs, so it commutes with the per-dim gain (folded into the key rows) and with 1/rms(k), which
needs the whole raw key of the token and is cached beside the latent (`key_norm_scales` elements per token).
To add a family: one entry in FAMILIES (and a model config in conf/model/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NORM_KINDS = ("head", "projection")  # the groups a QK-norm's rms runs over


@dataclass(frozen=True)
class Family:
    """How a family's attention module holds its projections and norms."""

    qk_norm: str | None = None  # None | 'head' | 'projection'
    norm_offset: float = 0.0  # the norm's gain is offset + weight (Gemma: 1 + w)
    fused_qkv: bool = False  # one `qkv_proj`, rows [q | k | v] (Phi-3)
    rope_per_layer_type: bool = False  # rope parameters per layer type (Gemma-3: full / sliding attention)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "mixtral": Family(),
    "qwen2": Family(),
    "qwen2_moe": Family(),
    "qwen3": Family(qk_norm="head"),
    "qwen3_moe": Family(qk_norm="head"),
    "olmo2": Family(qk_norm="projection"),
    "gemma2": Family(),
    "gemma3_text": Family(qk_norm="head", norm_offset=1.0, rope_per_layer_type=True),
    "phi3": Family(fused_qkv=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(config) -> Family:
    """The family of a transformers config; ValueError naming the architecture when it is not one we convert."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        hint = " (take its text model: Gemma3ForCausalLM, model_type 'gemma3_text')" if model_type == "gemma3" else ""
        raise ValueError(
            f"unsupported architecture {model_type!r}: convert_to_mla handles decoder LMs of the families "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
        )
    return FAMILIES[model_type]


def unsupported_features(config) -> list[str]:
    """What a config of a supported family asks for that the conversion cannot keep exactly (empty: none)."""
    found = []
    rope = getattr(config, "rope_parameters", None) or {}
    partial = [p.get("partial_rotary_factor", 1.0) for p in _rope_blocks(rope)]
    partial.append(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    if any(p != 1.0 for p in partial):
        found.append(
            f"partial_rotary_factor={min(partial)}: its rotated pairs are (f, f + rot/2), not the head's pairs "
            "(f, f + d_h/2) that the RoPE strategies select among"
        )
    if getattr(config, "use_bidirectional_attention", False):
        found.append("use_bidirectional_attention: MLA's latent cache is for causal decoding")
    return found


SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def attention_windows(config) -> list[int | None]:
    """Per decoder layer, the sliding window of its attention (None: full attention), read from the config as
    transformers' DynamicCache reads it (`layer_types`, else `sliding_window`): the original's cache keeps that
    many tokens on the layer, its masks attend that far, and so do the converted model's."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    # chunked layers are cached as sliding ones (transformers); no family converted here has them
    return [kw.get("sliding_window") if kind in SLIDING_LAYER_TYPES else None for kind, kw in zip(types, kwargs)]


def visible_keys(t: int, window: int | None, device=None) -> torch.Tensor:
    """[t, t] bool: which keys each query of an unpadded row sees, causally and within `window` (None: all
    before it), as transformers' sliding-window masks (a key less than `window` positions back)."""
    visible = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return visible if window is None else visible.triu(1 - window)


def norm_groups(kind: str | None, num_kv_heads: int) -> int:
    """The key norm's groups, each with its own 1/rms cached per token and layer: n_kv for a per-head norm, 1 for
    a norm over the whole projection, 0 without one."""
    return {None: 0, "head": num_kv_heads, "projection": 1}[kind]


def rope_per_layer_type(rope) -> bool:
    """Whether rope parameters come as one block per layer type (Gemma-3's full / sliding attention)."""
    return isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())


def _rope_blocks(rope: dict) -> list[dict]:
    """The rope parameter blocks of a config: one, or one per layer type."""
    if rope_per_layer_type(rope):
        return [v for v in rope.values() if isinstance(v, dict)]
    return [rope] if rope else []


@dataclass
class QKNorm:
    """An RMSNorm of queries or keys before RoPE: x / rms(x) * gain, rms over each head ('head') or over the
    whole projection ('projection'), computed in float32 as transformers' norms do."""

    kind: str
    gain: torch.Tensor  # [heads * d_h], the offset (Gemma's 1 +) included
    eps: float


def rms_scale(x: torch.Tensor, kind: str, head_dim: int, eps: float) -> torch.Tensor:
    """1 / rms of `x` [..., heads * d_h] per norm group, float32: [..., heads] ('head') or [..., 1]."""
    x = x.float()
    groups = x.view(*x.shape[:-1], -1, head_dim) if kind == "head" else x.unsqueeze(-2)
    return torch.rsqrt(groups.pow(2).mean(-1) + eps)


def scale_groups(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., groups * n] times scale [..., groups] per group, in float32 (the result float32)."""
    return (x.float().view(*x.shape[:-1], scale.shape[-1], -1) * scale[..., None]).reshape(x.shape)


def apply_norm(x: torch.Tensor, kind: str, head_dim: int, eps: float, gain: torch.Tensor) -> torch.Tensor:
    """x / rms(x) * gain, with transformers' rounding: normalised in float32, gain applied in float32."""
    return (scale_groups(x, rms_scale(x, kind, head_dim, eps)) * gain.float()).to(x.dtype)


class SourceAttention:
    """One source attention layer in one form: q/k/v/o projections (nn.Linear; fused ones split as views), its
    QK-norms, score scale, soft cap and sliding window (`attention_windows`). Under a key norm `k_proj` holds the
    key rows with the norm's gain folded in and `k_scale_proj` the raw key projection: a key is
    k_proj(x) * 1/rms(k_scale_proj(x)) per norm group, as the converted attention computes it."""

    def __init__(self, attn: nn.Module, family: Family, shape, sliding_window: int | None = None):
        self.module = attn
        self.shape = shape
        n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
        if family.fused_qkv:
            self.q_proj, self.k_proj, self.v_proj = _split_linear(attn.qkv_proj, [n_h * d_h, n_kv * d_h, n_kv * d_h])
        else:
            missing = [p for p in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, p)]
            if missing:
                raise ValueError(f"{type(attn).__name__} lacks the projections {missing}")
            self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.o_proj
        self.k_scale_proj = None
        if (self.k_proj.bias is None) != (self.v_proj.bias is None):
            raise ValueError("k_proj and v_proj must both have a bias or both have none")
        self.q_norm = self._norm(getattr(attn, "q_norm", None), family, n_h)
        self.k_norm = self._norm(getattr(attn, "k_norm", None), family, n_kv)
        if self.k_norm is not None and self.k_proj.bias is not None:
            raise ValueError(
                "a key projection with both a bias and a key norm: the bias would score q.b/rms(k) per key, "
                "which absorbed decoding cannot drop; no supported family has it"
            )
        if self.k_norm is not None:
            self.k_scale_proj = self.k_proj
            self.k_proj = _scaled_linear(self.k_proj, self.k_norm.gain.to(self.k_proj.weight.dtype))
        self.scaling = float(getattr(attn, "scaling", d_h**-0.5))
        self.softcap = getattr(attn, "attn_logit_softcapping", None)
        self.sliding_window = sliding_window  # the config's (Mistral's attention module holds none)
        self._last_input, self._projected = None, {}

    def _norm(self, norm: nn.Module | None, family: Family, heads: int) -> QKNorm | None:
        if family.qk_norm is None or norm is None:
            return None
        d_h = self.shape.head_dim
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        gain = family.norm_offset + norm.weight.detach().float()
        if family.qk_norm == "head":  # one gain per head dim, the same for every head
            gain = gain.repeat(heads)
        if gain.numel() != heads * d_h or eps is None:
            raise ValueError(f"{type(norm).__name__}: expected a {family.qk_norm} RMSNorm of {heads} x {d_h} dims")
        return QKNorm(family.qk_norm, gain, float(eps))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE queries [..., n_h*d_h], after the query norm."""
        return self._once("queries", x, self._queries)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [..., n_kv*d_h], after the key norm."""
        return self._once("keys", x, self._keys)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        return self._once("values", x, lambda x: F.linear(x, self.v_proj.weight, self.v_proj.bias))

    def _once(self, what: str, x: torch.Tensor, compute) -> torch.Tensor:
        """`compute(x)`, reused while x is the same input: the statistics of one calibration pass all read a
        layer's projections of the same forward."""
        if self._last_input is not x:
            self._last_input, self._projected = x, {}
        if what not in self._projected:
            self._projected[what] = compute(x)
        return self._projected[what]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = F.linear(x, self.q_proj.weight, self.q_proj.bias)
        n = self.q_norm
        return q if n is None else apply_norm(q, n.kind, self.shape.head_dim, n.eps, n.gain)

    def _keys(self, x: torch.Tensor) -> torch.Tensor:
        k = F.linear(x, self.k_proj.weight, self.k_proj.bias)
        n = self.k_norm
        if n is None:
            return k
        return scale_groups(k, rms_scale(F.linear(x, self.k_scale_proj.weight), n.kind, self.shape.head_dim, n.eps)).to(
            k.dtype
        )


def source_attentions(model: nn.Module, shape) -> list[SourceAttention]:
    """Every layer's attention of a supported causal LM, in the one form."""
    family = family_of(model.config)
    windows = attention_windows(model.config)
    return [SourceAttention(layer.self_attn, family, shape, w) for layer, w in zip(model.model.layers, windows)]


def _split_linear(linear: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """Row blocks of a fused projection as Linears sharing its storage."""
    if sum(sizes) != linear.out_features:
        raise ValueError(f"a fused projection of {linear.out_features} rows cannot split into {sizes}")
    parts, start = [], 0
    for size in sizes:
        part = nn.Linear(linear.in_features, size, bias=linear.bias is not None, device="meta")
        part.weight = nn.Parameter(linear.weight[start : start + size], requires_grad=False)
        if linear.bias is not None:
            part.bias = nn.Parameter(linear.bias[start : start + size], requires_grad=False)
        parts.append(part)
        start += size
    return parts


def _scaled_linear(linear: nn.Linear, gain: torch.Tensor) -> nn.Linear:
    """`linear` with its output rows multiplied by `gain`."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight.detach() * gain[:, None], requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach() * gain, requires_grad=False)
    return out
