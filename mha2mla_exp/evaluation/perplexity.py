"""Held-out perplexity: the cheap metric every run records.

The NLL comes from the decoder's last hidden states through the output layer a chunk of positions at a time, so
the full `[B, T, vocab]` logits never exist: for Gemma-3's 262,144-word vocabulary the plain path held 1 GiB of
fp32 logits per 1,024 positions, three times over (the logits, their fp32 copy, the log-softmax).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ..train.loss_head import CHUNK_ROWS, last_hidden_state_of, logit_cap_of, soft_cap


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
            target = labels[:, 1:].to(device)
            per_token = token_nll(model, ids.to(device), mask, target)
            nll += per_token.sum().item()
            count += int((target != -100).sum())
            if rows is not None:
                sums, counts = per_token.sum(1), (target != -100).sum(1)
                rows.extend(zip(sums.tolist(), counts.tolist()))
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("perplexity: no token to predict in the given batches")
    return math.exp(nll / count)


def token_nll(model, ids: torch.Tensor, mask: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """Next-token NLL `[B, T-1]` of `ids` `[B, T]` (0 where `target` is -100), in fp32.

    A model with a bias-free output layer over a `.model` decoder (every family here) gets its logits per chunk of
    `CHUNK_ROWS` positions from the last hidden states (with the family's final soft cap); any other model's
    full logits are used as they are."""
    head, decoder = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not (isinstance(head, torch.nn.Linear) and head.bias is None and decoder is not None):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="none").view(target.shape)
    with last_hidden_state_of(decoder) as captured:
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # one position's logits
    hidden = captured["hidden"][:, :-1].reshape(-1, captured["hidden"].shape[-1])
    flat_target, cap = target.reshape(-1), logit_cap_of(model)
    out = torch.empty(flat_target.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], CHUNK_ROWS):
        logits = soft_cap(head(hidden[start : start + CHUNK_ROWS]).float(), cap)
        out[start : start + CHUNK_ROWS] = F.cross_entropy(
            logits, flat_target[start : start + CHUNK_ROWS], ignore_index=-100, reduction="none"
        )
    return out.view(target.shape)
