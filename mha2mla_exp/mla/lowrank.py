"""Step 2 of MHA2MLA: truncated-SVD factorisation of the key/value projections."""

from __future__ import annotations

import torch


def low_rank_factors(
    weight: torch.Tensor, rank: int, sigma: str = "up", gram: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factor `weight` [out, in] into `up @ down` with `down` [rank, in] and `up` [out, rank].

    Without `gram` this is the truncated SVD of the weight (the paper): it minimises ||W - up@down||.
    With `gram` = X^T X of the layer's real inputs (activation-aware, as in SVD-LLM) it minimises the
    error of the outputs on those inputs, ||(W - up@down) X^T||: with G = S S^T (Cholesky),
    up@down = [W S]_rank S^-1. Exact at full rank either way.

    sigma='up' puts all singular values into `up` (every code generation of the paper);
    sigma='sqrt' splits them as sqrt(S) on each side (the paper's text). Same product either way.
    The SVD runs in float32 (float64 for the whitening) on the weight's device.
    """
    w = weight.float()
    chol = None
    if gram is not None:
        g = gram.to(device=w.device, dtype=torch.float64)
        g = g + 1e-6 * g.diagonal().mean().clamp_min(1e-12) * torch.eye(len(g), dtype=g.dtype, device=g.device)
        chol = torch.linalg.cholesky(g)
        w = (w.double() @ chol).float()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    if chol is not None:  # vh @ S^-1, by a triangular solve: (S^-T vh^T)^T
        vh = torch.linalg.solve_triangular(chol.T, vh.double().T, upper=True).T.float()
    if sigma == "up":
        down, up = vh, u * s
    elif sigma == "sqrt":
        root = s.sqrt()
        down, up = root[:, None] * vh, u * root
    else:
        raise ValueError(f"unknown sigma={sigma!r}; expected 'up' or 'sqrt'")
    return down.to(weight.dtype).contiguous(), up.to(weight.dtype).contiguous()


@torch.no_grad()
def collect_input_grams(model: torch.nn.Module, calibration) -> list[torch.Tensor]:
    """Per layer, X^T X of the key/value projections' input (the normed hidden states), summed over
    every calibration token; float64 on the CPU."""
    layers = [layer.self_attn for layer in model.model.layers]
    d = layers[0].k_proj.in_features
    grams = [torch.zeros(d, d, dtype=torch.float64) for _ in layers]

    def accumulate(gram: torch.Tensor):
        def hook(module, args):
            x = args[0].reshape(-1, d).double()
            gram.add_((x.T @ x).cpu())
        return hook

    hooks = [attn.k_proj.register_forward_pre_hook(accumulate(g)) for attn, g in zip(layers, grams)]
    device = next(model.parameters()).device
    try:
        for batch in calibration:
            ids = torch.as_tensor(batch["input_ids"] if isinstance(batch, dict) else batch)
            model(input_ids=(ids if ids.dim() == 2 else ids[None]).to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return grams
