"""Which held-out rows a perplexity is measured on, and which document each row comes from.

Held-out rows are packed across document boundaries in the split's (seeded) document order, so the first rows
come from the first few documents only: the first 32 SOTU rows of 512 tokens come from 3 of the 28 held-out
speeches. Rows of one document are not independent samples (same speaker, year, topic), so an interval that
resamples rows is too narrow; the unit of resampling is the document (aggregate/perplexity_pairs.py).

- `row_documents`: per packed row, the document that holds most of its tokens (ties: the earlier one).
- `select_rows`: when a perplexity is capped at n rows, which n. `first` is the first n (what every record
  before `eval.perplexity.rows` measured); `stratified` (the default) is a seeded sample that takes at least one
  row of every document when n allows and shares the rest in proportion to each document's rows (largest
  remainders), so every held-out document is represented and documents keep roughly their weight.
"""

from __future__ import annotations

import torch

ROW_SELECTIONS = ("stratified", "first")


def row_documents(doc_lengths: torch.Tensor, seq_len: int, n_rows: int) -> torch.Tensor:
    """[n_rows] document index of each packed row of `seq_len` cut from a stream of documents with these
    lengths (separator included, in stream order): the document holding the most tokens of the row."""
    ends = torch.cumsum(doc_lengths.long(), 0)
    starts = ends - doc_lengths.long()
    stream = int(ends[-1]) if len(ends) else 0
    if n_rows * seq_len > stream:
        raise ValueError(f"row_documents: {n_rows} rows of {seq_len} tokens do not fit a stream of {stream}")
    row_start = torch.arange(n_rows, dtype=torch.long)[:, None] * seq_len
    overlap = (torch.minimum(ends[None], row_start + seq_len) - torch.maximum(starts[None], row_start)).clamp(min=0)
    return overlap.argmax(1)  # argmax keeps the first of equal maxima


def select_rows(documents: torch.Tensor, n: int | None, how: str = "stratified", seed: int = 0) -> torch.Tensor:
    """Sorted indices of the `n` rows (None or n >= rows: all) to score, given each row's document."""
    if how not in ROW_SELECTIONS:
        raise ValueError(f"eval.perplexity.rows: unknown {how!r}; expected one of {', '.join(ROW_SELECTIONS)}")
    total = len(documents)
    if n is None or n >= total:
        return torch.arange(total)
    if n < 1:
        raise ValueError(f"select_rows: n must be positive, got {n}")
    if how == "first":
        return torch.arange(n)
    generator = torch.Generator().manual_seed(seed)
    docs, counts = torch.unique(documents, return_counts=True)
    if n < len(docs):  # fewer rows than documents: n documents drawn, one row each
        take = torch.zeros(len(docs), dtype=torch.long)
        take[torch.randperm(len(docs), generator=generator)[:n]] = 1
    else:
        take = torch.ones(len(docs), dtype=torch.long)
        rest = counts - 1
        share = (n - len(docs)) * rest.double() / max(int(rest.sum()), 1)
        take += share.floor().long()
        remainder = share - share.floor()
        for i in torch.argsort(remainder, descending=True, stable=True)[: n - int(take.sum())]:
            take[i] += 1
    picked = []
    for doc, k in zip(docs.tolist(), take.tolist()):
        rows = torch.nonzero(documents == doc).flatten()
        picked.append(rows[torch.randperm(len(rows), generator=generator)[:k]])
    return torch.cat(picked).sort().values
