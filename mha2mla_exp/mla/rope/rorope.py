from __future__ import annotations

import torch

from ..calibration import Statistic, on_inputs
from ..layouts import RotatedPairs
from .two_norm import PairScored, head_scores


def principal_axes(moments: torch.Tensor) -> torch.Tensor:
    """Per frequency, the eigenvectors of the n_kv x n_kv key moment, by decreasing eigenvalue (columns).
    [d_h/2, n_kv, n_kv] -> the same shape, each matrix orthogonal."""
    values, vectors = torch.linalg.eigh(moments.double())
    order = values.argsort(dim=-1, descending=True)
    return torch.gather(vectors, -1, order[:, None, :].expand_as(vectors))


class RotatedKeyNorms(Statistic):
    """Mean pair norms of the rotated pre-RoPE keys k'_{c,f} = sum_g U_f[g, c] k_{g,f}, averaged like
    `pair_norms` (tokens of a sequence, then sequences). [L, n_kv (components), d_h/2]"""

    def __init__(self, shape, rotations: list[torch.Tensor]):
        super().__init__(shape)
        self.rotations = [u.float() for u in rotations]
        self.total = torch.zeros(shape.num_layers, shape.num_kv_heads, shape.head_dim // 2, dtype=torch.float64)

    def attach(self, layers):
        n_kv, d_h, half = self.shape.num_kv_heads, self.shape.head_dim, self.shape.head_dim // 2

        def fn(i, layer, x, kwargs):
            k = layer.keys(x)
            k = k.float().view(*k.shape[:-1], n_kv, d_h)
            u = self.rotations[i].to(k.device)
            re = torch.einsum("btgf,fgc->btcf", k[..., :half], u)
            im = torch.einsum("btgf,fgc->btcf", k[..., half:], u)
            self.total[i].add_(torch.sqrt(re**2 + im**2).mean(dim=1).sum(dim=0).double().cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return (self.total / n_seqs).float()


def rotated_pair_scores(
    q_norms: torch.Tensor,
    k_norms: torch.Tensor,
    rotation: torch.Tensor,
    score: str = "product",
    distance: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores [n_kv (components), d_h/2] of the rotated pairs: query head h of group g meets pair (c, f) with
    U_f[g, c] q_{h,f}, of mean norm |U_f[g, c]| ||q_{h,f}||; the shared rope key is read by every query
    head, so each head's score (`head_scores`: product, sum or rotation) is summed over all of them."""
    n_h, half = q_norms.shape
    n_kv = rotation.shape[1]
    group = torch.arange(n_h) // (n_h // n_kv)
    q_rot = rotation.abs().float()[:, group, :].permute(1, 2, 0) * q_norms[:, None, :]  # [n_h, c, f]
    per_head = head_scores(q_rot, k_norms[None], score, None if distance is None else distance[:, None, :])
    return per_head.sum(dim=0)


class RoRoPE(PairScored):
    """TransMLA's RoRoPE (arXiv 2502.07864): per layer and frequency, rotate the KV heads onto the principal
    axes of their pre-RoPE keys (the rotation commutes with RoPE), then keep RoPE on the n_kv*r rotated
    (component, frequency) pairs with the largest 2-norm score: one rope key of 2*n_kv*r dims shared by all
    query heads, the same cache as MHA2MLA's per-head pairs at equal r (layout 'shared', mla/layouts.py)."""

    name = "rorope"
    statistics = ("pair_norms", "key_pair_moments")
    any_pair_count = True  # one shared rope key: a layer may keep any number of rotated pairs, not n_kv*r
    layout = "shared"

    def select(self, shape, r, score, calibration):
        return [RotatedPairs(u, order[: shape.num_kv_heads * r]) for u, order in self.ranked(shape, score, calibration)]

    def ranked(self, shape, score, calibration) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """Per layer, the rotation U and every rotated (component, frequency) pair by decreasing score: keeping
        the first K is this strategy's choice for K pairs (`RotatedPairs(U, order[:K])`)."""
        n_kv = shape.num_kv_heads
        ranked = []
        for u, scores in self.scored(shape, score, calibration):
            flat = scores.T.reshape(-1)  # frequency-major: ties go to the higher frequency, then component
            order = torch.sort(flat.double(), descending=True, stable=True).indices.tolist()
            ranked.append((u, [(j % n_kv, j // n_kv) for j in order]))
        return ranked

    def scored(self, shape, score, calibration) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the rotation U and the scores [n_kv (components), d_h/2] of its rotated pairs."""
        q_norms, _ = calibration.get("pair_norms")
        distance = self.distances(shape, score, calibration)
        rotations = [principal_axes(m) for m in calibration.get("key_pair_moments")]
        (k_norms,) = calibration.run(RotatedKeyNorms(shape, rotations))
        return [
            (u, rotated_pair_scores(q_norms[i], k_norms[i], u, score, distance[i])) for i, u in enumerate(rotations)
        ]
