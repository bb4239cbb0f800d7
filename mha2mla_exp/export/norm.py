"""DeepSeek's kv_a_layernorm made the identity: RMSNorm(s c) = s c / sqrt(mean((s c)^2) + eps) * w equals c to a
relative 1 - 1/sqrt(1 + m/eps) (m = mean((s c)^2)) when w = sqrt(eps)/s. Per layer, w is the smallest power of two
keeping m <= margin * eps on every calibration token (w exact in any float format; s = sqrt(eps)/w)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def latent_mean_squares(model, input_ids: torch.Tensor) -> list[float]:
    """Per layer, the largest mean(c^2) of the latent c = kv_down_proj(x) over the tokens of `input_ids`."""
    peaks = [0.0] * len(model.model.layers)
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, out, i=i):
            peaks[i] = max(peaks[i], out.float().pow(2).mean(-1).max().item())

        hooks.append(layer.self_attn.kv_down_proj.register_forward_hook(hook))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return peaks


def identity_weights(peaks: list[float], eps: float, margin: float) -> list[float]:
    """Per layer, the norm weight w = 2^k (the smallest keeping mean((s c)^2) <= margin * eps, s = sqrt(eps)/w)."""
    return [2.0 ** math.ceil(math.log2(max(math.sqrt(p / margin), 1e-30))) for p in peaks]


def residual(peaks: list[float], weights: list[float]) -> float:
    """The largest relative change the norm makes to a calibration token's latent: 1 - 1/sqrt(1 + m/eps)."""
    return max(1 - 1 / math.sqrt(1 + p / w**2) for p, w in zip(peaks, weights))  # m/eps = p/w^2
