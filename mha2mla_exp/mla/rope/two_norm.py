from __future__ import annotations

import torch

from ..layouts import HeadPairs
from .base import RopeStrategy


def pair_scores(q_norms: torch.Tensor, k_norms: torch.Tensor, num_kv_heads: int, score: str = "product") -> torch.Tensor:
    """Per-KV-head pair scores from mean pre-RoPE pair norms, q_norms [n_h, d_h/2] and k_norms [n_kv, d_h/2].

    Each query head is scored against its KV head (||q||*||k|| as in the paper, or ||q||+||k|| as in the
    code behind the v1 tables), and the query heads of a GQA group are summed, so both scores rank the
    same as per-group averages.
    """
    n_h, half = q_norms.shape
    group = n_h // num_kv_heads
    k_rep = k_norms.repeat_interleave(group, dim=0)
    per_q_head = q_norms * k_rep if score == "product" else q_norms + k_rep
    return per_q_head.view(num_kv_heads, group, half).sum(dim=1)


def top_pairs(scores: torch.Tensor, r: int) -> list[list[int]]:
    """Sorted indices of the r highest-scoring pairs of each row (ties go to the lower index)."""
    if r == 0:
        return [[] for _ in range(scores.shape[0])]
    # stable descending sort: equal scores prefer the higher-frequency (lower) pair
    order = torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices[:, :r]
    return [sorted(row.tolist()) for row in order]


class TwoNorm(RopeStrategy):
    """Per (layer, KV head), the r pairs with the largest pre-RoPE query/key norm score (METHOD.md step 1)."""

    name = "2-norm"
    statistics = ("pair_norms",)
    scores = ("product", "sum")

    def select(self, shape, r, score, calibration):
        q_norms, k_norms = calibration.get("pair_norms")
        return [HeadPairs(top_pairs(pair_scores(q_norms[i], k_norms[i], shape.num_kv_heads, score), r))
                for i in range(shape.num_layers)]
