"""A KV budget per token and layer, split between the shared rope key and the latent by measurement.

Under `kv_elements` = B, every layer keeps K rotated pairs (one rope key of 2K dims shared by every query
head, RoRoPE's layout) and a joint latent of B - 2K dims: exactly B cached elements per token in every layer.
MHA2MLA's r / d_kv can only express K = n_kv*r and a latent of n_kv*d_kv (SmolLM: 72 = 24 + 48 or 30 + 42);
TransMLA's best points give the rope key more (32 + 40).

`rope_pairs` fixes K. Left null, K is searched end to end: for each candidate K the whole model is converted
with K pairs in every layer and scored by its next-token loss on a selection sample (train split, a seed of
its own, never the held-out rows), on a coarse grid of counts and then by halving steps around the best.
The converted config's `mla.budget_search` keeps the loss of every K tried.

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


def search_rope_pairs(spec: MLASpec, shape: ModelShape, build: Callable[[int], nn.Module],
                      selection: list[torch.Tensor]) -> tuple[int, dict[int, float]]:
    """The pair count K (the same in every layer) whose conversion `build(K)` has the lowest selection loss,
    and the loss of every K tried. Coarse grid every COARSE_STEP counts (the last count included), then the
    neighbours of the best at steps 2 and 1."""
    allowed = budget_pair_range(shape, spec.kv_elements)
    losses: dict[int, float] = {}

    def loss(k: int) -> float:
        if k not in losses:
            losses[k] = selection_loss(build(k), selection)
            log.info("KV budget %d: %d rope pairs + latent %d -> selection loss %.4f",
                     spec.kv_elements, k, spec.kv_elements - 2 * k, losses[k])
        return losses[k]

    grid = list(allowed[::COARSE_STEP]) + ([allowed[-1]] if (len(allowed) - 1) % COARSE_STEP else [])
    best = min(grid, key=loss)
    for step in (2, 1):
        for k in (best - step, best + step):
            if k in allowed:
                loss(k)
        best = min(losses, key=losses.get)
    return best, losses
