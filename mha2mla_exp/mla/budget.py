"""A KV budget per token and layer, split between the shared rope key and the latent by measurement.

Under `kv_elements` = B, every layer keeps K rotated pairs (one rope key of 2K dims shared by every query
head, RoRoPE's layout) and a joint latent of B - 2K dims: exactly B cached elements per token in every layer.
MHA2MLA's r / d_kv can only express K = n_kv*r and a latent of n_kv*d_kv (SmolLM: 72 = 24 + 48 or 30 + 42);
TransMLA's best points give the rope key more (32 + 40).

`rope_pairs` fixes K. Left null, K is searched end to end: for each candidate K the whole model is converted
with K pairs in every layer and scored by its next-token loss on a selection sample (train split, a seed of
its own, never the held-out rows), on a coarse grid of counts and then by halving steps around the best.
`key_weight` (null: searched the same way, at the chosen K) multiplies the low-rank init's weight on the NoPE
keys' error against the values': the joint latent's trade between scores and values, which BKV sets by equal
energies and the model's loss may not. The converted config's `mla.budget_search` keeps every candidate tried.

Why one K for every layer, scored on the model's loss: this module first searched each layer on its own, by
the distance of its attention output to the original layer's. At 72 it chose 7..35 pairs per layer and
reached held-out ppl 110.9, where a uniform 16 reaches 103.2 (SmolLM2-135M, REPORT.md): a layer's own output
error does not price what its error does to the layers after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .spec import MLASpec, ModelShape, budget_pair_range

log = logging.getLogger(__name__)

COARSE_STEP = 4  # the first grid of pair counts; then steps 2 and 1 around the best
KEY_WEIGHTS = (0.5, 1.0, 2.0, 4.0, 8.0)  # the key weights tried first (multiples of the init's own K weight)
MAX_EXTENSIONS = 3


@torch.no_grad()
def selection_loss(model: nn.Module, batches: Iterable[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (nats per predicted token) of `model` on `batches` of input ids."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for ids in batches:
        ids = ids.to(device)
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total, count = total + nll.item(), count + ids[:, 1:].numel()
    if not count:
        raise ValueError("the selection sample holds no tokens to predict")
    return total / count


def search_split(spec: MLASpec, shape: ModelShape, build: Callable[[int, float], nn.Module],
                 selection: list[torch.Tensor]) -> tuple[int, float, list[dict]]:
    """The pair count K (the same in every layer) and the key weight whose conversion `build(K, weight)` has the
    lowest selection loss, and every candidate tried as {rope_pairs, key_weight, selection_loss}. K first (at
    the spec's key weight, 1 when that is searched too): a grid every COARSE_STEP counts (the last included),
    then steps 2 and 1 around the best; then the key weight at that K over KEY_WEIGHTS, doubled or halved past
    an edge while the edge keeps winning."""
    tried: dict[tuple[int, float], float] = {}

    def loss(k: int, weight: float) -> float:
        if (k, weight) not in tried:
            tried[k, weight] = selection_loss(build(k, weight), selection)
            log.info("KV budget %d: %d rope pairs + latent %d, key weight %g -> selection loss %.4f",
                     spec.kv_elements, k, spec.kv_elements - 2 * k, weight, tried[k, weight])
        return tried[k, weight]

    weight = 1.0 if spec.key_weight is None else spec.key_weight
    k = spec.rope_pairs
    if k is None:
        allowed = budget_pair_range(shape, spec.kv_elements)
        grid = list(allowed[::COARSE_STEP]) + ([allowed[-1]] if (len(allowed) - 1) % COARSE_STEP else [])
        k = min(grid, key=lambda c: loss(c, weight))
        for step in (2, 1):
            k = min([k] + [c for c in (k - step, k + step) if c in allowed], key=lambda c: loss(c, weight))
    if spec.key_weight is None:
        weights = list(KEY_WEIGHTS)
        weight = min(weights, key=lambda w: loss(k, w))
        for _ in range(MAX_EXTENSIONS):
            if weight not in (weights[0], weights[-1]):
                break
            weights = [weights[0] / 2] + weights if weight == weights[0] else weights + [weights[-1] * 2]
            weight = min(weights, key=lambda w: loss(k, w))
    candidates = [{"rope_pairs": c, "key_weight": w, "selection_loss": round(v, 6)} for (c, w), v in tried.items()]
    return k, weight, candidates
