"""The converted model's config: a Llama config plus the conversion spec and the kept RoPE pairs."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class MLAConfig(LlamaConfig):
    """Config of an MHA2MLA model.

    `mla` holds the conversion spec (rope, r, svd, d_kv, score, sigma, source model type);
    `rope_pairs[layer][kv_head]` the sorted kept frequency pairs. `q_bias`/`kv_bias`/`o_bias`
    say which attention projections carry a bias (Qwen2 has q/k/v biases, Llama none).
    `absorb` switches decoding to read the latent directly (W_uk folded into the query).
    """

    model_type = "mha2mla"

    mla: dict | None = None
    rope_pairs: list | None = None
    q_bias: bool = False
    kv_bias: bool = False
    o_bias: bool = False
    absorb: bool = False

    @property
    def rope_r(self) -> int:
        return int(self.mla["r"])

    @property
    def d_kv(self) -> int | None:
        return self.mla.get("d_kv")

    @property
    def svd(self) -> str:
        return self.mla["svd"]


MLAConfig.register_for_auto_class()  # saved folders carry this file as remote code (see modeling.py)
