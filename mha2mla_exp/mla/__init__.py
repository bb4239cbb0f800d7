"""The MHA2MLA method: partial RoPE, low-rank joint K/V, the MLA model, its latent cache.

Pure torch + transformers: no Hydra, no I/O policy. Importing it registers the `mha2mla`
model type with transformers' Auto classes.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .cache import LatentCache, QuantizedLatentCache, cache_nbytes
from .configuration import MLAConfig
from .convert import check_architecture, convert_to_mla
from .families import attention_windows
from .lowrank_init import LOWRANK_INITS, LowRankInit
from .modeling import MLAAttention, MLAForCausalLM
from .rope import ROPE_STRATEGIES, RopeStrategy, fixed_pairs
from .spec import (
    SVD_VARIANTS,
    MLASpec,
    ModelShape,
    cache_elements_per_sequence,
    default_r,
    kv_elements_per_token,
    kv_ratio,
    max_d_kv,
)

# in-package loading of saved folders; their remote code serves processes without this package
AutoConfig.register(MLAConfig.model_type, MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = [
    "LatentCache",
    "QuantizedLatentCache",
    "cache_nbytes",
    "MLAConfig",
    "check_architecture",
    "convert_to_mla",
    "MLAAttention",
    "MLAForCausalLM",
    "fixed_pairs",
    "ROPE_STRATEGIES",
    "RopeStrategy",
    "LOWRANK_INITS",
    "LowRankInit",
    "SVD_VARIANTS",
    "MLASpec",
    "ModelShape",
    "default_r",
    "kv_elements_per_token",
    "cache_elements_per_sequence",
    "attention_windows",
    "kv_ratio",
    "max_d_kv",
]
