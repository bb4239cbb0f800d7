"""Held-out perplexity: the cheap metric every run records."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


def _unpack(batch):
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
    raise TypeError(f"a perplexity batch is a tensor of input_ids or a dict with input_ids, got {type(batch)}")


@torch.no_grad()
def perplexity(model, batches: Iterable, *, max_batches: int | None = None, rows: list | None = None) -> float:
    """exp(mean next-token NLL) over all predicted tokens of `batches`.

    A batch is an input_ids tensor `[B, T]` (or `[T]`) or a dict with `input_ids` and optionally
    `attention_mask` (0 = padding, not predicted) and `labels` (-100 = not predicted). Tokens are
    weighted equally across batches. No cache is used. `rows`, when given, receives one
    (NLL sum, predicted tokens) pair per row: what a paired bootstrap over rows resamples.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            ids, mask, labels = _unpack(batch)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            labels = ids.clone() if labels is None else (labels.unsqueeze(0) if labels.dim() == 1 else labels.clone())
            if mask is not None:
                mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
                labels[mask == 0] = -100
                mask = mask.to(device)
            logits = model(input_ids=ids.to(device), attention_mask=mask, use_cache=False).logits
            target = labels[:, 1:].to(device)
            flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            nll += F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
            if rows is not None:
                per_token = F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="none")
                sums, counts = per_token.view(target.shape).sum(1), (target != -100).sum(1)
                rows.extend(zip(sums.tolist(), counts.tolist()))
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("perplexity: no token to predict in the given batches")
    return math.exp(nll / count)
