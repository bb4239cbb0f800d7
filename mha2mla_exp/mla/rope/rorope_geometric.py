"""RoRoPE restricted to a frequency set a stock MLA engine can rotate exactly (docs/SERVING.md).

DeepSeek's rope key rotates its d_r = 2K dims at inv_freq_j = theta'^(-2j/d_r), j < K: one component per
frequency, frequencies a geometric series from 1. A source head's pair f turns at theta^(-2f/d_h), so K kept
pairs at f = 0, s, 2s, ..., (K-1)s are exactly DeepSeek's with theta' = theta^(s*d_r/d_h) (s = 2, d_h = 128,
K = 32: Llama-2-7B's own theta). This strategy keeps, per layer, the best rotated component of each such
frequency, one stride s for the model (one rope_theta), chosen by the summed score of the rotated pairs.
"""

from __future__ import annotations

import torch

from ..layouts import RotatedPairs
from .rorope import RoRoPE


def geometric_strides(pairs: int, head_dim: int) -> list[int]:
    """The strides s whose frequency set {0, s, ..., (pairs-1)s} fits in a head's d_h/2 pairs."""
    half = head_dim // 2
    if pairs <= 1:
        return [1]
    return [s for s in range(1, half) if (pairs - 1) * s < half]


def geometric_choice(scores: list[torch.Tensor], pairs: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """From each layer's rotated-pair scores [n_kv (components), d_h/2]: one stride for the whole model (DeepSeek
    has one rope_theta), the one whose set scores highest summed over layers (ties: the wider
    set), and per layer the (component, frequency) pairs it keeps, the best component of each frequency."""
    best = [layer.max(dim=0) for layer in scores]  # per layer and frequency, its best component and score
    strides = geometric_strides(pairs, 2 * scores[0].shape[1])
    total = lambda s: sum(b.values[torch.arange(pairs) * s].double().sum().item() for b in best)
    stride = max(strides, key=lambda s: (total(s), s))
    return stride, [[(int(b.indices[j * stride]), j * stride) for j in range(pairs)] for b in best]


class RoRoPEGeometric(RoRoPE):
    """RoRoPE keeping n_kv*r rotated pairs, one per frequency of a geometric set {0, s, 2s, ...} (exportable
    to DeepSeek's format and vLLM's MLA cache; `python -m mha2mla_exp.export`)."""

    name = "rorope-geometric"
    any_pair_count = False  # a KV budget's per-layer pair counts would give layers different rope widths

    def select(self, shape, r, score, calibration):
        pairs = shape.num_kv_heads * r
        if pairs > shape.head_dim // 2:
            raise ValueError(
                f"rope='{self.name}' keeps one rotated pair per frequency: n_kv*r = {pairs} pairs need at least "
                f"that many frequencies, a head has d_h/2 = {shape.head_dim // 2}"
            )
        scored = self.scored(shape, score, calibration)
        _, kept = geometric_choice([scores for _, scores in scored], pairs)
        return [RotatedPairs(u, k) for (u, _), k in zip(scored, kept)]
