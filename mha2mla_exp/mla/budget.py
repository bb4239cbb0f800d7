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

`allocation='measured'` then lets the latent's width differ between layers, the total kept: B elements per token
and layer on average, so the cache holds exactly what the uniform split holds. Widths move `step` dims at a time
from the layers whose narrowing costs the model least to those whose widening gains it most, each move priced by
converting the whole model and scoring it on the selection sample (`search_widths`); an exchange is kept only
when the whole model's loss falls. Singular energy (`allocation='global'`) prices a layer by its own objective,
which starves other layers; the model's loss does not.

Why one K for every layer, scored on the model's loss: a layer's own output error (the distance of its attention
output to the original layer's) does not price what its error does to the layers after it; searched per layer
that way, the split measured worse than a uniform one (results/REPORT.md, the KV budget section).
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
WIDTH_STEP, WIDTH_ROUNDS = 8, 2  # allocation='measured': dims per exchange, rounds of exchanges (2L + 1 scores each)


@torch.no_grad()
def selection_loss(model: nn.Module, batches: Iterable[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (nats per predicted token) of `model` on `batches` of input ids."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for ids in batches:
        ids = ids.to(device)
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + nll.item(), count + ids[:, 1:].numel()
    if not count:
        raise ValueError("the selection sample holds no tokens to predict")
    return total / count


def search_split(
    spec: MLASpec, shape: ModelShape, build: Callable[[int, float], nn.Module], selection: list[torch.Tensor]
) -> tuple[int, float, list[dict]]:
    """The pair count K (the same in every layer) and the key weight whose conversion `build(K, weight)` has the
    lowest selection loss, and every candidate tried as {rope_pairs, key_weight, selection_loss}. K first (at
    the spec's key weight, 1 when that is searched too): a grid every COARSE_STEP counts (the last included),
    then steps 2 and 1 around the best; then the key weight at that K over KEY_WEIGHTS, doubled or halved past
    an edge while the edge keeps winning."""
    tried: dict[tuple[int, float], float] = {}

    def loss(k: int, weight: float) -> float:
        if (k, weight) not in tried:
            tried[k, weight] = selection_loss(build(k, weight), selection)
            log.info(
                "KV budget %d: %d rope pairs + latent %d, key weight %g -> selection loss %.4f",
                spec.kv_elements,
                k,
                spec.kv_elements - 2 * k,
                weight,
                tried[k, weight],
            )
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


def search_widths(
    widths: list[int],
    caps: list[int],
    score: Callable[[list[int]], float],
    step: int | None = None,
    rounds: int | None = None,
    floor: int = 1,
) -> tuple[list[int], dict]:
    """Per-layer latent widths with the sum of `widths` whose conversion `score(widths)` (the selection loss) is
    lowest, found by exchanges of `step` dims, each layer between `floor` and its cap. A round prices every layer
    one step wider and one step narrower than now, pairs the best gains with the cheapest losses (other layers,
    each layer in one exchange) while a gain exceeds its cost, and keeps the exchanges if the whole model's loss
    falls, else the better half of them, down to one; a round that keeps none ends the search. Returns the widths
    and what was tried: {"uniform_loss", "rounds": [{"exchanges", "selection_loss", "widths"}], "scored"}."""
    step, rounds = step or WIDTH_STEP, rounds or WIDTH_ROUNDS
    widths, total = list(widths), sum(widths)
    best = score(widths)
    log.info(
        "latent allocation: %d dims over %d layers, start %s -> selection loss %.4f", total, len(widths), widths, best
    )
    record = {"uniform_loss": round(best, 6), "rounds": [], "scored": 1}

    def moved(base: list[int], changes: dict[int, int]) -> list[int]:
        out = list(base)
        for layer, delta in changes.items():
            out[layer] += delta
        return out

    for _ in range(rounds):
        gains, costs = {}, {}
        for layer, (w, cap) in enumerate(zip(widths, caps)):
            if w + step <= cap:
                gains[layer] = best - score(moved(widths, {layer: step}))
            if w - step >= floor:
                costs[layer] = score(moved(widths, {layer: -step})) - best
            record["scored"] += (w + step <= cap) + (w - step >= floor)
            log.info(
                "latent allocation: layer %d at %d dims: %+d gains %s, %+d costs %s",
                layer,
                w,
                step,
                _fmt(gains.get(layer)),
                -step,
                _fmt(costs.get(layer)),
            )
        exchanges, used = [], set()
        donors = sorted(costs, key=costs.get)
        for receiver in sorted(gains, key=gains.get, reverse=True):
            donor = next((d for d in donors if d not in used and d != receiver), None)
            if receiver in used or donor is None or gains[receiver] <= costs[donor]:
                continue
            exchanges.append((receiver, donor))
            used |= {receiver, donor}
        kept = None
        while exchanges:
            candidate = moved(widths, {l: d for r, donor in exchanges for l, d in ((r, step), (donor, -step))})
            loss = score(candidate)
            record["scored"] += 1
            if loss < best:
                kept = (candidate, loss, len(exchanges))
                break
            exchanges = exchanges[: len(exchanges) // 2]
        if kept is None:
            break
        widths, best = kept[0], kept[1]
        record["rounds"].append({"exchanges": kept[2], "selection_loss": round(best, 6), "widths": list(widths)})
        log.info(
            "latent allocation: %d exchanges of %d dims -> selection loss %.4f, widths %s", kept[2], step, best, widths
        )
    assert sum(widths) == total
    return widths, record


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
