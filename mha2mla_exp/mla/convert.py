"""`convert_to_mla`: turn a loaded Llama-family causal LM into its MHA2MLA form."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .configuration import MLAConfig
from .lowrank import collect_input_grams, low_rank_factors
from .modeling import MLAForCausalLM
from .rope_selection import rope_dims, select_rope_pairs
from .spec import SUPPORTED_MODEL_TYPES, MLASpec, ModelShape

log = logging.getLogger(__name__)

# Llama-config fields that every supported architecture shares and the MLA model reuses as they are
_SHARED_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "rope_parameters", "attention_dropout",
)


def check_architecture(model: nn.Module) -> None:
    """Raise ValueError unless `model` is a Llama-family causal LM this converter understands."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == MLAConfig.model_type:
        raise ValueError("this model is already an MHA2MLA model")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: convert_to_mla handles Llama-family causal LMs "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not a causal LM with model.layers and lm_head")
    for attn in (layer.self_attn for layer in layers):
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{type(attn).__name__} lacks separate q/k/v/o projections")
        if (attn.k_proj.bias is None) != (attn.v_proj.bias is None):
            raise ValueError("k_proj and v_proj must both have a bias or both have none")
    window = getattr(config, "sliding_window", None)
    if window and (model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        log.warning("sliding-window attention (window %s) is converted to full attention", window)


def convert_to_mla(
    model: nn.Module,
    *,
    rope: str,
    r: int | None = None,
    svd: str,
    d_kv: int | None = None,
    score: str = "product",
    sigma: str = "up",
    init: str = "weight",
    calibration: Iterable | None = None,
) -> MLAForCausalLM:
    """Convert a Llama/Mistral/Qwen2 causal LM (MHA or GQA) to MLA; see METHOD.md.

    rope: full | none | high | low | uniform | 2-norm, keeping `r` frequency pairs per KV head.
    svd: joint | split | none, with latent width `d_kv` per KV head; `init`: 'weight' (plain SVD of
    the weights, the paper) or 'activation' (minimise the K/V output error on the calibration
    inputs). `calibration` is an iterable of input_ids batches, required by 2-norm and by
    init='activation'. The original model is left untouched: the converted one owns copies of
    every weight.
    """
    check_architecture(model)
    shape = ModelShape.from_config(model.config)
    spec = MLASpec.create(shape, rope=rope, r=r, svd=svd, d_kv=d_kv, score=score, sigma=sigma, init=init)
    for needs, what in ((spec.rope == "2-norm", "rope='2-norm'"), (spec.init == "activation", "init='activation'")):
        if needs and calibration is None:
            raise ValueError(f"{what} needs calibration data (an iterable of input_ids batches)")
    if calibration is not None and spec.rope == "2-norm" and spec.init == "activation":
        calibration = list(calibration)  # read twice

    pairs = select_rope_pairs(spec, shape, model=model, calibration=calibration)
    grams = collect_input_grams(model, calibration) if spec.init == "activation" else [None] * shape.num_layers
    config = build_mla_config(model, spec, pairs)
    state = {
        name: tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if ".self_attn." not in name
    }
    for i, layer in enumerate(model.model.layers):
        weights = convert_attention_weights(layer.self_attn, pairs[i], spec, shape, gram=grams[i])
        state.update({f"model.layers.{i}.self_attn.{k}": v for k, v in weights.items()})

    with torch.device("meta"):
        mla = MLAForCausalLM(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = mla.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
        mla.lm_head.weight = mla.model.embed_tokens.weight
    if missing or unexpected:
        raise RuntimeError(f"conversion left weights unmatched: missing={missing} unexpected={unexpected}")
    rebuild_buffers(mla, device=next(model.parameters()).device)
    mla.eval() if not model.training else mla.train()
    return mla


def build_mla_config(model: nn.Module, spec: MLASpec, pairs) -> MLAConfig:
    src = model.config
    fields = {k: getattr(src, k) for k in _SHARED_CONFIG_FIELDS if hasattr(src, k)}
    attn = model.model.layers[0].self_attn
    mla_meta = spec.to_dict() | {
        "source_model_type": src.model_type,
        "source_name_or_path": getattr(src, "_name_or_path", ""),
    }
    config = MLAConfig(
        **fields,
        mlp_bias=getattr(src, "mlp_bias", False),
        mla=mla_meta,
        rope_pairs=pairs,
        q_bias=attn.q_proj.bias is not None,
        kv_bias=attn.k_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        architectures=["MLAForCausalLM"],
    )
    config._attn_implementation = src._attn_implementation
    config.dtype = next(model.parameters()).dtype
    return config


@torch.no_grad()
def convert_attention_weights(
    attn: nn.Module, pairs, spec: MLASpec, shape: ModelShape, gram: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The MLA attention weights of one layer, keyed by MLAAttention's parameter names. `gram` (X^T X of
    the layer's inputs) switches the SVD to the activation-aware one."""
    n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = n_h // n_kv
    rope_index, nope_index = split_dims(pairs, d_h)
    perm = torch.cat([rope_index, nope_index], dim=1)  # [n_kv, d_h]: RoPE dims first

    def rows(linear: nn.Linear, heads: int, index: torch.Tensor):
        """The output rows `index[h]` of each head h, heads concatenated."""
        head = torch.arange(heads)[:, None]
        w = linear.weight.view(heads, d_h, -1)[head, index].reshape(-1, linear.in_features)
        b = None if linear.bias is None else linear.bias.view(heads, d_h)[head, index].reshape(-1)
        return w, b

    out: dict[str, torch.Tensor] = {}
    out["q_proj.weight"], q_bias = rows(attn.q_proj, n_h, perm.repeat_interleave(group, dim=0))
    out["k_rope_proj.weight"], k_rope_bias = rows(attn.k_proj, n_kv, rope_index)
    k_nope_w, k_nope_b = rows(attn.k_proj, n_kv, nope_index)
    v_w, v_b = attn.v_proj.weight, attn.v_proj.bias
    out["o_proj.weight"] = attn.o_proj.weight
    for name, bias in (("q_proj", q_bias), ("k_rope_proj", k_rope_bias), ("o_proj", attn.o_proj.bias)):
        if bias is not None:
            out[f"{name}.bias"] = bias

    if spec.svd == "none":
        out["kv_down_proj.weight"] = torch.cat([k_nope_w, v_w])
        if v_b is not None:
            out["kv_down_proj.bias"] = torch.cat([k_nope_b, v_b])
    else:
        latent = n_kv * spec.d_kv
        if spec.svd == "joint":
            down, up = low_rank_factors(torch.cat([k_nope_w, v_w]), latent, spec.sigma, gram)
            k_up, v_up = up[: k_nope_w.shape[0]], up[k_nope_w.shape[0]:]
        else:
            k_down, k_up = low_rank_factors(k_nope_w, latent // 2, spec.sigma, gram)
            v_down, v_up = low_rank_factors(v_w, latent // 2, spec.sigma, gram)
            down = torch.cat([k_down, v_down])
        out["kv_down_proj.weight"] = down
        out["k_up_proj.weight"], out["v_up_proj.weight"] = k_up, v_up
        if v_b is not None:  # folded into the up-projections: exact at full rank
            out["k_up_proj.bias"], out["v_up_proj.bias"] = k_nope_b, v_b
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def split_dims(pairs, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the RoPE dims (see `rope_dims`) and the remaining NoPE dims in order."""
    rope = rope_dims(pairs, head_dim)
    nope = [[i for i in range(head_dim) if i not in set(dims)] for dims in rope]
    n_kv = len(pairs)
    return (
        torch.tensor(rope, dtype=torch.long).view(n_kv, -1),
        torch.tensor(nope, dtype=torch.long).view(n_kv, -1),
    )


def rebuild_buffers(mla: MLAForCausalLM, device) -> None:
    """Recreate the non-persistent buffers that a meta-device construction leaves empty."""
    mla.model.rotary_emb = LlamaRotaryEmbedding(mla.config).to(device)
    for layer in mla.model.layers:
        layer.self_attn.reset_buffers(device)
