"""The converted model's config: the conversion spec, the kept RoPE pairs, the source family's attention facts and
the source's own config (`base_config`), from which the base architecture is rebuilt around MLA attention."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .families import norm_groups


@strict
class MLAConfig(LlamaConfig):
    """Config of an MHA2MLA model.

    `mla` holds the conversion spec (rope, r, svd, d_kv, score, sigma, init, allocation, source model type).
    `rope_layout` is 'per_head' (each KV head keeps its own pairs, MHA2MLA) or 'shared' (one rope key read by
    every query head, RoRoPE; see mla/layouts.py); `rope_pairs[layer][rope_key_head]` the kept frequency
    pairs of each rope key head (n_kv heads of r pairs, or one head of n_kv*r). `latent_dims[layer]` is the
    latent width of each layer when it varies (allocation='global', a searched KV budget; None: n_kv*d_kv
    everywhere).
    `q_bias`/`kv_bias`/`o_bias` say which attention projections carry a bias (Qwen2 has q/k/v biases, Llama
    none). `absorb` switches decoding to read the latent directly (W_uk folded into the query).

    `base_config` is the source model's config (`to_dict()`, its model_type included): the converted model is
    that family's stock transformers model with its attention swapped (None: a folder saved before families
    existed, a Llama). The family's attention facts: `attention_scaling` (None: d_h^-0.5), `attn_softcap` (a
    tanh cap on the scores), `sliding_windows[layer]`, and its QK-norms `q_norm`/`k_norm` ('head' |
    'projection' | None) with `qk_norm_eps`. A field the base config has and this one lacks is read from it
    (the base model's head reads e.g. `final_logit_softcapping` from the top-level config).
    `mla_layers[layer]`: whether the layer's attention is MLA (None: every layer); a layer left unconverted keeps
    the family's attention and weights (the spec's `convert_layers`).
    """

    model_type = "mha2mla"

    mla: dict | None = None
    rope_pairs: list | None = None
    rope_layout: str = "per_head"
    latent_dims: list | None = None
    q_bias: bool = False
    kv_bias: bool = False
    o_bias: bool = False
    absorb: bool = False
    base_config: dict | None = None
    attention_scaling: float | None = None
    attn_softcap: float | None = None
    sliding_windows: list | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_eps: float = 1e-6
    mla_layers: list | None = None

    def __getattr__(self, name: str):
        base = self.__dict__.get("base_config")
        if base is not None and not name.startswith("_") and name in base:
            return base[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def key_norm_scales(self) -> int:
        """Elements per token and layer cached beside the latent for the key norm (mla/families.py)."""
        return norm_groups(self.k_norm, self.num_key_value_heads)

    @property
    def d_kv(self) -> int | None:
        return self.mla.get("d_kv")

    @property
    def svd(self) -> str:
        return self.mla["svd"]

    def conversion_facts(self) -> dict:
        """What the conversion decided beyond its spec: the RoPE layout, per-layer latent widths (None: all
        n_kv*d_kv), for inits that measure candidates which one each layer kept, and under a KV budget the
        split of each layer and the search that chose it."""
        mla = self.mla or {}
        return {
            "rope_layout": self.rope_layout,
            "latent_dims": self.latent_dims,
            "init_choices": mla.get("init_choices"),
            "budget_split": mla.get("budget_split"),
            "budget_search": mla.get("budget_search"),
        }


MLAConfig.register_for_auto_class()  # saved folders carry this file as remote code (see modeling.py)
