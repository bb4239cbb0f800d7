"""The MLA latent cache, plain and quantized, on transformers' Cache API.

Per layer a `Cache` layer holds two tensors in the slots transformers calls keys/values:
`keys`  = k_rope, the rotated RoPE part of the keys, `[B, n_kv, T, 2r]`;
`values` = c_kv, the joint latent shared by all heads, `[B, 1, T, n_kv*d_kv]`.
Nothing else is cached: the NoPE keys and the values are re-expanded from c_kv (or, absorbed,
never materialised). `nbytes()` counts the bytes actually held, quantization metadata included.

A layer with a sliding window keeps what transformers' `DynamicSlidingWindowLayer` keeps: between calls the
last window-1 tokens, and a call attends over those and its new tokens (so a prefill longer than the window
attends over the whole prompt with the family's sliding mask, then only the tail is kept). The masks are sized
by the same `get_mask_sizes`, so they stay right. A converted model whose attention layers are partly left as
they were caches plain keys and values on those layers, in the same layer classes.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, QuantizedLayer

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
    """The MLA latent cache: k_rope and c_kv per layer and token, nothing more.

    `windows[layer]`: the layer's sliding window (None: full attention), as `families.attention_windows` reads
    the model's config; `latent[layer]`: whether the layer is converted (False: it caches plain keys and values).
    Without `windows` every layer holds every token (layers made as the model reaches them)."""

    def __init__(self, windows: list[int | None] | None = None, latent: list[bool] | None = None):
        if windows is None:
            super().__init__(layer_class_to_replicate=LatentLayer)
            return
        latent = [True] * len(windows) if latent is None else latent
        super().__init__(layers=[_dynamic_layer(w, mla) for w, mla in zip(windows, latent, strict=True)])

    def nbytes(self) -> int:
        return cache_nbytes(self)


def _dynamic_layer(window: int | None, latent: bool) -> DynamicLayer:
    if window is not None:  # one class for latent and keys/values alike: the window is all that differs
        return DynamicSlidingWindowLayer(window)
    return LatentLayer() if latent else DynamicLayer()


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

    With a `sliding_window` it keeps transformers' sliding semantics (`DynamicSlidingWindowLayer`): a call
    attends over the last window-1 tokens and its own, and what falls out of the window is dropped. When the
    residual fills, only the window's last window-1 tokens are quantized; while the residual alone covers them,
    no quantized block is kept. So a sliding layer holds at most window-1 quantized tokens (padded to whole
    groups) and fewer than `residual_length` full-precision ones, whatever the context.
    """

    def __init__(
        self,
        backend: str = "quanto",
        nbits: int = 4,
        q_group_size: int = 64,
        residual_length: int = 128,
        sliding_window: int | None = None,
    ):
        check_kv_quant(backend, nbits, q_group_size, residual_length)
        super().__init__(nbits=nbits, q_group_size=q_group_size, residual_length=residual_length)
        self.backend = backend
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.sliding_window is None:
            return super().update(key_states, value_states, *args, **kwargs)
        keep = self.sliding_window - 1
        held = min(self.cumulative_length, keep)  # the past tokens this call still sees
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            keys, values = key_states, value_states
        else:
            past_keys, past_values = self._held_states()
            keys = torch.cat([past_keys[..., past_keys.shape[-2] - held :, :], key_states], dim=-2)
            values = torch.cat([past_values[..., past_values.shape[-2] - held :, :], value_states], dim=-2)
        residual = (self.keys.shape[-2] if self.keys.dim() == 4 else 0) + key_states.shape[-2]
        if residual >= self.residual_length or self._quantized_keys is None:  # (re)quantize the window's tail
            start = max(keys.shape[-2] - keep, 0)
            self._quantized_keys = self._quantize(keys[..., start:, :].contiguous(), axis=self.axis_key)
            self._quantized_values = self._quantize(values[..., start:, :].contiguous(), axis=self.axis_value)
            self.keys = keys.new_empty(0)
            self.values = values.new_empty(0)
            self._pending_beam_idx = None  # applied to the states just quantized
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)[..., -keep:, :]
            self.values = torch.cat([self.values, value_states], dim=-2)[..., -keep:, :]
            if self.keys.shape[-2] == keep:  # the residual alone covers the window
                self._quantized_keys = self._quantized_values = _DROPPED
                self._pending_beam_idx = None
        return keys, values

    def _held_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything held, oldest first: the dequantized block (when one is kept), then the residual."""
        if self._quantized_keys is _DROPPED:
            return self.keys, self.values
        keys, values = self._apply_pending_reorder(
            self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)
        )
        return torch.cat([keys, self.keys], dim=-2), torch.cat([values, self.values], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.sliding_window is None:
            return super().get_mask_sizes(query_length)
        return DynamicSlidingWindowLayer.get_mask_sizes(self, query_length)

    def get_max_length(self) -> int:
        return super().get_max_length() if self.sliding_window is None else self.sliding_window

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


# a sliding layer whose residual covers the whole window keeps no quantized block (None means "not quantized yet")
_DROPPED = QuantizedBlock(None, (0, 0, 0, 0), None)


def _backend_module(name: str):
    """A quantization backend, imported by name: transformers scans a checkpoint's remote code for import
    statements and would otherwise demand both optional backends from anyone loading it."""
    return importlib.import_module(name)


class QuantizedLatentCache(Cache):
    """The latent cache with k_rope and c_kv quantized (quanto or HQQ, 4 or 2 bits). `windows`: each layer's
    sliding window (None: full attention; `families.attention_windows`), or a number of full layers."""

    def __init__(
        self,
        windows: int | list[int | None],
        backend: str = "quanto",
        nbits: int = 4,
        q_group_size: int = 64,
        residual_length: int = 128,
    ):
        windows = [None] * windows if isinstance(windows, int) else windows
        layers = [QuantizedLatentLayer(backend, nbits, q_group_size, residual_length, w) for w in windows]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def residual_nbytes(self) -> int:
        return sum(layer.residual_nbytes() for layer in self.layers)
