"""KV caches for evaluation-time generation, and the bytes they actually hold.

The MLA model caches (k_rope, c_kv) in `LatentCache` / `QuantizedLatentCache`; the original model its
keys and values in transformers' `DynamicCache`, quantized with *the same quantizer* as the latent
(`grouping: tokens`, `mla.cache.QuantizedLatentLayer`: groups of `q_group_size` consecutive tokens
within one channel), so that MHA-int4 against MLA-int4 compares architectures, not quantizers.
`grouping: transformers` quantizes the original's cache with transformers' `QuantizedCache` defaults
instead (the paper's Table 2 baselines: quanto groups 64 channels of one token; HQQ axis 0), labelled
so in the record. Either way the evaluation builds the cache itself, so that it can read
`cache_nbytes` after each call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..mla import QuantizedLatentCache, attention_windows, cache_elements_per_sequence, cache_nbytes
from ..mla.cache import check_kv_quant
from ..mla.configuration import MLAConfig
from ..mla.spec import MLASpec, ModelShape, converted_layers, kv_ratio
from ..schema.sections import KVQuantConfig


@dataclass(frozen=True)
class KVQuant:
    """KV-cache quantization: the paper's bits, residual window and group size; `grouping` as above."""

    backend: str = "hqq"
    nbits: int = 4
    residual_length: int = 128
    q_group_size: int = 64
    grouping: str = "tokens"

    def __post_init__(self):  # what the backends take (the schema checks each field alone)
        check_kv_quant(self.backend, self.nbits, self.q_group_size, self.residual_length)

    def check_model(self, converted: bool) -> None:
        """transformers' QuantizedCache holds plain keys and values: the MLA latent has no such variant."""
        if converted and self.grouping == "transformers":
            raise ValueError(
                "kv_quant.grouping: 'transformers' applies to the original model's K/V cache only; "
                "the MLA latent is quantized with grouping 'tokens'"
            )

    @classmethod
    def from_config(cls, kv_quant: KVQuantConfig) -> "KVQuant | None":
        """The `kv_quant` section's quantization; None where it sets no backend (conf/kv_quant/none.yaml)."""
        if kv_quant.backend is None:
            return None
        return cls(
            backend=kv_quant.backend,
            nbits=kv_quant.nbits,
            residual_length=kv_quant.residual_length,
            q_group_size=kv_quant.q_group_size,
            grouping=kv_quant.grouping,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def is_mla(model) -> bool:
    return getattr(model.config, "model_type", None) == MLAConfig.model_type


def new_cache(model, kv_quant: KVQuant | None):
    """A fresh cache for one `generate` call of `model` (MLA or original); on a sliding-window layer either one
    keeps what the layer's window reaches (mla/cache.py)."""
    config = model.config
    if kv_quant is not None:
        kv_quant.check_model(is_mla(model))
    quantized = kv_quant is not None and kv_quant.grouping == "tokens"  # the one quantizer, for latent and K/V
    options = (
        dict(
            backend=kv_quant.backend,
            nbits=kv_quant.nbits,
            q_group_size=kv_quant.q_group_size,
            residual_length=kv_quant.residual_length,
        )
        if quantized
        else None
    )
    if is_mla(model):
        return model.new_cache(options)
    text_config = config.get_text_config(decoder=True)
    if quantized:
        return QuantizedLatentCache(attention_windows(text_config), **options)
    from transformers import DynamicCache, QuantizedCache

    if kv_quant is None:
        return DynamicCache(config=text_config)
    return QuantizedCache(
        backend=kv_quant.backend,
        config=text_config,
        nbits=kv_quant.nbits,
        q_group_size=kv_quant.q_group_size,
        residual_length=kv_quant.residual_length,
    )


class CacheMeter:
    """Accumulates the bytes held by the cache at the end of each generate call, per cached token."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self.token_slots = 0  # batch rows x cached positions (left padding included, as it is held)

    def record(self, cache, batch_size: int) -> None:
        seq = cache.get_seq_length()
        if seq <= 0:
            return
        self.calls += 1
        self.bytes += cache_nbytes(cache)
        self.token_slots += batch_size * seq

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.token_slots if self.token_slots else None


SEQUENCE_LENGTHS = (1024, 8192, 32768)


def bytes_per_sequence(model) -> dict | None:
    """One sequence's full-precision cache at 1k, 8k and 32k tokens, this model's and the original's, sliding windows
    counted (`cache_elements_per_sequence`): per token the two differ with the length on a windowed model. None for
    a model without sliding layers, where bytes per token say it all."""
    windows = attention_windows(getattr(model, "model", model).config)  # the stock decoder's config
    if all(w is None for w in windows):
        return None
    shape = ModelShape.from_config(model.config)
    spec = MLASpec.recorded(model.config.mla) if isinstance(model.config, MLAConfig) else None
    elem = torch.empty((), dtype=model.dtype).element_size()
    return {
        str(t): {
            "model": elem * cache_elements_per_sequence(shape, windows, t, spec)["total"],
            "original": elem * cache_elements_per_sequence(shape, windows, t)["total"],
        }
        for t in SEQUENCE_LENGTHS
    }


def mha_bytes_per_token(model) -> int:
    """The original model's full K/V cache per token (all layers) at the model's dtype."""
    shape = ModelShape.from_config(model.config)
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * shape.num_kv_heads * shape.head_dim * shape.num_layers * elem


def nominal_ratio(model, kv_quant: KVQuant | None, baseline_bits: int | None = None) -> float:
    """Cache size over the original model's cache, by formula, with that cache at `baseline_bits`
    (default: the model's dtype, the baseline the measurement uses).

    MLA: (2r + d_kv) / (2 d_h) (METHOD.md), averaged with 1 over the layers a partial conversion left as they
    were (`convert_layers`); quantization multiplies by nbits / baseline bits (the paper's x1/4 for int4 over
    BF16). Residual tokens, quantization scales and sliding windows (`cache_elements_per_sequence` counts them
    at a given length) are not in the formula.
    """
    ratio = 1.0
    if is_mla(model):
        spec = MLASpec.recorded(model.config.mla)
        converted = converted_layers(attention_windows(model.config), spec.convert_layers)
        ratio = kv_ratio(ModelShape.from_config(model.config), spec)
        ratio = (ratio * sum(converted) + len(converted) - sum(converted)) / len(converted)
    if kv_quant is not None:
        bits = baseline_bits or 8 * torch.empty((), dtype=model.dtype).element_size()
        ratio *= kv_quant.nbits / bits
    return ratio


def cache_label(model, kv_quant: KVQuant | None) -> str:
    """What held the cache, in words (the record's `cache` field)."""
    held = "latent" if is_mla(model) else "K/V"
    if kv_quant is None:
        return "latent" if is_mla(model) else "transformers DynamicCache"
    if kv_quant.grouping == "transformers":
        return "transformers QuantizedCache"
    return f"quantized {held}, groups of {kv_quant.q_group_size} tokens per channel"


def kv_record(model, kv_quant: KVQuant | None, meter: CacheMeter) -> dict:
    """The measured cache footprint next to the nominal ratio (the record's `kv` fields)."""
    measured = meter.bytes_per_token
    mha = mha_bytes_per_token(model)
    ratio = None if measured is None else measured / mha
    return {
        "bytes_per_token_measured": measured,
        "bytes_per_token_mha": mha,
        "ratio_measured": ratio,
        "ratio_nominal": nominal_ratio(model, kv_quant),
        # the paper's "KV memory" convention: the baseline cache in BF16 (differs from the above for
        # quantized caches of a model run in fp32)
        "ratio_nominal_paper": nominal_ratio(model, kv_quant, baseline_bits=16),
        "mem_change_pct": None if ratio is None else 100.0 * (ratio - 1.0),
        "dtype": str(model.dtype).removeprefix("torch."),
        "cache": cache_label(model, kv_quant),
        "kv_quant": kv_quant.to_dict() if kv_quant else None,
        "bytes_per_sequence": None if kv_quant else bytes_per_sequence(model),
        "generate_calls": meter.calls,
        "note": "measured with cache_nbytes() at the end of each generate call of the generation tasks "
        "(residual full-precision tokens, quantization scales and group padding included); "
        "loglikelihood tasks (commonsense, perplexity) run full forward passes and use no cache",
    }
