"""What a pair that loses RoPE scores with: its key as it is ('plain', the paper), or scaled by how its
rotation turned the score where its heads attend ('attended', ours).

Under RoPE, pair f of a query at t and a key at s adds Re(q k* e^{i theta_f (t-s)}) to the score. Without RoPE
it adds Re(q k*): the term at distance 0, however far apart the two tokens are. For a frequency that turns many
times within the attended span that is a large, position-blind error (the term should average out); for one
that barely turns it is nearly right. 'attended' multiplies each NoPE key coordinate by the attention-weighted
mean cosine of its frequency over the distances the original model attends (`attended_cosine`), averaged over
the query heads that read the coordinate, each weighted by its coefficient squared times its mean query pair
norm squared: the NoPE term is then the first-order mean of the RoPE one instead of its value at distance
0, and a damped coordinate also takes less of the latent (the low-rank step sees its smaller energy).

Pairs that keep RoPE are untouched, so a conversion that keeps every pair is still exact.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .calibration import Calibration
from .layouts import KeySplit

NOPE_KEYS = ("plain", "attended")


def statistics(nope_keys: str) -> tuple[str, ...]:
    return ("attended_cosine", "pair_norms") if nope_keys == "attended" else ()


def nope_key_scale(selection, shape, cosine: torch.Tensor, q_norms: torch.Tensor) -> torch.Tensor:
    """Per row of the split's `nope_weight`, its factor [m]: the mean of `cosine` [n_h, d_h/2] at the row's
    frequency over the query heads that read the row, weighted by coefficient^2 * `q_norms`^2 (mean pair norms,
    [n_h, d_h/2])."""
    freqs, readers = selection.nope_readers(shape)
    if not len(freqs):
        return torch.ones(0, dtype=torch.float64)
    weight = readers**2 * q_norms.double().T[freqs] ** 2  # [m, n_h]
    return (weight * cosine.double().T[freqs]).sum(1) / weight.sum(1).clamp_min(1e-30)


def apply_nope_keys(
    nope_keys: str, splits: list[KeySplit], selections: list, shape, calib: Calibration
) -> list[KeySplit]:
    """The splits with their NoPE keys as `nope_keys` asks ('plain': unchanged)."""
    if nope_keys == "plain":
        return splits
    if nope_keys != "attended":
        raise ValueError(f"unknown nope_keys={nope_keys!r}; expected one of {NOPE_KEYS}")
    cosine = calib.get("attended_cosine")
    q_norms, _ = calib.get("pair_norms")
    out = []
    for i, (split, selection) in enumerate(zip(splits, selections)):
        scale = nope_key_scale(selection, shape, cosine[i], q_norms[i])
        dtype = split.nope_weight.dtype
        weight = (split.nope_weight.double() * scale[:, None]).to(dtype)
        bias = None if split.nope_bias is None else (split.nope_bias.double() * scale).to(dtype)
        out.append(replace(split, nope_weight=weight, nope_bias=bias))
    return out
