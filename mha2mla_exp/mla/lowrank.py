"""Step 2 of MHA2MLA: truncated-SVD factorisation of the key/value projections."""

from __future__ import annotations

import torch


def low_rank_factors(weight: torch.Tensor, rank: int, sigma: str = "up") -> tuple[torch.Tensor, torch.Tensor]:
    """Factor `weight` [out, in] into `up @ down` with `down` [rank, in] and `up` [out, rank].

    sigma='up' puts all singular values into `up` (every code generation of the paper);
    sigma='sqrt' splits them as sqrt(S) on each side (the paper's text). Same product either way.
    The SVD runs in float32 on the weight's device, whatever the weight's dtype.
    """
    u, s, vh = torch.linalg.svd(weight.float(), full_matrices=False)
    u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    if sigma == "up":
        down, up = vh, u * s
    elif sigma == "sqrt":
        root = s.sqrt()
        down, up = root[:, None] * vh, u * root
    else:
        raise ValueError(f"unknown sigma={sigma!r}; expected 'up' or 'sqrt'")
    return down.to(weight.dtype).contiguous(), up.to(weight.dtype).contiguous()
