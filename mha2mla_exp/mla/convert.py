"""`convert_to_mla`: turn a loaded decoder LM of a supported family (mla/families.py) into its MHA2MLA form."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from .budget import search_split, search_widths, selection_loss
from .calibration import Calibration
from .configuration import MLAConfig
from .families import (
    SourceAttention,
    attention_windows,
    family_of,
    rope_per_layer_type,
    source_attentions,
    unsupported_features,
    visible_keys,
)
from .layouts import KeySplit, RotatedPairs
from .lowrank import allocate_ranks, low_rank_factors, weighted_svd
from .lowrank_init import LOWRANK_INITS, LayerProblem, Weighting
from .modeling import MLAAttention, MLAForCausalLM
from .nope_keys import apply_nope_keys
from .rope import ROPE_STRATEGIES
from .spec import MLASpec, ModelShape, budget_latent_cap, converted_layers, max_d_kv

# Llama-config fields that every supported architecture shares and the MLA model reuses as they are
_SHARED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
)


def check_architecture(model: nn.Module) -> None:
    """Raise ValueError unless `model` is a causal LM of a family this converter understands, asking for
    nothing the conversion cannot keep exactly; the message names the architecture and what it lacks."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == MLAConfig.model_type:
        raise ValueError("this model is already an MHA2MLA model")
    family_of(config)
    problems = unsupported_features(config)
    if problems:
        raise ValueError(f"{config.model_type!r} model not convertible: {'; '.join(problems)}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not a causal LM with model.layers and lm_head")
    source_attentions(model, ModelShape.from_config(config))  # each layer's projections and norms read


def convert_to_mla(
    model: nn.Module,
    spec: MLASpec | None = None,
    *,
    calibration: Iterable | None = None,
    selection: Iterable | None = None,
    **options,
) -> MLAForCausalLM:
    """Convert a causal LM (MHA or GQA) of a supported family (mla/families.py: Llama, Mistral, Qwen2/3 and
    their MoE, OLMo-2, Gemma-2/3, Phi-3) to MLA as `spec` says; see METHOD.md and docs/ARCHITECTURE.md. Everything
    but the attention stays the family's own.

    `spec`: what to do (`MLASpec`, whose fields document each option; a run builds it from its config with
    `MLASpec.from_sections`), checked again against this model's shape. Without a spec, `options` are
    `MLASpec.create`'s keywords (`convert_to_mla(model, rope="2-norm", r=2, svd="joint", d_kv=8)`).
    `calibration`: an iterable of input_ids batches, required by the strategies and inits that read statistics.
    `selection`: the batches a KV budget's searches score each candidate on (not the held-out rows;
    mla/budget.py). The original model is left untouched: the converted one owns copies of every weight.
    """
    check_architecture(model)
    shape = ModelShape.from_config(model.config)
    if spec is not None and options:
        raise TypeError(f"convert_to_mla: give a spec or its options, not both (got {', '.join(options)})")
    spec = MLASpec.create(shape, **(spec.to_dict() if spec is not None else options))
    converted_layers(attention_windows(model.config), spec.convert_layers)  # the layers asked for exist
    if spec.needs_calibration and calibration is None:
        raise ValueError(
            f"{' and '.join(spec.calibrated_fields())} needs calibration data (an iterable of input_ids batches)"
        )
    if spec.searches and selection is None:
        raise ValueError(
            f"kv_elements={spec.kv_elements} with rope_pairs, key_weight or the latent allocation "
            "searched needs a selection sample (an iterable of input_ids batches) to score each split on"
        )
    calib = Calibration(model, calibration if spec.needs_calibration else None, shape)
    calib.prefetch(spec.statistics)  # one pass for everything the strategy and the init declare

    if spec.kv_elements is None:
        selections = ROPE_STRATEGIES.get(spec.rope).select(shape, spec.r, spec.score, calib)
        return _assemble(model, spec, calib, selections, None, spec.key_weight)
    ranked = ROPE_STRATEGIES.get(spec.rope).ranked(shape, spec.score, calib)

    def with_split(k: int, key_weight: float, widths: list[int] | None = None) -> MLAForCausalLM:
        selections = [RotatedPairs(u, order[:k]) for u, order in ranked]
        widths = widths or [spec.kv_elements - 2 * k] * shape.num_layers
        return _assemble(model, spec, calib, selections, widths, key_weight)

    if not spec.searches:
        return with_split(spec.rope_pairs, spec.key_weight)
    selection = list(selection)
    pairs, key_weight, candidates = search_split(spec, shape, with_split, selection)
    widths, allocation = None, None
    if spec.allocation == "measured":
        widths, allocation = search_widths(
            [spec.kv_elements - 2 * pairs] * shape.num_layers,
            [budget_latent_cap(shape, pairs)] * shape.num_layers,
            lambda w: selection_loss(with_split(pairs, key_weight, w), selection),
        )
    mla = with_split(pairs, key_weight, widths)
    if candidates:
        mla.config.mla["budget_search"] = {"rope_pairs": pairs, "key_weight": key_weight, "candidates": candidates}
    if allocation is not None:
        mla.config.mla["latent_allocation"] = allocation
    return mla


def _assemble(
    model: nn.Module, spec: MLASpec, calib: Calibration, selections: list, widths: list[int] | None, key_weight: float
) -> MLAForCausalLM:
    """The MLA model for the rope `selections` of every layer, latents of `widths` (None: n_kv*d_kv) and the
    init's NoPE-key weight times `key_weight`."""
    shape = ModelShape.from_config(model.config)
    layers = source_attentions(model, shape)
    splits = [sel.split(attn, shape) for sel, attn in zip(selections, layers)]
    splits = apply_nope_keys(spec.nope_keys, splits, selections, shape, calib)
    latents = None
    if spec.svd != "none":
        problems = [
            LayerProblem(i, split, attn.v_proj.weight, attn.o_proj.weight, shape)
            for i, (split, attn) in enumerate(zip(splits, layers))
        ]
        latents = low_rank_latents(model, problems, spec, calib, widths, key_weight)
    config = build_mla_config(model, layers, spec, splits, None if latents is None else [x.width for x in latents])
    if latents and any(x.choice for x in latents):
        config.mla["init_choices"] = [x.choice for x in latents]
    if spec.kv_elements is not None:
        config.mla["budget_split"] = [
            {"rope_pairs": len(sel.kept), "latent": x.width} for sel, x in zip(selections, latents)
        ]
    converted = [i for i, mla in enumerate(config.mla_layers or [True] * len(layers)) if mla]
    replaced = tuple(f"model.layers.{i}.self_attn." for i in converted)  # the others keep the family's weights
    state = {name: t.detach().clone() for name, t in model.state_dict().items() if not name.startswith(replaced)}
    for i in converted:
        attn, split = layers[i], splits[i]
        weights = attention_weights(attn, split, spec, None if latents is None else latents[i])
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
    rebuild_buffers(mla, model)
    mla.eval() if not model.training else mla.train()
    return mla


def build_mla_config(
    model: nn.Module,
    layers: list[SourceAttention],
    spec: MLASpec,
    splits: list[KeySplit],
    widths: list[int] | None = None,
) -> MLAConfig:
    src = model.config
    shape = ModelShape.from_config(src)
    fields = {k: getattr(src, k) for k in _SHARED_CONFIG_FIELDS if hasattr(src, k)}
    if rope_per_layer_type(fields.get("rope_parameters")):  # Gemma-3's: the base model's own, not Llama's
        fields.pop("rope_parameters")
    first = layers[0]
    mla_meta = spec.to_dict() | {
        "source_model_type": src.model_type,
        "source_name_or_path": getattr(src, "_name_or_path", ""),
    }
    windows = [attn.sliding_window for attn in layers]
    mla_layers = converted_layers(windows, spec.convert_layers)
    config = MLAConfig(
        **fields,
        mlp_bias=getattr(src, "mlp_bias", False),
        mla=mla_meta,
        rope_pairs=[split.pairs for split in splits],
        rope_layout=splits[0].layout,
        latent_dims=widths if widths and set(widths) != {shape.num_kv_heads * (spec.d_kv or 0)} else None,
        q_bias=first.q_proj.bias is not None,
        kv_bias=first.k_proj.bias is not None,
        o_bias=first.o_proj.bias is not None,
        base_config=src.to_dict(),
        attention_scaling=first.scaling if first.scaling != shape.head_dim**-0.5 else None,
        attn_softcap=first.softcap,
        sliding_windows=windows if any(windows) else None,
        q_norm=first.q_norm.kind if first.q_norm else None,
        k_norm=first.k_norm.kind if first.k_norm else None,
        qk_norm_eps=(first.k_norm or first.q_norm).eps if (first.k_norm or first.q_norm) else 1e-6,
        mla_layers=None if all(mla_layers) else mla_layers,
        architectures=["MLAForCausalLM"],
    )
    config._attn_implementation = src._attn_implementation
    config.dtype = next(model.parameters()).dtype
    return config


@dataclass
class Latent:
    """One layer's low-rank factors: `down` [width, d] and the up-projections of the K and V latents."""

    down: torch.Tensor
    k_up: torch.Tensor
    v_up: torch.Tensor
    choice: str = ""  # the init's candidate it came from, when the init offered several

    @property
    def width(self) -> int:
        return self.down.shape[0]


def low_rank_latents(
    model: nn.Module,
    problems: list[LayerProblem],
    spec: MLASpec,
    calib: Calibration,
    widths: list[int] | None = None,
    key_weight: float = 1.0,
) -> list[Latent]:
    """Every layer's factors under the spec's init and allocation, `widths` wide (None: n_kv*d_kv, or, under
    'global' allocation, that total sized by the energies of the init's own weighting). The factorised rows
    are the compact NoPE keys and the values; `nope_embed` maps the key factor back to the keys heads meet.
    An init offering several weightings gets, per layer, the one whose truncation is measured closest to the
    full-rank layer (`LayerMeter`). Every weighting's NoPE-key block is multiplied by `key_weight`."""
    init = LOWRANK_INITS.get(spec.init)
    shape = problems[0].shape

    def weightings(p: LayerProblem) -> list[Weighting]:
        return [_weigh_keys(w, key_weight, len(p.split.nope_weight)) for w in init.weightings(p, calib)]

    if widths is None:
        widths = [shape.num_kv_heads * spec.d_kv] * len(problems)
    if spec.allocation == "global":
        energies = [
            _joint_svd(p, _weigh_keys(init.weighting(p, calib), key_weight, len(p.split.nope_weight))).energy
            for p in problems
        ]
        caps = [shape.num_kv_heads * max_d_kv(shape, spec.r, "joint")] * len(problems)
        widths = allocate_ranks(energies, sum(widths), caps)
    meter = None
    latents = []
    for p, width in zip(problems, widths):
        options = weightings(p)
        candidates = [latent_for(p, w, width, spec) for w in options]
        if len(candidates) > 1:
            meter = meter or LayerMeter(model, spec, [q.split for q in problems], widths, calib)
            errors = [meter.error(p.layer, c) for c in candidates]
            best = errors.index(min(errors))
            candidates = [replace(candidates[best], choice=options[best].label)]
        latents.append(candidates[0])
    return latents


def _weigh_keys(w: Weighting, factor: float, m_k: int) -> Weighting:
    """`w` with its NoPE-key block (the identity when it has none) multiplied by `factor`."""
    return w if factor == 1.0 else replace(w, k=factor * _or_eye(w.k, m_k))


def _joint_svd(p: LayerProblem, w: Weighting):
    left = (
        None
        if w.k is None and w.v is None
        else torch.block_diag(_or_eye(w.k, len(p.split.nope_weight)), _or_eye(w.v, len(p.v_weight)))
    )
    return weighted_svd(torch.cat([p.split.nope_weight, p.v_weight]), left, w.inputs)


def latent_for(p: LayerProblem, w: Weighting, width: int, spec: MLASpec) -> Latent:
    """One layer's truncation to a latent of `width` under weighting `w` (joint, or split in halves)."""
    if spec.svd == "split":
        k_down, k_up = low_rank_factors(p.split.nope_weight, width // 2, spec.sigma, w.inputs, w.k)
        v_down, v_up = low_rank_factors(p.v_weight, width // 2, spec.sigma, w.inputs, w.v)
        return Latent(torch.cat([k_down, v_down]), _embed(p.split, k_up), v_up)
    down, up = _joint_svd(p, w).factors(width, spec.sigma)
    m_k = len(p.split.nope_weight)
    return Latent(down, _embed(p.split, up[:m_k]), up[m_k:])


class LayerMeter:
    """The squared distance, summed over the calibration sample (`attention_inputs`), between a converted
    layer's attention output (W_o included) and the full-rank (partial-RoPE only) layer's: how an init's
    candidate truncations are compared. Each layer is run as an MLAAttention of its own."""

    def __init__(self, model: nn.Module, spec: MLASpec, splits: list[KeySplit], widths: list[int], calib: Calibration):
        self.inputs, self.rotary = calib.get("attention_inputs")
        self.sources = source_attentions(model, ModelShape.from_config(model.config))
        self.splits = splits
        self.full = replace(spec, svd="none", d_kv=None, init="weight", allocation="uniform")
        self.spec = spec
        self.configs = {
            self.full: build_mla_config(model, self.sources, self.full, splits),
            spec: build_mla_config(model, self.sources, spec, splits, widths),
        }
        self.references: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def _outputs(self, layer: int, spec: MLASpec, latent: Latent | None) -> list[torch.Tensor]:
        source = self.sources[layer]
        device = source.q_proj.weight.device
        attn = MLAAttention(self.configs[spec], layer).to(device=device, dtype=source.q_proj.weight.dtype)
        attn.load_state_dict(attention_weights(source, self.splits[layer], spec, latent))
        attn.reset_buffers(device)
        outputs = []
        for x, (cos, sin) in zip(self.inputs[layer], self.rotary[layer]):
            visible = visible_keys(x.shape[1], source.sliding_window, device)  # the layer's own span
            mask = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))[None, None]
            x = x.to(device=device, dtype=attn.q_proj.weight.dtype)
            outputs.append(attn(x, (cos.to(device), sin.to(device)), attention_mask=mask)[0].double())
        return outputs

    def error(self, layer: int, latent: Latent) -> float:
        if layer not in self.references:
            self.references[layer] = self._outputs(layer, self.full, None)
        pairs = zip(self._outputs(layer, self.spec, latent), self.references[layer])
        return sum(((a - b) ** 2).sum().item() for a, b in pairs)


def _or_eye(matrix: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.eye(n, dtype=torch.float64) if matrix is None else matrix.double()


def _embed(split: KeySplit, k_up: torch.Tensor) -> torch.Tensor:
    """The up-projection onto the NoPE keys the heads meet (`nope_embed @ k_up`; the identity per head)."""
    if split.nope_embed is None:
        return k_up
    return (split.nope_embed.double() @ k_up.double()).to(k_up.dtype)


@torch.no_grad()
def attention_weights(
    attn: SourceAttention, split: KeySplit, spec: MLASpec, latent: Latent | None
) -> dict[str, torch.Tensor]:
    """The MLA attention weights of one layer, keyed by MLAAttention's parameter names."""
    out: dict[str, torch.Tensor] = {
        "q_proj.weight": split.q_weight,
        "k_rope_proj.weight": split.rope_weight,
        "o_proj.weight": attn.o_proj.weight,
    }
    if attn.q_norm is not None:  # the query norm's gain, in q_weight's row order
        gain = attn.q_norm.gain.view(-1, attn.shape.head_dim)
        if split.q_rows is not None:
            gain = gain[torch.arange(gain.shape[0])[:, None], split.q_rows]
        out["q_norm_gain"] = gain.reshape(-1).to(split.q_weight.dtype)
    if attn.k_scale_proj is not None:
        out["k_scale_proj.weight"] = attn.k_scale_proj.weight
    for name, bias in (("q_proj", split.q_bias), ("k_rope_proj", split.rope_bias), ("o_proj", attn.o_proj.bias)):
        if bias is not None:
            out[f"{name}.bias"] = bias
    if split.q_rope_scale is not None:
        out["q_rope_scale"] = split.q_rope_scale
    v_w, v_b = attn.v_proj.weight, attn.v_proj.bias
    if latent is None:  # svd='none': the latent is the full-rank [compact k_nope | v]
        out["kv_down_proj.weight"] = torch.cat([split.nope_weight, v_w])
        if v_b is not None:
            out["kv_down_proj.bias"] = torch.cat([split.nope_bias, v_b])
        if split.nope_embed is not None and split.nope_embed.numel():
            out["k_up_proj.weight"] = split.nope_embed
    else:
        out["kv_down_proj.weight"] = latent.down
        out["k_up_proj.weight"], out["v_up_proj.weight"] = latent.k_up, latent.v_up
        if v_b is not None:  # folded into the up-projections: exact at full rank
            nope_bias = split.nope_bias if split.nope_embed is None else _embed(split, split.nope_bias[:, None])[:, 0]
            out["k_up_proj.bias"], out["v_up_proj.bias"] = nope_bias, v_b
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def rebuild_buffers(mla: MLAForCausalLM, source: nn.Module) -> None:
    """Recreate the non-persistent buffers that a meta-device construction leaves empty: the base family's own
    (rotary frequencies, embedding scale) are the source model's, the MLA layers' are recomputed."""
    device = next(source.parameters()).device
    source_buffers = dict(source.named_buffers())
    for name, buffer in list(mla.named_buffers()):
        if buffer.is_meta and name in source_buffers:
            module, _, attr = name.rpartition(".")
            mla.get_submodule(module)._buffers[attr] = source_buffers[name].detach().clone()
    for layer in mla.model.layers:
        if isinstance(layer.self_attn, MLAAttention):  # an unconverted layer's were copied above
            layer.self_attn.reset_buffers(device)
