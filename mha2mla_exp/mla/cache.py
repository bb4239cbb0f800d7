"""The MLA latent cache, plain and quantized, on transformers' Cache API.

Per layer a `Cache` layer holds two tensors in the slots transformers calls keys/values:
`keys`  = k_rope, the rotated RoPE part of the keys, `[B, n_kv, T, 2r]`;
`values` = c_kv, the joint latent shared by all heads, `[B, 1, T, n_kv*d_kv]`.
Nothing else is cached: the NoPE keys and the values are re-expanded from c_kv (or, absorbed,
never materialised). `nbytes()` counts the bytes actually held, quantization metadata included.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer, QuantizedLayer

QUANT_BACKENDS = ("quanto", "hqq")
# the bit widths each backend's quantizer implements (transformers' QuantoQuantizedLayer / HQQQuantizedLayer)
BACKEND_NBITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}


def check_kv_quant(backend: str, nbits: int, q_group_size: int = 64, residual_length: int = 128) -> None:
    """The one check of a KV-quantization setting, for the MLA latent and the MHA baseline alike."""
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"kv_quant.backend: unknown {backend!r}; expected one of {', '.join(QUANT_BACKENDS)}")
    if isinstance(nbits, bool) or nbits not in BACKEND_NBITS[backend]:
        raise ValueError(
            f"kv_quant.nbits: {nbits!r} is not supported by {backend} "
            f"(it implements {', '.join(map(str, BACKEND_NBITS[backend]))} bits)"
        )
    if isinstance(q_group_size, bool) or not isinstance(q_group_size, int) or q_group_size <= 0:
        raise ValueError(f"kv_quant.q_group_size: expected a positive integer, got {q_group_size!r}")
    if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 0:
        raise ValueError(f"kv_quant.residual_length: expected an integer >= 0, got {residual_length!r}")


def tensor_bytes(obj) -> int:
    """Bytes held by the tensors inside `obj` (tensor subclasses, dicts and tuples are walked)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(type(obj), "__tensor_flatten__"):  # quanto's packed tensors
            inner_names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in inner_names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if isinstance(obj, QuantizedBlock):
        return tensor_bytes(obj.payload)
    return 0


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by any transformers cache (DynamicCache, QuantizedCache, ours)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


class LatentLayer(DynamicLayer):
    """One layer of the plain latent cache."""

    def get_seq_length(self) -> int:
        # keys (k_rope) are empty under NoPE (r=0), so the length is read from the latent
        if not self.is_initialized or self.values.numel() == 0:
            return 0
        return self.values.shape[-2]

    def nbytes(self) -> int:
        return tensor_bytes(self.keys) + tensor_bytes(self.values) if self.is_initialized else 0


class LatentCache(Cache):
    """The MLA latent cache: k_rope and c_kv per layer and token, nothing more."""

    def __init__(self, *args, **kwargs):
        super().__init__(layer_class_to_replicate=LatentLayer)

    def nbytes(self) -> int:
        return cache_nbytes(self)


class QuantizedBlock:
    """A quantized `[B, H, T, D]` tensor: the backend's payload plus what is needed to rebuild it."""

    __slots__ = ("payload", "shape", "dtype")

    def __init__(self, payload, shape, dtype):
        self.payload, self.shape, self.dtype = payload, shape, dtype


class QuantizedLatentLayer(QuantizedLayer):
    """A latent cache layer quantized with quanto or HQQ, after transformers' `QuantizedLayer`. Nothing in it
    is latent-specific: the evaluation quantizes the original model's keys and values with it too, so that
    both sides of a KV-precision comparison use one quantizer.

    The most recent tokens (up to `residual_length`) stay in full precision; when the window
    fills, everything is re-quantized. Groups run along tokens within one channel (per-channel
    quantization, as KIVI does for keys): the token axis is padded (by replication) to a multiple
    of `q_group_size`, and the padding is counted in `nbytes()`.
    """

    def __init__(self, backend: str = "quanto", nbits: int = 4, q_group_size: int = 64, residual_length: int = 128):
        check_kv_quant(backend, nbits, q_group_size, residual_length)
        super().__init__(nbits=nbits, q_group_size=q_group_size, residual_length=residual_length)
        self.backend = backend

    def _quantize(self, tensor: torch.Tensor, axis: int) -> QuantizedBlock:
        shape, dtype = tuple(tensor.shape), tensor.dtype
        if tensor.numel() == 0:  # k_rope under NoPE
            return QuantizedBlock(None, shape, dtype)
        g = self.q_group_size
        t = shape[-2]
        channels_major = tensor.transpose(-1, -2)  # [B, H, D, T]
        pad = (-t) % g
        if pad:
            flat = channels_major.reshape(-1, 1, t)
            channels_major = F.pad(flat, (0, pad), mode="replicate")
        groups = channels_major.reshape(-1, g)
        return QuantizedBlock(self._backend_quantize(groups), shape, dtype)

    def _dequantize(self, block: QuantizedBlock) -> torch.Tensor:
        b, h, t, d = block.shape
        if block.payload is None:
            return torch.empty(block.shape, dtype=block.dtype, device=self.device)
        groups = self._backend_dequantize(block.payload).to(block.dtype)
        padded_t = groups.numel() // (b * h * d)
        return groups.reshape(b, h, d, padded_t)[..., :t].transpose(-1, -2).contiguous()

    def _backend_quantize(self, groups: torch.Tensor):
        if self.backend == "quanto":
            quanto = _backend_module("optimum.quanto")
            qtype = quanto.qint4 if self.nbits == 4 else quanto.qint2
            scale, shift = quanto.MaxOptimizer()(groups, qtype, 0, groups.shape[-1])
            return quanto.quantize_weight(groups, qtype, 0, scale, shift, groups.shape[-1])
        qtensor, meta = _backend_module("hqq.core.quantize").Quantizer.quantize(
            groups,
            axis=1,
            device=groups.device,
            compute_dtype=groups.dtype,
            nbits=self.nbits,
            group_size=groups.shape[-1],
        )
        meta["compute_dtype"] = groups.dtype
        return qtensor, meta

    def _backend_dequantize(self, payload) -> torch.Tensor:
        if self.backend == "quanto":
            return payload.dequantize()
        qtensor, meta = payload
        return _backend_module("hqq.core.quantize").Quantizer.dequantize(qtensor, meta)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def residual_nbytes(self) -> int:
        """Bytes of the full-precision window of recent tokens."""
        return tensor_bytes(self.keys) + tensor_bytes(self.values) if self.is_initialized else 0

    def nbytes(self) -> int:
        return self.residual_nbytes() + tensor_bytes(self._quantized_keys) + tensor_bytes(self._quantized_values)


def _backend_module(name: str):
    """A quantization backend, imported by name: transformers scans a checkpoint's remote code for import
    statements and would otherwise demand both optional backends from anyone loading it."""
    return importlib.import_module(name)


class QuantizedLatentCache(Cache):
    """The latent cache with k_rope and c_kv quantized (quanto or HQQ, 4 or 2 bits)."""

    def __init__(
        self,
        num_layers: int,
        backend: str = "quanto",
        nbits: int = 4,
        q_group_size: int = 64,
        residual_length: int = 128,
    ):
        layers = [QuantizedLatentLayer(backend, nbits, q_group_size, residual_length) for _ in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def residual_nbytes(self) -> int:
        return sum(layer.residual_nbytes() for layer in self.layers)
