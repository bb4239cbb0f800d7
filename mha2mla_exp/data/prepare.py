"""Tokenize a corpus once, split it by document, pack it into rows; sample calibration data for 2-norm.

Never train on evaluation data: every document goes wholly to train or to held-out (a seeded
hash of its text, see packing.is_held_out), so held-out perplexity is measured on documents the
model never saw in fine-tuning, and calibration reads the train split only. Benchmark (eval)
assets are refused as training corpora by check_data_config.

The tokenized streams are cached on disk (safetensors) under
<cache>/data/<name>-<key>.safetensors, key = hash of (corpus identity, tokenizer name + vocab
hash, separator, split fraction + seed). They are cached before packing, so any seq_len reuses
the same file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .. import atomic
from ..schema.sections import DataConfig
from .held_out import row_documents
from .packing import concat_documents, is_held_out, pack
from .rows import FiniteRows, rechunk
from .sources import check_data_config, corpus_fingerprint, iter_documents
from .stream import StreamMixture, TrainStream, plan_mixture, read_held_out, read_shares
from .tokens import bos_prefix, tokenize_documents, tokenizer_fingerprint

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
SPLITS = ("train", "held_out")
_CHUNK = 64  # documents tokenized per batch call (the fast tokenizer parallelises inside a batch)


@dataclass
class PreparedData:
    """Packed token rows per split. `train`/`held_out` are LongTensor [rows, seq_len]; the `*_tail`
    tensors hold what is left after the last full row (< seq_len tokens), so no token is lost."""

    name: str
    seq_len: int
    separator_id: int
    train: torch.Tensor
    held_out: torch.Tensor
    train_tail: torch.Tensor
    held_out_tail: torch.Tensor
    stats: dict = field(default_factory=dict)
    held_out_doc_lengths: torch.Tensor | None = None  # per held-out document, in stream order, separator included

    def held_out_documents(self, seq_len: int | None = None) -> torch.Tensor | None:
        """Each held-out row's document (rows of `seq_len`, default the packing length; data/held_out.py)."""
        return _row_documents(self.held_out_doc_lengths, self.stream("held_out"), seq_len or self.seq_len)

    def training_rows(self, seq_len: int, seed: int) -> FiniteRows:
        """The train split as rows of the fine-tune's length, read epoch by epoch in a seeded order."""
        return FiniteRows(rechunk(self.train, seq_len), seed)

    def sample_train(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        """`n` non-overlapping windows of `seq_len` train tokens, drawn with a seeded permutation."""
        stream = self.stream("train")
        windows = stream.numel() // seq_len
        if n > windows:
            raise ValueError(
                f"calibration: the train split of {self.name!r} has {stream.numel()} tokens, only {windows} "
                f"windows of {seq_len}; asked for {n}"
            )
        pick = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:n].sort().values
        return stream[: windows * seq_len].view(windows, seq_len)[pick]

    def stream(self, split: str) -> torch.Tensor:
        """The whole token stream of `split` (rows then tail), documents separated by `separator_id`."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        rows, tail = getattr(self, split), getattr(self, f"{split}_tail")
        return torch.cat([rows.reshape(-1), tail])


def resolve_separator(data: DataConfig, tokenizer) -> int:
    """The document separator id: the tokenizer's EOS by default, or the token named by data.separator."""
    sep = data.separator
    if sep == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError("data.separator: the tokenizer has no EOS token; name a separator token instead")
        return int(tokenizer.eos_token_id)
    ids = tokenizer.convert_tokens_to_ids([sep])
    if not ids or ids[0] is None or (ids[0] == tokenizer.unk_token_id and sep != tokenizer.unk_token):
        raise ValueError(f"data.separator: {sep!r} is not a token of this tokenizer")
    return int(ids[0])


def document_tokens(data: DataConfig, tokenizer) -> Iterator[tuple[str, list[int]]]:
    """(split key, token ids) per document, in the source's order. Text is tokenized in batches and split by
    its own text; a teacher source's samples are token ids already (decoding and encoding them again would
    not give the same ids back) and are split by their ids."""
    if data.source == "teacher":
        from .teacher import teacher_documents

        for ids in teacher_documents(data, tokenizer):
            yield ",".join(map(str, ids)), ids
        return
    texts = (t for t in iter_documents(data) if t.strip())  # blank documents would only add a separator
    prefix = bos_prefix(tokenizer)
    while chunk := list(islice(texts, _CHUNK)):
        yield from zip(chunk, tokenize_documents(tokenizer, chunk, prefix))


def tokenize_corpus(data: DataConfig, tokenizer, separator: int) -> dict[str, torch.Tensor]:
    """Read, split and tokenize the corpus; documents in each split are put in a seeded random order."""
    fraction, seed = data.held_out_fraction, data.split_seed
    max_docs, max_tokens = data.max_documents, data.max_tokens
    docs: dict[str, list[list[int]]] = {s: [] for s in SPLITS}
    n_tokens = 0
    documents = document_tokens(data, tokenizer)
    if max_docs is not None:
        documents = islice(documents, int(max_docs))
    for key, tokens in documents:  # stops at the first document boundary past max_tokens
        docs["held_out" if is_held_out(key, fraction, seed) else "train"].append(tokens)
        n_tokens += len(tokens) + 1
        if max_tokens is not None and n_tokens >= max_tokens:
            break
    out = {}
    for i, split in enumerate(SPLITS):
        order = torch.randperm(len(docs[split]), generator=torch.Generator().manual_seed(seed + i))
        stream, lengths = concat_documents([docs[split][j] for j in order.tolist()], separator)
        out[split], out[f"{split}_doc_lengths"] = stream, lengths
    return out


def _cache_path(name: str, material: dict) -> Path:
    from ..assets import cache_dir

    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "data" / f"{name}-{key}.safetensors"


def load_or_tokenize(
    data: DataConfig, tokenizer, separator: int, *, cache: bool = True
) -> tuple[dict, Path | None, bool]:
    """The tokenized streams, from the cache when its key matches; returns (tensors, cache path, hit)."""
    material = {
        "format": CACHE_FORMAT,
        "corpus": corpus_fingerprint(data),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "separator": separator,
        "held_out_fraction": data.held_out_fraction,
        "split_seed": data.split_seed,
    }
    if bos_prefix(tokenizer):  # documents start with BOS: only then in the key, so no earlier cache moves
        material["document_prefix"] = bos_prefix(tokenizer)
    path = _cache_path(data.name or data.source, material) if cache else None
    key = json.dumps(material, sort_keys=True)
    if path is not None and path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = (f.metadata() or {}).get("key")
            if stored == key:
                return {k: v.long() for k, v in load_file(path).items()}, path, True
            log.warning("token cache %s was written for another key; tokenizing again", path)
        except Exception as e:  # a damaged cache file is rebuilt, never trusted
            log.warning("token cache %s is unreadable (%s); tokenizing again", path, e)
    tensors = tokenize_corpus(data, tokenizer, separator)
    if path is not None:
        small = {k: (v.int() if k in SPLITS else v) for k, v in tensors.items()}  # ids fit int32: half the disk
        with atomic.atomic_path(path, fsync=False) as tmp:  # no fsync: a damaged cache is rebuilt (above)
            save_file(small, str(tmp), metadata={"key": key})
    return tensors, path, False


@dataclass
class StreamedData:
    """A streamed corpus: held-out rows read once at start; training rows read on the fly (`data.stream`)."""

    name: str
    seq_len: int
    separator_id: int
    held_out: torch.Tensor
    held_out_tail: torch.Tensor
    data: DataConfig
    tokenizer: Any
    held_out_digests: set
    mixture: StreamMixture
    stats: dict = field(default_factory=dict)
    held_out_doc_lengths: torch.Tensor | None = None

    def held_out_documents(self, seq_len: int | None = None) -> torch.Tensor | None:
        stream = torch.cat([self.held_out.reshape(-1), self.held_out_tail])
        return _row_documents(self.held_out_doc_lengths, stream, seq_len or self.seq_len)

    def training_rows(self, seq_len: int, seed: int) -> TrainStream:
        """The stream after the held-out documents, packed into rows of `seq_len`, each window of
        `data.shuffle_rows` rows in an order drawn from `seed` (data.stream)."""
        return TrainStream(
            self.data,
            self.tokenizer,
            self.separator_id,
            seq_len,
            self.held_out_digests,
            seed=seed,
            shuffle_rows=self.data.shuffle_rows,
            mixture=self.mixture,
        )

    def sample_train(self, n: int, seq_len: int, seed: int, *, after_tokens: int = 0) -> torch.Tensor:
        """`n` rows of `seq_len` read in order from the training stream after its first `after_tokens` tokens
        (calibration reads the head of the fine-tuning mix, as in the paper; a later sample passes over the
        earlier ones'). A stream is read in order, so `seed` plays no part here: `after_tokens` does."""
        rows = TrainStream(
            self.data, self.tokenizer, self.separator_id, seq_len, self.held_out_digests, mixture=self.mixture
        )
        rows.skip_tokens(after_tokens)
        return rows.next_rows(n)


def _row_documents(doc_lengths: torch.Tensor | None, stream: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    if doc_lengths is None:
        return None
    return row_documents(doc_lengths, seq_len, stream.numel() // seq_len)


def prepare_stream(data: DataConfig, tokenizer) -> StreamedData:
    name, seq_len = data.name or data.source, data.seq_len
    separator = resolve_separator(data, tokenizer)
    mixture = plan_mixture(data, tokenizer)
    stream, digests, n_docs, doc_lengths, held_out_by_source = read_held_out(data, tokenizer, separator, mixture)
    packed = pack(stream, seq_len)
    if packed.rows.shape[0] == 0:
        raise ValueError(
            f"data.held_out_documents: the first {n_docs} documents of {name!r} hold "
            f"{stream.numel()} tokens, not one held-out row of {seq_len}; hold out more"
        )
    stats = {
        "name": name,
        "source": data.source,
        "streamed": True,
        "seq_len": seq_len,
        "separator_id": separator,
        "documents": {"held_out": n_docs},
        "tokens": {"held_out": int(stream.numel())},
        "rows": {"held_out": int(packed.rows.shape[0])},
        "tokenizer": tokenizer_fingerprint(tokenizer)["name"],
        "document_prefix": bos_prefix(tokenizer),  # [BOS] where the tokenizer adds it (data/tokens.py)
        # intended token shares, the measurement behind the document probabilities, and the held-out
        # documents' own shares; the fine-tune's are in the record's train.data.mixture_read
        "mixture": mixture.describe() | {"held_out": read_shares(held_out_by_source)},
    }
    log.info("data %r (streamed): %d held-out documents, %d rows", name, n_docs, packed.rows.shape[0])
    return StreamedData(
        name=name,
        seq_len=seq_len,
        separator_id=separator,
        held_out=packed.rows,
        held_out_tail=packed.tail,
        data=data,
        tokenizer=tokenizer,
        held_out_digests=digests,
        mixture=mixture,
        stats=stats,
        held_out_doc_lengths=doc_lengths,
    )


def prepare_data(data: DataConfig, tokenizer, *, cache: bool = True) -> PreparedData | StreamedData:
    """Tokenize (or load from cache), split by document and pack the `data` section's corpus for `tokenizer`; a
    hub source is streamed instead (only its held-out documents are read here)."""
    check_data_config(data)
    if data.source == "hub":
        return prepare_stream(data, tokenizer)
    name, seq_len = data.name or data.source, data.seq_len
    separator = resolve_separator(data, tokenizer)
    tensors, path, hit = load_or_tokenize(data, tokenizer, separator, cache=cache)

    packed = {split: pack(tensors[split], seq_len) for split in SPLITS}
    documents = {split: int(tensors[f"{split}_doc_lengths"].numel()) for split in SPLITS}
    for split in SPLITS:
        if documents[split] == 0:
            raise ValueError(
                f"data.held_out_fraction: the {split} split of {name!r} got no documents "
                f"({sum(documents.values())} read, fraction {data.held_out_fraction}); change the fraction or read more"
            )
        if packed[split].rows.shape[0] == 0:
            raise ValueError(
                f"data.seq_len: the {split} split of {name!r} has {tensors[split].numel()} tokens, "
                f"not one full row of {seq_len}"
            )
    stats = {
        "name": name,
        "source": data.source,
        "seq_len": seq_len,
        "separator_id": separator,
        "documents": documents,
        "tokens": {split: int(tensors[split].numel()) for split in SPLITS},  # one separator per document included
        "rows": {split: int(packed[split].rows.shape[0]) for split in SPLITS},
        "tail_tokens": {split: int(packed[split].tail.numel()) for split in SPLITS},
        "tokenizer": tokenizer_fingerprint(tokenizer)["name"],
        "cache": str(path) if path else None,
        "cache_hit": hit,
    }
    if data.source == "teacher":  # what writing the text cost, counted once per set (not per run)
        from .teacher import generation_cost

        stats["generation"] = generation_cost(data)
    log.info("data %r: %s", name, {k: stats[k] for k in ("documents", "tokens", "rows")})
    return PreparedData(
        name=name,
        seq_len=seq_len,
        separator_id=separator,
        train=packed["train"].rows,
        held_out=packed["held_out"].rows,
        train_tail=packed["train"].tail,
        held_out_tail=packed["held_out"].tail,
        stats=stats,
        held_out_doc_lengths=tensors["held_out_doc_lengths"],
    )


def calibration_batches(
    prepared: PreparedData | StreamedData,
    n: int,
    seq_len: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
    *,
    stream_offset: int = 0,
) -> list[torch.Tensor]:
    """`n` sequences of `seq_len` tokens (default: the packing length) from the TRAIN split, in batches;
    the same arguments always give the same batches. A finite corpus draws them with `seed`; a stream reads
    them in order after its first `stream_offset` tokens (the samples of the stages before)."""
    seq_len = seq_len or prepared.seq_len
    if n < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError(f"n, seq_len and batch_size must be positive, got {n}, {seq_len}, {batch_size}")
    if isinstance(prepared, StreamedData):
        return list(prepared.sample_train(n, seq_len, seed, after_tokens=stream_offset).split(batch_size))
    return list(prepared.sample_train(n, seq_len, seed).split(batch_size))
