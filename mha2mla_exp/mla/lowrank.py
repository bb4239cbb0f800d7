"""Step 2 of MHA2MLA: weighted truncated SVD of the key/value projections, and per-layer rank allocation.

For a weight W [out, in], PSD weights M (on the outputs) and G (on the inputs), the rank-k W_hat that
minimises ||M^{1/2} (W - W_hat) G^{1/2}||_F is, with M = L L^T and G = R R^T (Cholesky),
W_hat = L^-T [L^T W R]_k R^-1 (Eckart-Young after whitening both sides). M = G = I is the paper's plain SVD;
G = X^T X alone is activation-aware SVD (SVD-LLM). Exact at full rank for any weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _cholesky(matrix: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of a PSD matrix (float64), damped by 1e-6 of its mean diagonal so that a
    rank-deficient statistic (few calibration tokens, dead directions) still factors."""
    m = matrix.double()
    damp = 1e-6 * m.diagonal().mean().clamp_min(1e-12)
    return torch.linalg.cholesky(m + damp * torch.eye(len(m), dtype=m.dtype, device=m.device))


# How `WeightedSVD.factors` splits each direction between down and up (part of a trained model's identity
# wherever whitening makes it matter: the fine-tune starts from these factors)
FACTOR_SPLIT = "per-direction-norm"


@dataclass
class WeightedSVD:
    """The SVD of L^T W R and the factors to undo the whitening; `factors(rank)` truncates it."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    left: torch.Tensor | None  # L
    right: torch.Tensor | None  # R
    dtype: torch.dtype

    @property
    def energy(self) -> torch.Tensor:
        """s^2: how much of the weighted error each kept direction removes."""
        return self.s**2

    def factors(self, rank: int, sigma: str = "up") -> tuple[torch.Tensor, torch.Tensor]:
        """(down [rank, in], up [out, rank]) with up @ down = W_hat, split per direction as the paper splits a
        plain SVD: sigma='up' (every code generation) gives each row of `down` unit norm and the direction's
        whole gain to `up`; 'sqrt' (its text) gives both sides the square root of the gain.

        Under whitening the unwhitened directions are not unit vectors, and their norms scale with the
        statistics (an input Gram summed over N calibration tokens shrinks `down` by sqrt(N)). The product
        does not care; AdamW does: it moves every entry by ~lr, so a tiny `down` is retrained far faster than
        a large one. Normalising per direction makes the factors independent of how the statistics are
        scaled and equal to the paper's for plain SVD (FACTOR_SPLIT names this convention in run identities).
        """
        u, s, vh = self.u[:, :rank], self.s[:rank], self.vh[:rank]
        if self.left is not None:  # L^-T u
            u = torch.linalg.solve_triangular(self.left.T, u, upper=True)
        if self.right is not None:  # vh R^-1 = (R^-T vh^T)^T
            vh = torch.linalg.solve_triangular(self.right.T, vh.T, upper=True).T
        down_norm, up_norm = vh.norm(dim=1).clamp_min(1e-30), u.norm(dim=0).clamp_min(1e-30)
        gain = s * down_norm * up_norm
        vh, u = vh / down_norm[:, None], u / up_norm
        if sigma == "up":
            down, up = vh, u * gain
        elif sigma == "sqrt":
            root = gain.sqrt()
            down, up = root[:, None] * vh, u * root
        else:
            raise ValueError(f"unknown sigma={sigma!r}; expected 'up' or 'sqrt'")
        return down.to(self.dtype).contiguous(), up.to(self.dtype).contiguous()


def weighted_svd(
    weight: torch.Tensor, left: torch.Tensor | None = None, right: torch.Tensor | None = None
) -> WeightedSVD:
    """The SVD of `weight` whitened by `left` (M, on its rows) and `right` (G, on its columns), in float64
    on the weight's device."""
    w = weight.double()
    chol_l = None if left is None else _cholesky(left.to(w.device))
    chol_r = None if right is None else _cholesky(right.to(w.device))
    if chol_l is not None:
        w = chol_l.T @ w
    if chol_r is not None:
        w = w @ chol_r
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return WeightedSVD(u, s, vh, chol_l, chol_r, weight.dtype)


def low_rank_factors(
    weight: torch.Tensor,
    rank: int,
    sigma: str = "up",
    gram: torch.Tensor | None = None,
    left: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) of the rank-`rank` truncation of `weight` under input weight `gram` and output weight `left`."""
    return weighted_svd(weight, left, gram).factors(rank, sigma)


def allocate_ranks(energies: list[torch.Tensor], total: int, caps: list[int], floor: int = 1) -> list[int]:
    """Per-layer ranks summing to `total` that keep the largest singular energies across all layers (each
    layer at least `floor`, at most its cap): under a fixed total latent, the rank goes where the init's
    objective falls most. Ties go to the earlier layer."""
    if total > sum(caps) or total < floor * len(caps):
        raise ValueError(
            f"a total rank of {total} cannot be split over {len(caps)} layers (at least {floor}, at most {caps} each)"
        )
    ranks = [floor] * len(caps)
    candidates = [
        (float(e), layer, i)
        for layer, (energy, cap) in enumerate(zip(energies, caps))
        for i, e in enumerate(energy[:cap].tolist())
        if i >= floor
    ]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))  # within a layer energies are sorted already
    for _, layer, _ in candidates[: total - sum(ranks)]:
        ranks[layer] += 1
    return ranks
