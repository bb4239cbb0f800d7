"""End-to-end decode measurements of one model variant: measured KV bytes per token (real prefill),
decode-step latency over batch x context, peak memory."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..mla import MLAForCausalLM, cache_nbytes, kernels
from .timing import measure, synchronize

GiB = 2**30


@dataclass
class Variant:
    """One way of decoding: the MHA original, or MLA expanded / absorbed / absorbed with Triton."""

    name: str
    model: torch.nn.Module
    absorb: bool = False
    backend: str = "torch"  # kernel dispatcher setting while this variant runs

    @property
    def is_mla(self) -> bool:
        return isinstance(self.model, MLAForCausalLM)

    def activate(self) -> None:
        if self.is_mla:
            self.model.set_absorb(self.absorb)
        kernels.set_backend(self.backend)

    def new_cache(self):
        """The cache generate would use: sliding-window layers keep their window, as the original's do."""
        return self.model.new_cache() if self.is_mla else DynamicCache(config=self.model.config)


@torch.no_grad()
def measured_kv_bytes_per_token(variant: Variant, device: torch.device, batch: int = 2, tokens: int = 16) -> float:
    """Bytes the cache holds per token after a real prefill of `batch` x `tokens` random ids."""
    variant.activate()
    cache = variant.new_cache()
    vocab = variant.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    variant.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache_nbytes(cache) / (batch * tokens)


@torch.no_grad()
def filled_cache(variant: Variant, batch: int, context: int, device: torch.device, dtype: torch.dtype):
    """A cache holding `context` tokens per sequence, written through the cache's own `update`.

    A real prefill at 16k context would take longer than the whole CPU benchmark and decode speed
    does not depend on the values, so the cache is filled with a repeated random block instead.
    """
    cache = variant.new_cache()
    cfg = variant.model.config
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        tensors = []
        for shape in _cached_shapes(variant.model, layer, batch, context):
            block = torch.randn(*shape[:2], min(64, context), shape[3], generator=g, device=device, dtype=dtype)
            reps = math.ceil(context / block.shape[2])
            tensors.append(block.repeat(1, 1, reps, 1)[:, :, :context].contiguous())
        cache.update(*tensors, layer)
    return cache


def _cached_shapes(model: torch.nn.Module, layer: int, batch: int, context: int) -> tuple[tuple[int, ...], ...]:
    """What one layer's cache update takes: an MLA layer's rope keys and joint latent, else (a stock model, or a
    layer `svd.convert_layers` left unconverted) its keys and values."""
    cfg = model.config
    attn = model.model.layers[layer].self_attn
    if hasattr(attn, "latent_dim"):  # QK-norm models cache their key-norm scales after the latent
        latent = attn.latent_dim + int(attn.key_scales or 0)
        return (batch, attn.rope_heads, context, attn.rope_dim), (batch, 1, context, latent)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ((batch, cfg.num_key_value_heads, context, head_dim),) * 2


@torch.no_grad()
def time_decode(
    variant: Variant, batch: int, context: int, device: torch.device, dtype: torch.dtype, *, warmup: int, repeats: int
) -> dict:
    """Latency of one decode step (the full model, one new token per sequence) at `context`."""
    variant.activate()
    cache = filled_cache(variant, batch, context, device, dtype)
    cache_bytes = cache_nbytes(cache)
    cache.activate_past_recording()  # a full sliding-window layer drops its oldest token unless told to keep it
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = torch.full((batch, 1), context, dtype=torch.long, device=device)
    triton_before = kernels.triton_calls()

    def step():
        variant.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)

    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    # each step appends the new token; trimming it keeps every timed step at `context`
    stats = measure(step, device, warmup=warmup, repeats=repeats, after=lambda: cache.crop(-1))
    row = {"cache_bytes": cache_bytes, **{f"step_s_{k}": v for k, v in stats.items()}}
    if device.type == "cuda":
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_mem_source"] = "torch.cuda.max_memory_allocated (weights + cache + step buffers)"
    else:
        row["peak_mem_bytes"] = None  # filled by the caller: weights + cache bytes
        row["peak_mem_source"] = "weights + measured cache bytes (CPU; step buffers not counted)"
    row["triton_steps"] = kernels.triton_calls() - triton_before
    del cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def fits(weights: int, kv_bytes_per_token: float, batch: int, context: int, budget: int) -> bool:
    """Whether a decode step fits `budget`: a transformers dynamic cache concatenates on every step,
    so the old and the new copy of each layer's cache coexist (x2), plus 5% slack."""
    return weights + 2.1 * kv_bytes_per_token * batch * context <= budget


def capacity_tokens(weights: int, kv_bytes_per_token: float, budget: int) -> int:
    """Tokens (batch x context) whose cache fits next to the weights in `budget`."""
    return max(0, int((budget - weights) // kv_bytes_per_token))
