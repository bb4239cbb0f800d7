"""The MHA2MLA model: the source family's own model with attention that caches a low-rank latent plus partial-RoPE
keys.

Layout inside `MLAAttention` (per layer); `rope_layout` (mla/layouts.py) decides how the keys keep RoPE:
- 'per_head' (MHA2MLA): `k_rope_proj` gives each KV head's kept RoPE dims (`n_kv*2r`), read by the query
  heads of its group. `q_proj` rows are reordered per head to [RoPE dims (2r) | NoPE dims (d_h-2r)] (a
  permutation shared with the keys leaves q.k unchanged); NoPE keys are d_h-2r dims per KV head.
- 'shared' (RoRoPE, DeepSeek's layout): `k_rope_proj` gives one rope key of `2*n_kv*r` rotated dims read by
  every query head; head h's rope query is its own query at those pairs' frequencies times `q_rope_scale[h]`
  (the rotation, folded per head). Its NoPE query is the whole q_h, against d_h-dim NoPE keys per KV head.
- `kv_down_proj` (W_dkv): hidden -> latent c_kv (`n_kv*d_kv`, or `latent_dims[layer]`). With svd='none' the
  "latent" is the full-rank [k_nope | v] (compact NoPE coordinates under 'shared').
- `k_up_proj` (W_uk): latent (or its first half under 'split') -> NoPE keys of all KV heads; under svd='none'
  only the 'shared' layout has one (the fixed map from compact coordinates to d_h-dim keys).
- `v_up_proj` (W_uv): latent (or its second half under 'split') -> values of all KV heads; none under svd='none'.
- `o_proj`: unchanged.
- QK-norm families (mla/families.py): `q_norm_gain` is the query norm's gain in q_proj's row order; the key
  norm's gain is folded into the key rows, and `k_scale_proj` (the raw key projection) gives 1/rms(raw key) per
  token and norm group, which multiplies the rope key before it is cached and the NoPE keys (or, absorbed, their
  scores) after; it is cached as `key_norm_scales` trailing columns of the latent.

Around the attention everything is the base architecture's: `MLAForCausalLM` builds the source family's stock
transformers model from `config.base_config` and swaps its attention modules (`base_causal_lm`), those of the
layers `config.mla_layers` marks (None: every layer; the others keep the family's own attention and cache plain
keys and values). Each layer's cache keeps the layer's sliding window, as the original's does (mla/cache.py).

This file and the modules it imports relatively are copied into every saved folder (remote code): they
import each other flat and nothing else from this package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import CONFIG_MAPPING, GenerationMixin
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaPreTrainedModel,
    eager_attention_forward,
    rotate_half,
)

from .cache import LatentCache, QuantizedLatentCache
from .configuration import MLAConfig
from .decode_dispatch import absorbed_decode
from .families import apply_norm, attention_windows, rms_scale


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = d_h = config.head_dim
        self.num_heads = n_h = config.num_attention_heads
        self.num_kv_heads = n_kv = config.num_key_value_heads
        self.num_key_value_groups = n_h // n_kv
        self.scaling = config.attention_scaling or d_h**-0.5
        self.softcap = config.attn_softcap
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        pairs = config.rope_pairs[layer_idx]
        self.shared_rope = config.rope_layout == "shared"
        self.rope_heads = len(pairs)  # KV heads ('per_head') or 1 ('shared')
        self.rope_groups = n_h // self.rope_heads
        self.rope_dim = 2 * len(pairs[0])  # per rope key head
        nope_rank = n_kv * d_h - self.rope_heads * self.rope_dim  # the NoPE keys' rank, in either layout
        self.nope_dim = (d_h if nope_rank else 0) if self.shared_rope else d_h - self.rope_dim  # per head
        self.register_buffer("rope_index", self._rope_index(), persistent=False)

        d = config.hidden_size
        self.q_proj = nn.Linear(d, n_h * d_h, bias=config.q_bias)
        self.q_rope_scale = nn.Parameter(torch.ones(n_h, self.rope_dim // 2)) if self.shared_rope else None
        self.k_rope_proj = nn.Linear(d, self.rope_heads * self.rope_dim, bias=config.kv_bias)
        self.k_up_proj = self.v_up_proj = None
        if config.svd == "none":
            self.latent_dim = nope_rank + n_kv * d_h
            self.kv_down_proj = nn.Linear(d, self.latent_dim, bias=config.kv_bias)
            self.k_latent, self.v_latent = slice(0, nope_rank), slice(nope_rank, self.latent_dim)
            if self.shared_rope and nope_rank:
                self.k_up_proj = nn.Linear(nope_rank, n_kv * self.nope_dim, bias=False)
        else:
            self.latent_dim = config.latent_dims[layer_idx] if config.latent_dims else n_kv * config.d_kv
            self.kv_down_proj = nn.Linear(d, self.latent_dim, bias=False)
            half = self.latent_dim // 2
            self.k_latent = slice(0, half) if config.svd == "split" else slice(0, self.latent_dim)
            self.v_latent = slice(half, self.latent_dim) if config.svd == "split" else slice(0, self.latent_dim)
            k_in = self.k_latent.stop - self.k_latent.start
            v_in = self.v_latent.stop - self.v_latent.start
            self.k_up_proj = nn.Linear(k_in, n_kv * self.nope_dim, bias=config.kv_bias)
            self.v_up_proj = nn.Linear(v_in, n_kv * d_h, bias=config.kv_bias)
        self.o_proj = nn.Linear(n_h * d_h, d, bias=config.o_bias)
        self.q_norm_gain = nn.Parameter(torch.ones(n_h * d_h)) if config.q_norm else None
        self.k_scale_proj = nn.Linear(d, n_kv * d_h, bias=False) if config.k_norm else None
        self.key_scales = config.key_norm_scales  # cached after the latent

    def _rope_index(self, device=None) -> torch.Tensor:
        """Per rope key head, the head dims whose RoPE frequencies its dims take: kept pairs f, then f + d_h/2."""
        half = self.head_dim // 2
        dims = [list(p) + [f + half for f in p] for p in self.config.rope_pairs[self.layer_idx]]
        return torch.tensor(dims, dtype=torch.long, device=device).view(self.rope_heads, self.rope_dim)

    def reset_buffers(self, device) -> None:
        """Recompute `rope_index` (non-persistent, so empty after a meta-device construction)."""
        self.rope_index = self._rope_index(device)

    def _split_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rope query [B, n_h, T, rope_dim] before rotation, NoPE query [B, n_h, T, nope_dim])."""
        if not self.shared_rope:
            return q.split([self.rope_dim, self.nope_dim], dim=-1)
        q_rope = q[..., self.rope_index[0]] * self.q_rope_scale.repeat(1, 2)[:, None, :].to(q.dtype)
        return q_rope, q[..., : self.nope_dim]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states)
        if self.q_norm_gain is not None:
            q = apply_norm(q, self.config.q_norm, self.head_dim, self.config.qk_norm_eps, self.q_norm_gain)
        q_rope, q_nope = self._split_query(q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2))
        k_rope = self.k_rope_proj(hidden_states).view(b, t, self.rope_heads, self.rope_dim).transpose(1, 2)
        latent = self.kv_down_proj(hidden_states).unsqueeze(1)  # [B, 1, T, latent]
        if self.key_scales:  # 1/rms(raw key) per token and norm group, cached after the latent
            scales = rms_scale(
                self.k_scale_proj(hidden_states), self.config.k_norm, self.head_dim, self.config.qk_norm_eps
            )
            k_rope = (k_rope.float() * scales.transpose(1, 2)[..., None]).to(k_rope.dtype)
            latent = torch.cat([latent, scales.to(latent.dtype).unsqueeze(1)], dim=-1)
        if self.rope_dim:
            q_rope, k_rope = self._rotate(q_rope, k_rope, *position_embeddings)

        if cache is not None:
            k_rope, latent = cache.update(k_rope, latent, self.layer_idx)

        if self.config.absorb and self.k_up_proj is not None:
            out = self._absorbed_attention(q_rope, q_nope, k_rope, latent, attention_mask)
        else:
            out = self._expanded_attention(q_rope, q_nope, k_rope, latent, attention_mask, **kwargs)
        return self.o_proj(out.reshape(b, t, -1)), None

    def _rotate(self, q_rope, k_rope, cos, sin):
        # cos/sin: [B, T, d_h] in rotate_half layout; pick each rope key head's frequencies
        cos_k = cos[..., self.rope_index].permute(0, 2, 1, 3)  # [B, rope_heads, T, rope_dim]
        sin_k = sin[..., self.rope_index].permute(0, 2, 1, 3)
        cos_q = cos_k.repeat_interleave(self.rope_groups, dim=1)
        sin_q = sin_k.repeat_interleave(self.rope_groups, dim=1)
        return q_rope * cos_q + rotate_half(q_rope) * sin_q, k_rope * cos_k + rotate_half(k_rope) * sin_k

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NoPE keys and values `[B, n_kv, S, *]` from the latent `[B, 1, S, latent]`."""
        b, _, s, _ = latent.shape
        c = latent.squeeze(1)
        k_nope, v = c[..., self.k_latent], c[..., self.v_latent]
        if self.k_up_proj is not None:
            k_nope = self.k_up_proj(k_nope)
        if self.v_up_proj is not None:
            v = self.v_up_proj(v)
        k_nope = k_nope.view(b, s, self.num_kv_heads, self.nope_dim).transpose(1, 2)
        if self.key_scales:
            k_nope = (k_nope.float() * self._key_scales(latent, self.num_kv_heads)).to(k_nope.dtype)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k_nope, v

    def _key_scales(self, latent: torch.Tensor, heads: int) -> torch.Tensor:
        """The cached 1/rms(raw key) [B, heads, S, 1] (float32) for `heads` KV or query heads; one norm group
        ('projection') serves them all."""
        scales = latent.squeeze(1)[..., self.latent_dim :].float().transpose(1, 2)  # [B, groups, S]
        if scales.shape[1] != 1:
            scales = scales.repeat_interleave(heads // scales.shape[1], dim=1)
        return scales[..., None]

    def _expanded_attention(self, q_rope, q_nope, k_rope, latent, attention_mask, **kwargs):
        k_nope, v = self.expand_latent(latent)
        query = torch.cat([q_rope, q_nope], dim=-1)
        if self.shared_rope:  # the one rope key beside every KV head's NoPE key
            k_rope = k_rope.expand(-1, self.num_kv_heads, -1, -1)
        key = torch.cat([k_rope, k_nope], dim=-1)
        if self.softcap is not None:  # SDPA and flash kernels know no soft cap: the scores are formed here
            return _softcapped_attention(self, query, key, v, attention_mask)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = attention_interface(
            self,
            query,
            key,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return out  # [B, T, n_h, d_h]

    def _absorbed_attention(self, q_rope, q_nope, k_rope, latent, attention_mask):
        """Attention that reads the cached latent directly: W_uk folded into the query, W_uv applied
        to the attended latent. The k_up bias adds q_nope.b_k to every score of a query, a constant
        that softmax cancels, so it is dropped."""
        b, n_h, t, _ = q_nope.shape
        fused = not self.key_scales and self.softcap is None  # the fused pass knows neither
        if t == 1 and attention_mask is None and fused:  # decode: one fused pass over the cache (Triton on CUDA)
            q_latent = self._fold_query(q_nope).to(latent.dtype)
            attended = absorbed_decode(
                q_rope.reshape(b, n_h, self.rope_dim),
                q_latent.reshape(b, n_h, -1),
                k_rope,
                latent.squeeze(1),
                self.k_latent,
                self.v_latent,
                self.scaling,
            )
            attended = attended.view(b, n_h, 1, -1)
        else:
            attended = self._absorbed_prefill(q_rope, q_nope, k_rope, latent, attention_mask)
        return self._values_from_attended(attended).to(q_nope.dtype)

    def _fold_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, n_h, T, nope_dim] -> q_nope.W_uk [B, n_h, T, L_k], in q_nope's dtype."""
        b, n_h, t, _ = q_nope.shape
        n_kv, g = self.num_kv_heads, self.num_key_value_groups
        w_uk = self.k_up_proj.weight.to(q_nope.dtype).view(n_kv, self.nope_dim, self.k_up_proj.in_features)
        q_latent = torch.einsum("bkgtn,knl->bkgtl", q_nope.reshape(b, n_kv, g, t, self.nope_dim), w_uk)
        return q_latent.reshape(b, n_h, t, -1)

    def _absorbed_prefill(self, q_rope, q_nope, k_rope, latent, attention_mask) -> torch.Tensor:
        """Attended latent [B, n_h, T, L_v] in fp32 for T query rows (a prefill, or a masked decode step).

        The query rows go in chunks whose fp32 scores and probabilities fit ABSORBED_SCORE_BUDGET_BYTES:
        the whole [B, n_h, T, S] matrix is never built. Scores, softmax and the attended latent are fp32
        (the operands upcast), as SDPA and the decode kernel keep their logits: a bf16 model's logits
        rounded to bf16 before the softmax lose what the expanded path keeps.
        """
        b, n_h, t, _ = q_nope.shape
        s = latent.shape[-2]
        c = latent.squeeze(1).float()  # [B, S, L]: O(S) memory, once per call
        c_k_t, c_v = c[..., self.k_latent].transpose(1, 2), c[..., self.v_latent]
        k_rope_t = k_rope.float().transpose(-1, -2)  # [B, rope_heads, rope_dim, S]
        mask = attention_mask[..., :s] if isinstance(attention_mask, torch.Tensor) else attention_mask
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise NotImplementedError(f"absorbed MLA attention does not support a {type(mask).__name__} mask")
        if self.key_scales:
            key_scales = self._key_scales(latent, n_h).transpose(-1, -2)  # [B, n_h, 1, S]
        rows = max(1, ABSORBED_SCORE_BUDGET_BYTES // (2 * 4 * b * n_h * s))  # fp32 scores + probabilities
        chunks = []
        with torch.autocast(latent.device.type, enabled=False):  # autocast would round the products to 16 bits
            for t0 in range(0, t, rows):
                t1 = min(t, t0 + rows)
                q_latent = self._fold_query(q_nope[:, :, t0:t1].float())  # [B, n_h, tc, L_k]
                scores = torch.matmul(q_latent.reshape(b, n_h * (t1 - t0), -1), c_k_t).view(b, n_h, t1 - t0, s)
                if self.key_scales:  # a NoPE score is 1/rms(raw key) times q~.c
                    scores = scores * key_scales
                if self.rope_dim:  # query heads grouped by the rope key head they read
                    rope_q = q_rope[:, :, t0:t1].float().reshape(b, self.rope_heads, -1, self.rope_dim)
                    scores = scores + torch.matmul(rope_q, k_rope_t).view(b, n_h, t1 - t0, s)
                scores = _mask_query_rows(_cap(scores * self.scaling, self.softcap), mask, t0, t)
                probs = torch.softmax(scores, dim=-1)
                chunks.append(torch.matmul(probs.view(b, n_h * (t1 - t0), s), c_v).view(b, n_h, t1 - t0, -1))
        return torch.cat(chunks, dim=2)

    def _values_from_attended(self, attended: torch.Tensor) -> torch.Tensor:
        """Attended latent [B, n_h, T, L_v] -> attention output [B, T, n_h, d_h] (W_uv, in the latent's dtype)."""
        b, n_h, t, _ = attended.shape
        n_kv, g = self.num_kv_heads, self.num_key_value_groups
        if self.v_up_proj is None:  # svd='none': the attended latent holds each KV head's values as they are
            out = attended.view(b, n_kv, g, t, n_kv, self.head_dim).diagonal(dim1=1, dim2=4).permute(0, 4, 1, 2, 3)
            return out.reshape(b, n_h, t, self.head_dim).transpose(1, 2)
        w_uv = self.v_up_proj.weight.to(attended.dtype).view(n_kv, self.head_dim, self.v_up_proj.in_features)
        out = torch.einsum("bkgtl,kdl->bkgtd", attended.view(b, n_kv, g, t, -1), w_uv)
        if self.v_up_proj.bias is not None:
            out = out + self.v_up_proj.bias.to(attended.dtype).view(1, n_kv, 1, 1, self.head_dim)
        return out.reshape(b, n_h, t, self.head_dim).transpose(1, 2)


# The absorbed prefill's fp32 scores (and probabilities) per chunk of query rows stay under this many bytes.
ABSORBED_SCORE_BUDGET_BYTES = 512 * 2**20


def _mask_query_rows(scores: torch.Tensor, mask, row_start: int, rows_total: int) -> torch.Tensor:
    """Mask fp32 scores [B, n_h, tc, S] of the query rows [row_start, row_start + tc) out of rows_total.

    `mask` is a transformers attention mask (None: causal; boolean 'may attend'; or additive float), with
    one row per query or one row for all. Masked scores get fp32's min, not -inf: a fully masked row (a
    padding query) must not turn into NaN, which would reach the cached latent of that position and
    poison every later 0 * NaN.
    """
    tc, s = scores.shape[-2:]
    masked = torch.finfo(scores.dtype).min
    if mask is None:  # query row i sits at key position i + (S - T): it sees that key and those before
        rows = torch.arange(row_start, row_start + tc, device=scores.device)[:, None]
        causal = torch.arange(s, device=scores.device)[None, :] <= rows + (s - rows_total)
        return scores.masked_fill(~causal, masked)
    if mask.shape[-2] != 1:
        mask = mask[..., row_start : row_start + tc, :]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, masked)
    return scores + mask


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's score soft cap: cap * tanh(scores / cap)."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _softcapped_attention(attn: MLAAttention, query, key, value, attention_mask) -> torch.Tensor:
    """Expanded attention with a soft cap on the scores, float32 scores and softmax; [B, T, n_h, d_h]."""
    g = attn.num_key_value_groups
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * attn.scaling
    mask = attention_mask[..., : key.shape[-2]] if isinstance(attention_mask, torch.Tensor) else attention_mask
    probs = torch.softmax(_mask_query_rows(_cap(scores, attn.softcap), mask, 0, query.shape[-2]), dim=-1)
    probs = nn.functional.dropout(probs, p=attn.attention_dropout if attn.training else 0.0)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)


def base_causal_lm(config: MLAConfig) -> nn.Module:
    """The source family's stock causal LM for `config.base_config` (a Llama for folders saved before it
    existed), its attention modules swapped for MLA ones."""
    if config.base_config is None:
        base = LlamaForCausalLM(config)
    else:
        fields = dict(config.base_config)
        base_config = CONFIG_MAPPING[fields.pop("model_type")].from_dict(fields)
        base_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
        try:  # the attention implementation asked for, if the family takes it (Gemma-2 refuses SDPA)
            base_config._attn_implementation = config._attn_implementation
            base = base_class(base_config)
        except ValueError:
            base_config._attn_implementation = None
            base = base_class(base_config)
        config._attn_implementation = base.config._attn_implementation  # its masks are made for it
    for i, layer in enumerate(base.model.layers):
        if config.mla_layers is None or config.mla_layers[i]:
            layer.self_attn = MLAAttention(config, i)
    family_init = base.model._init_weights  # transformers initialises a sub-model with its own _init_weights

    def init_weights(module):
        init_mla_attention(module) if isinstance(module, MLAAttention) else family_init(module)

    base.model._init_weights = init_weights
    return base


def init_mla_attention(module: MLAAttention) -> None:
    """An MLA attention's config-derived buffer and its parameters' neutral values (weights are loaded)."""
    init.copy_(module.rope_index, module._rope_index(module.rope_index.device))
    if module.q_rope_scale is not None:
        init.ones_(module.q_rope_scale)
    if module.q_norm_gain is not None:
        init.ones_(module.q_norm_gain)


class MLAPreTrainedModel(LlamaPreTrainedModel):
    config: MLAConfig
    config_class = MLAConfig
    _supports_flex_attn = False
    _can_record_outputs = {"attentions": MLAAttention}

    def _init_weights(self, module):  # the head's modules; `model`'s are the family's (`base_causal_lm`)
        self._base_class._init_weights(self, module)


class MLAForCausalLM(MLAPreTrainedModel, GenerationMixin):
    """The base family's causal LM with MLA attention: its `model` and `lm_head` are the stock model's, and its
    forward is the stock class's (logit soft-capping, MoE router losses). Called without a cache, `forward`
    uses `new_cache()` (never transformers' DynamicCache, which would not know k_rope may be empty)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # every supported family's

    def __init__(self, config: MLAConfig):
        MLAPreTrainedModel.__init__(self, config)
        base = base_causal_lm(config)
        self._base_class = type(base)
        self._no_split_modules = base._no_split_modules
        for name, value in vars(base).items():  # the head's plain attributes (vocab_size, MoE router settings)
            if not name.startswith("_") and name not in ("config", "training"):
                setattr(self, name, value)
        self.model, self.lm_head = base.model, base.lm_head
        self.post_init()

    def forward(self, *args, cache=None, use_cache=None, **kwargs):
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = self.new_cache()
        return self._base_class.forward(self, *args, cache=cache, use_cache=use_cache, **kwargs)

    def new_cache(self, quantization: dict | None = None) -> LatentCache | QuantizedLatentCache:
        """An empty cache for this model: per layer the latent (or, on a layer left unconverted, keys and values),
        holding what the layer's attention span reaches (its sliding window, else everything). `quantization`:
        QuantizedLatentCache's options (backend, nbits, q_group_size, residual_length); None: full precision."""
        windows = attention_windows(self.model.config)  # the stock model's config, whose masks run the layers
        if quantization is not None:
            return QuantizedLatentCache(windows, **quantization)
        return LatentCache(windows, self.config.mla_layers)

    def set_absorb(self, absorb: bool = True) -> "MLAForCausalLM":
        """Switch between absorbed (latent-space) and expanded attention; returns self."""
        self.config.absorb = bool(absorb)
        return self

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            implementation = generation_config.cache_implementation
            if implementation in (None, "dynamic"):
                model_kwargs["cache"] = self.new_cache()
                return
            if implementation == "quantized":
                options = dict(generation_config.cache_config or {})
                options.pop("config", None)
                model_kwargs["cache"] = self.new_cache(options)
                return
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by MLA models; "
                "use None (latent cache) or 'quantized' (quantized latent cache)"
            )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


# save_pretrained copies this file and its flat relative imports into the folder and writes `auto_map`,
# so `from_pretrained(folder, trust_remote_code=True)` loads it without this package
MLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
