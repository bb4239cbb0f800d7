"""mha2mla_exp: convert MHA/GQA LLMs to Multi-head Latent Attention and measure what it costs and saves."""

from . import (
    confutil,  # registers the config schema and resolvers with Hydra
    mla,  # registers the `mha2mla` model type with transformers' Auto classes
)

__version__ = "0.1.0"
