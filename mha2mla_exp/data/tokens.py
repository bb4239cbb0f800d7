"""Documents to token ids as training reads them: with the tokenizer's BOS first where it adds one.

lm-eval's HFLM scores with the tokenizer's own special tokens (`add_special_tokens` left at its default), so a
tokenizer that starts every sequence with BOS (Llama-2's) is evaluated on `BOS text`; pretraining saw documents
the same way. Training documents therefore begin with BOS exactly when the tokenizer would add it, and never
with its other special tokens (an EOS it appends is the separator's job). Tokenizers that add nothing
(SmolLM2's, the byte-level one) give the ids they always gave.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def bos_prefix(tokenizer) -> list[int]:
    """`[bos_token_id]` when the tokenizer puts BOS first on a sequence by default, else `[]`."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    with_special = tokenizer("a", verbose=False)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False, verbose=False)["input_ids"]
    return [int(bos)] if with_special[:1] == [bos] and plain[:1] != [bos] else []


def tokenize_documents(tokenizer, texts: list[str], prefix: list[int] | None = None) -> list[list[int]]:
    """Each text's ids, `prefix` (default: `bos_prefix(tokenizer)`) first; no other special token."""
    prefix = bos_prefix(tokenizer) if prefix is None else prefix
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [prefix + doc for doc in ids] if prefix else ids


def tokenizer_fingerprint(tokenizer) -> dict:
    """Name and a hash of the full tokenizer definition (vocab, merges, normaliser), for cache keys."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        # the folder's last part only: the same tokenizer under another cache root keeps its key
        "name": Path(str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)).name,
        "vocab_size": len(tokenizer),
        "sha256": hashlib.sha256(definition.encode()).hexdigest(),
    }
