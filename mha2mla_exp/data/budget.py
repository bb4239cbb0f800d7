"""Token-budget accounting: tokens seen, their share of the model's pretraining tokens, passes over the data.

The paper's claim is recovery with 0.3-0.6% of the pretraining tokens (e.g. SmolLM-135M:
18k steps x 64 sequences x 2048 tokens = 2.36B tokens = 0.39% of 600B).
"""

from __future__ import annotations

import math


def tokens_per_step(batch_size: int, seq_len: int, grad_accum: int = 1) -> int:
    """Tokens in one optimiser step (packed rows have no padding, so every position counts)."""
    if min(batch_size, seq_len, grad_accum) < 1:
        raise ValueError(f"batch_size, seq_len and grad_accum must be positive, got {batch_size}, {seq_len}, {grad_accum}")
    return batch_size * seq_len * grad_accum


def steps_for_tokens(tokens: int, batch_size: int, seq_len: int, grad_accum: int = 1) -> int:
    """The fewest steps that see at least `tokens` tokens."""
    return math.ceil(tokens / tokens_per_step(batch_size, seq_len, grad_accum))


def pretrain_share_pct(tokens: int | float, pretrain_tokens: int | float | None) -> float | None:
    """`tokens` as a percentage of the model's pretraining tokens (None when that is unknown)."""
    if pretrain_tokens is None:
        return None
    if pretrain_tokens <= 0:
        raise ValueError(f"pretrain_tokens must be positive, got {pretrain_tokens}")
    return 100.0 * tokens / pretrain_tokens


def token_budget(
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    pretrain_tokens: float | None = None,
    available_tokens: int | None = None,
) -> dict:
    """The budget of a run: tokens seen, share of pretraining (%), and epochs over the available train tokens."""
    tokens = steps * tokens_per_step(batch_size, seq_len, grad_accum)
    return {
        "steps": steps,
        "tokens": tokens,
        "pretrain_tokens": pretrain_tokens,
        "pretrain_share_pct": pretrain_share_pct(tokens, pretrain_tokens),
        "epochs": None if not available_tokens else tokens / available_tokens,
    }


def check_epochs(tokens: int, available: int | None, epochs_allowed) -> float | None:
    """Epochs a budget makes over a finite corpus; ValueError unless `epochs_allowed` permits repeating text.

    `epochs_allowed`: false (one pass at most), true (any), or a number (at most that many passes).
    A stream (`available` None) never repeats.
    """
    if available is None:
        return None
    epochs = tokens / available
    limit = 1.0 if not epochs_allowed else (float("inf") if epochs_allowed is True else float(epochs_allowed))
    if epochs > limit:
        raise ValueError(
            f"train.tokens: the budget of {tokens:,} tokens is {epochs:.2f} passes over the {available:,} training "
            f"tokens of this corpus (allowed: {limit:g}); fine-tuning would repeat text. Lower the budget, stream a "
            "corpus (data=smollm_corpus), or set train.epochs_allowed=true (or a number of passes)"
        )
    return epochs
