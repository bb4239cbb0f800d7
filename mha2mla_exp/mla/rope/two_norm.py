from __future__ import annotations

import torch

from ..layouts import HeadPairs
from .base import RopeStrategy


def head_scores(q_norms: torch.Tensor, k_norms: torch.Tensor, score: str, distance: torch.Tensor | None = None):
    """Each query head's score of each pair from mean pair norms (broadcast alike): ||q||*||k|| (the
    paper), ||q||+||k|| (the code behind its v1 tables), or 'rotation': ||q||*||k|| times the head's
    rotation distance rho (`rotation_distance`), the most dropping the pair's RoPE can change its score term."""
    if score == "product":
        return q_norms * k_norms
    if score == "sum":
        return q_norms + k_norms
    if score == "rotation":
        return q_norms * k_norms * distance
    raise ValueError(f"unknown score={score!r}")


def pair_scores(
    q_norms: torch.Tensor,
    k_norms: torch.Tensor,
    num_kv_heads: int,
    score: str = "product",
    distance: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-KV-head pair scores [n_kv, d_h/2] from q_norms [n_h, d_h/2] and k_norms [n_kv, d_h/2] (and, for
    score='rotation', distance [n_h, d_h/2]). Each query head is scored against its KV head and the query
    heads of a GQA group are summed, so the scores rank the same as per-group averages."""
    n_h, half = q_norms.shape
    group = n_h // num_kv_heads
    per_q_head = head_scores(q_norms, k_norms.repeat_interleave(group, dim=0), score, distance)
    return per_q_head.view(num_kv_heads, group, half).sum(dim=1)


def top_pairs(scores: torch.Tensor, r: int) -> list[list[int]]:
    """Sorted indices of the r highest-scoring pairs of each row (ties go to the lower index)."""
    if r == 0:
        return [[] for _ in range(scores.shape[0])]
    # stable descending sort: equal scores prefer the higher-frequency (lower) pair
    order = torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices[:, :r]
    return [sorted(row.tolist()) for row in order]


class PairScored(RopeStrategy):
    """A base (no name: not registered) for strategies that rank pairs by the 2-norm score, which
    score='rotation' weights by the calibration's rotation distances."""

    scores = ("product", "sum", "rotation")

    def needs(self, score):
        return self.statistics + (("rotation_distance",) if score == "rotation" else ())

    @staticmethod
    def distances(shape, score, calibration) -> list:
        """Per layer, the rotation distances the score reads (None where it reads none)."""
        return calibration.get("rotation_distance") if score == "rotation" else [None] * shape.num_layers


class TwoNorm(PairScored):
    """Per (layer, KV head), the r pairs with the largest pre-RoPE query/key norm score (METHOD.md step 1)."""

    name = "2-norm"
    statistics = ("pair_norms",)

    def select(self, shape, r, score, calibration):
        q_norms, k_norms = calibration.get("pair_norms")
        distance = self.distances(shape, score, calibration)
        return [
            HeadPairs(top_pairs(pair_scores(q_norms[i], k_norms[i], shape.num_kv_heads, score, distance[i]), r))
            for i in range(shape.num_layers)
        ]
