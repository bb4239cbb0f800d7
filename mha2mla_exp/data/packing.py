"""The split by document, and packing token streams into fixed-length rows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def is_held_out(text: str, fraction: float, seed: int) -> bool:
    """Whether a document belongs to the held-out split: a seeded hash of its text against `fraction`.

    Keyed by content, not position, so the decision never depends on the order or the number of
    documents read (a streamed corpus splits the same way however far it is read), and exact
    duplicates always land on the same side, so they cannot leak held-out text into training.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def concat_documents(docs: list[list[int]], separator: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token stream: each document followed by `separator` (so one sits between every two documents).

    Returns (stream, document lengths including their separator).
    """
    lengths = torch.tensor([len(d) + 1 for d in docs], dtype=torch.long)
    stream = torch.empty(int(lengths.sum()), dtype=torch.long)
    pos = 0
    for doc in docs:
        stream[pos : pos + len(doc)] = torch.as_tensor(doc, dtype=torch.long)
        stream[pos + len(doc)] = separator
        pos += len(doc) + 1
    return stream, lengths


@dataclass(frozen=True)
class Packed:
    """`rows` [N, seq_len] cut from a stream in order, and the `tail` (< seq_len tokens) left after them.

    cat(rows.flatten(), tail) is the stream: every token is kept exactly once. The tail is returned
    rather than padded or dropped silently so that each consumer decides (training drops it,
    perplexity may score it) and the token accounting stays exact.
    """

    rows: torch.Tensor
    tail: torch.Tensor


def pack(stream: torch.Tensor, seq_len: int) -> Packed:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n = stream.numel() // seq_len
    return Packed(rows=stream[: n * seq_len].view(n, seq_len), tail=stream[n * seq_len :])
