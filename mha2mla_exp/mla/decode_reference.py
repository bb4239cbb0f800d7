"""The PyTorch reference of one absorbed MLA decode step (bmm, softmax, bmm).

It is the CPU fallback of `absorbed_decode` and the ground truth the Triton kernel is tested
against. Numerics follow the kernel (and `MLAAttention`'s absorbed prefill): the scores and the
softmax in float32 (the operands upcast; logits rounded to 16 bits would lose what SDPA keeps),
probabilities times values in the input dtype.
"""

from __future__ import annotations

import torch


def absorbed_decode_reference(
    q_rope: torch.Tensor,
    q_latent: torch.Tensor,
    k_rope: torch.Tensor,
    latent: torch.Tensor,
    k_slice: slice,
    v_slice: slice,
    scale: float,
    valid_start: torch.Tensor | None = None,
    valid_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attended latent `[B, n_h, L_v]` for one query token per sequence.

    q_rope `[B, n_h, 2r]` (rotated), q_latent `[B, n_h, L_k]` (W_uk already folded in),
    k_rope `[B, n_kv, S, 2r]`, latent `[B, S, L]` shared by all heads, keys read from
    `latent[..., k_slice]` and values from `latent[..., v_slice]`. Sequence b attends to the
    positions `[valid_start[b], valid_end[b])` (left/right padding); a row with none gets zeros.
    """
    b, n_h, _ = q_latent.shape
    n_kv, s = k_rope.shape[1], latent.shape[1]
    scores = torch.bmm(q_latent.float(), latent[..., k_slice].float().transpose(1, 2))  # [B, n_h, S]
    if q_rope.shape[-1]:
        rope = torch.matmul(q_rope.float().view(b, n_kv, n_h // n_kv, -1), k_rope.float().transpose(-1, -2))
        scores = scores + rope.view(b, n_h, s)
    scores = scores * scale
    valid = None
    if valid_start is not None or valid_end is not None:
        pos = torch.arange(s, device=latent.device)
        start = torch.zeros(b, dtype=torch.long, device=pos.device) if valid_start is None else valid_start
        end = torch.full((b,), s, dtype=torch.long, device=pos.device) if valid_end is None else valid_end
        valid = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])  # [B, S]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if valid is not None:  # a fully masked row is NaN after softmax; define it as zero
        probs = probs.masked_fill(~valid.any(-1)[:, None, None], 0.0)
    return torch.bmm(probs.to(latent.dtype), latent[..., v_slice])
