"""A streamed corpus (data.source: hub) as training rows packed on the fly: fresh tokens at any budget.

The hub mixture (or any `datasets` builder, e.g. `path: json` + `data_files:` for a local file) is read
with `datasets` streaming, documents are tokenized in chunks, followed by the separator and cut into
rows of the training length. Nothing is held in memory beyond one chunk.

Mixture: the configured weights are TOKEN shares (the paper's), but `datasets.interleave_datasets` draws
DOCUMENTS; a part of long documents (open-web-math) would take more than its share and one of short documents
(python-edu) less. `StreamMixture` measures each part's mean document length in tokens (the run's tokenizer,
its first `length_sample_documents` documents) and interleaves with document probabilities proportional to
share / mean length, so `datasets` keeps its own resumable state; the run's data stats carry the measured
means, the probabilities used and the token shares actually read (`TrainStream.tokens_by_source`).

Split: the first `held_out_documents` documents of the stream are the held-out set (read once, at
start); the training rows are everything after them, minus any later document whose text equals a
held-out one, so duplicates cannot leak held-out text into training.

Seed: with `shuffle_rows: N` (data config) the rows are read in windows of N and each window is emitted in
an order drawn from (run seed, window index), so two seeds see different rows at every step; without it the
order is the mixture's alone. Fresh text has no epochs, so this is the whole of what a seed changes in the data.

Resume: `state_dict()` is the dataset's own iteration state (`IterableDataset.state_dict`) plus the
tokens read but not yet emitted as a row (with shuffling: that state at the start of the current window and
the position in it), so a resumed run reads exactly the rows the uninterrupted one would have: the row read
at a step is a pure function of (mixture seed, run seed, step).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import atomic
from ..schema.sections import DataConfig
from .sources import hub_mixture, mixture_parts, part_name, part_stream
from .tokens import bos_prefix, tokenize_documents, tokenizer_fingerprint

log = logging.getLogger(__name__)

_CHUNK = 64  # documents per tokenizer call


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _documents(dataset) -> Iterator[tuple[str, str]]:
    """(source part, text) of each non-blank document."""
    for example in dataset:
        if example["text"].strip():
            yield example["source"], example["text"]


@dataclass(frozen=True)
class StreamMixture:
    """The parts a streamed source reads, each with its token share and the document probability that gives it
    (share / mean document length, normalised); `dropped`: the parts left out by `missing_parts: renormalise`."""

    parts: list[dict]
    token_shares: list[float]
    mean_document_tokens: list[float] | None  # None: one part, nothing to weigh
    documents_measured: list[int] | None
    dropped: list[dict]
    seed: int

    @property
    def names(self) -> list[str]:
        return [part_name(p) for p in self.parts]

    @property
    def probabilities(self) -> list[float] | None:
        if self.mean_document_tokens is None:
            return None
        raw = [share / mean for share, mean in zip(self.token_shares, self.mean_document_tokens)]
        return [x / sum(raw) for x in raw]

    def open(self):
        """A fresh interleaved stream (documents with `text` and `source`)."""
        return hub_mixture(self.parts, seed=self.seed, probabilities=self.probabilities)

    def describe(self, tokens_by_source: dict[str, int] | None = None) -> dict:
        """For the run record: intended token shares, the measurement and the probabilities it gave, what was
        dropped, and (given the tokens read per part) the token shares measured over them."""
        out = {
            "token_shares": dict(zip(self.names, self.token_shares)),
            "dropped": list(self.dropped),
            "mean_document_tokens": dict(zip(self.names, self.mean_document_tokens or [])) or None,
            "documents_measured": dict(zip(self.names, self.documents_measured or [])) or None,
            "document_probabilities": dict(zip(self.names, self.probabilities or [])) or None,
        }
        if tokens_by_source is not None:
            out |= read_shares(tokens_by_source)
        return out


def read_shares(tokens_by_source: dict[str, int]) -> dict:
    total = sum(tokens_by_source.values())
    return {
        "tokens_read": dict(tokens_by_source),
        "token_shares_read": {k: v / total for k, v in tokens_by_source.items()} if total else {},
    }


def plan_mixture(data: DataConfig, tokenizer) -> StreamMixture:
    """The mixture `data` reads with this tokenizer: each part's mean document length measured on its first
    `length_sample_documents` documents, as they land in the stream (BOS, separator included)."""
    kept, dropped = mixture_parts(data)
    if dropped:
        log.warning(
            "data.missing_parts=renormalise: dropped %s; token shares now %s",
            [d["name"] for d in dropped],
            {part_name(p): round(s, 4) for p, s in kept},
        )
    parts, shares = [p for p, _ in kept], [s for _, s in kept]
    means = counted = None
    if len(parts) > 1:
        means, counted = _measured_lengths(parts, data.length_sample_documents, tokenizer)
    mixture = StreamMixture(parts, shares, means, counted, dropped, seed=data.mixture_seed)
    log.info("data mixture: %s", mixture.describe())
    return mixture


def _measured_lengths(parts: list[dict], wanted: int, tokenizer) -> tuple[list[float], list[int]]:
    """Each part's mean document length in tokens over its first `wanted` documents, and how many were read, kept
    on disk (`<cache>/data/mixture-lengths-<key>.json`): the main process prepares the data first and measures, the
    other processes and a relaunch read the file instead of re-reading every part's head (python-edu's from S3)."""
    from ..assets import cache_dir

    prefix = bos_prefix(tokenizer)
    material = {
        "parts": parts,
        "documents": wanted,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "prefix": prefix,
        "local_files": [_file_identity(part) for part in parts],
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir() / "data" / f"mixture-lengths-{key}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return saved["mean_document_tokens"], saved["documents_measured"]
    means, counted = [], []
    for part in parts:
        texts = [t for _, (_, t) in zip(range(wanted), _documents(part_stream(part)))]
        if not texts:
            raise ValueError(f"data.mixture: part {part_name(part)!r} has no documents")
        tokens = sum(
            len(ids) + 1
            for start in range(0, len(texts), _CHUNK)
            for ids in tokenize_documents(tokenizer, texts[start : start + _CHUNK], prefix)
        )
        means.append(tokens / len(texts))
        counted.append(len(texts))
    atomic.write_text(path, json.dumps({"mean_document_tokens": means, "documents_measured": counted}))
    return means, counted


def _file_identity(part: dict) -> list:
    """(path, size, mtime) of a packaged builder's local data files: a file rewritten in place is measured anew."""
    files = part.get("data_files") or []
    files = [files] if isinstance(files, str) else files
    return [
        (f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files if "://" not in f and Path(f).is_file()
    ]


def read_held_out(
    data: DataConfig, tokenizer, separator: int, mixture: StreamMixture | None = None
) -> tuple[torch.Tensor, set[bytes], int, torch.Tensor, dict[str, int]]:
    """The first `held_out_documents` documents as one token stream; their digests; the count read; each
    document's length in the stream (its separator included); the tokens per mixture part."""
    mixture = mixture or plan_mixture(data, tokenizer)
    wanted = int(data.held_out_documents)
    docs, stream, lengths, by_source = [], [], [], {}
    for source, text in _documents(mixture.open()):
        docs.append((source, text))
        if len(docs) == wanted:
            break
    prefix = bos_prefix(tokenizer)
    for start in range(0, len(docs), _CHUNK):
        chunk = docs[start : start + _CHUNK]
        for (source, _), ids in zip(chunk, tokenize_documents(tokenizer, [t for _, t in chunk], prefix)):
            stream.extend(ids)
            stream.append(separator)
            lengths.append(len(ids) + 1)
            by_source[source] = by_source.get(source, 0) + len(ids) + 1
    return (
        torch.tensor(stream, dtype=torch.long),
        {text_digest(t) for _, t in docs},
        len(docs),
        torch.tensor(lengths, dtype=torch.long),
        by_source,
    )


class TrainStream:
    """Training rows `[n, seq_len]` read in order from the stream, skipping the held-out documents."""

    def __init__(
        self,
        data: DataConfig,
        tokenizer,
        separator: int,
        seq_len: int,
        held_out_digests: set[bytes],
        *,
        seed: int = 0,
        shuffle_rows: int = 0,
        mixture: StreamMixture | None = None,
    ):
        self.data, self.tokenizer, self.separator, self.seq_len = data, tokenizer, separator, seq_len
        self.mixture = mixture or plan_mixture(data, tokenizer)
        self.prefix = bos_prefix(tokenizer)
        self.seed, self.shuffle_rows = seed, int(shuffle_rows or 0)
        self.window: torch.Tensor | None = None  # the current window's rows, in their shuffled order
        self.window_pos, self.windows_started, self.window_start = 0, 0, None
        self.skip = held_out_digests
        self.dataset = self.mixture.open()
        self.buffer: list[int] = []
        self.buffer_sources: list[list] = []  # [part, tokens] runs covering `buffer`, in order
        self.tokens_by_source: dict[str, int] = {}  # the tokens of the rows read, per mixture part
        self.rows_read = 0
        self.documents_read = 0
        self._skipped_head = 0  # the held-out documents at the start are passed over once
        self._iterator = None

    def _texts(self) -> Iterator[tuple[str, str]]:
        held_out_head = int(self.data.held_out_documents)
        for source, text in _documents(self.dataset):
            if self._skipped_head < held_out_head:
                self._skipped_head += 1
                continue
            if text_digest(text) in self.skip:
                continue
            yield source, text

    def next_rows(self, n: int) -> torch.Tensor:
        """The next `n` rows; raises when the stream ends first (a finite local file)."""
        if not self.shuffle_rows:
            rows = self._read(n)
        else:
            parts, left = [], n
            while left:
                if self.window is None or self.window_pos == len(self.window):
                    self._next_window()
                take = min(left, len(self.window) - self.window_pos)
                parts.append(self.window[self.window_pos : self.window_pos + take])
                self.window_pos += take
                left -= take
            rows = torch.cat(parts)
        self.rows_read += n
        return rows

    def skip_tokens(self, n: int) -> None:
        """Pass over the next `n` tokens of the stream in order (samples that must not overlap an earlier one)."""
        self._fill(n)
        self._take(n)

    def _next_window(self) -> None:
        self.window_start = self._raw_state()
        rows = self._read(self.shuffle_rows)
        key = hashlib.blake2b(f"{self.seed}:{self.windows_started}".encode(), digest_size=8).digest()
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1))
        self.window, self.window_pos = rows[order], 0
        self.windows_started += 1

    def _read(self, n: int) -> torch.Tensor:
        need = n * self.seq_len
        self._fill(need)
        rows = torch.tensor(self.buffer[:need], dtype=torch.long).view(n, self.seq_len)
        self._take(need)
        return rows

    def _take(self, n: int) -> None:
        """Drop the first `n` buffered tokens, counting them to their parts."""
        del self.buffer[:n]
        while n:
            run = self.buffer_sources[0]
            taken = min(n, run[1])
            self.tokens_by_source[run[0]] = self.tokens_by_source.get(run[0], 0) + taken
            run[1] -= taken
            n -= taken
            if not run[1]:
                self.buffer_sources.pop(0)

    def _fill(self, need: int) -> None:
        if self._iterator is None:
            self._iterator = self._texts()
        while len(self.buffer) < need:
            chunk = [t for _, t in zip(range(_CHUNK), self._iterator)]
            if not chunk:
                raise StreamExhausted(
                    f"data: the stream ended after {self.rows_read} rows of {self.seq_len} tokens "
                    f"({self.documents_read} training documents); the budget asks for more"
                )
            for (source, _), ids in zip(chunk, tokenize_documents(self.tokenizer, [t for _, t in chunk], self.prefix)):
                self.buffer.extend(ids)
                self.buffer.append(self.separator)
                self.buffer_sources.append([source, len(ids) + 1])
            self.documents_read += len(chunk)

    def step_rows(self, step: int, rows_per_step: int) -> torch.Tensor:
        """The rows of global step `step`; a stream is read in order, so steps come one after another."""
        if self.rows_read != step * rows_per_step:
            raise RuntimeError(
                f"stream position {self.rows_read} rows is not the start of step {step} "
                f"({step * rows_per_step} rows): restore its state_dict to resume"
            )
        return self.next_rows(rows_per_step)

    def epochs(self, rows_read: int) -> None:
        return None  # fresh tokens: never a second pass

    def mixture_read(self) -> dict:
        """The tokens of the rows read so far per mixture part (a shuffle window counted whole once started),
        and their shares, against the intended ones in the data stats' `mixture.token_shares`."""
        return read_shares(self.tokens_by_source)

    tokens_available = None  # unbounded

    def _raw_state(self) -> dict:
        return {
            "dataset": self.dataset.state_dict(),
            "buffer": list(self.buffer),
            "buffer_sources": [list(run) for run in self.buffer_sources],
            "tokens_by_source": dict(self.tokens_by_source),
            "documents_read": self.documents_read,
            "skipped_head": self._skipped_head,
            "mixture": self._mixture_identity(),
        }

    def _mixture_identity(self) -> dict:
        return {"parts": self.mixture.names, "document_probabilities": self.mixture.probabilities}

    def _load_raw_state(self, state: dict) -> None:
        # the same position under other probabilities (a part's head changed on the hub, another tokenizer, a
        # part dropped or back) would read other rows than the interrupted run: say so instead
        if state["mixture"] != self._mixture_identity():
            raise RuntimeError(
                f"data: this stream's mixture {self._mixture_identity()} is not the one its "
                f"checkpoint was read with {state['mixture']}; it cannot resume those rows"
            )
        self.dataset.load_state_dict(state["dataset"])
        self.buffer = list(state["buffer"])
        self.buffer_sources = [list(run) for run in state["buffer_sources"]]
        self.tokens_by_source = dict(state["tokens_by_source"])
        self.documents_read, self._skipped_head = state["documents_read"], state["skipped_head"]
        self._iterator = None

    def state_dict(self) -> dict:
        if self.window is None:
            return self._raw_state() | {"rows_read": self.rows_read, "windows_started": self.windows_started}
        return self.window_start | {
            "rows_read": self.rows_read,
            "windows_started": self.windows_started - 1,
            "window_pos": self.window_pos,
            "tokens_by_source": dict(self.tokens_by_source),
        }  # the window counted whole

    def load_state_dict(self, state: dict) -> None:
        self._load_raw_state(state)
        self.rows_read, self.windows_started = state["rows_read"], state.get("windows_started", 0)
        self.window = None
        if "window_pos" in state:  # inside a window: read it again from its start, then go to the position
            self._next_window()
            self.window_pos = state["window_pos"]
            self.tokens_by_source = dict(state["tokens_by_source"])  # not the window twice


class PrefetchedRows:
    """A `TrainStream` read one step ahead in a background thread, so that reading, tokenizing and fetching
    the next global batch overlaps the current step's compute instead of stalling it. Its state is the one
    after the rows handed out (not after the step read ahead), so a checkpoint resumes exactly. Under several
    processes (`read_on_main_process_only`) only the main one reads the stream and sends each step's rows to
    the others, instead of every process reading, tokenizing and fetching the whole global batch."""

    def __init__(self, stream: TrainStream):
        from concurrent.futures import ThreadPoolExecutor

        self.stream = stream
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-prefetch")
        self._ahead = None  # (step, rows_per_step, future of (rows, state after them))
        self._state = stream.state_dict()
        self._shared = None  # (is the main process, the gloo group the rows travel on)

    def read_on_main_process_only(self, is_main: bool, group) -> None:
        self._shared = (is_main, group)

    def _read(self, step: int, rows_per_step: int):
        if self._shared is None:
            rows = self.stream.step_rows(step, rows_per_step)
            return rows, self.stream.state_dict()
        import torch.distributed as td

        is_main, group = self._shared
        payload, state = [None], None
        if is_main:
            try:
                payload = [self.stream.step_rows(step, rows_per_step)]
                state = self.stream.state_dict()  # only the main process writes the checkpoint's progress
            except StreamExhausted as err:
                payload = [err]
        td.broadcast_object_list(payload, src=0, group=group)  # its own group: safe beside the training's
        if isinstance(payload[0], StreamExhausted):
            raise payload[0]
        return payload[0], state

    def step_rows(self, step: int, rows_per_step: int) -> torch.Tensor:
        if self._ahead is not None and self._ahead[:2] == (step, rows_per_step):
            rows, state = self._ahead[2].result()
        else:  # the first step, or a step other than the one read ahead: the stream says if it is out of order
            if self._ahead is not None:
                self._ahead[2].result()
            rows, state = self._read(step, rows_per_step)
        self._state = state
        self._ahead = (step + 1, rows_per_step, self._pool.submit(self._read, step + 1, rows_per_step))
        return rows

    def epochs(self, rows_read: int) -> None:  # the stream's own facts: reading ahead changes none of them
        return self.stream.epochs(rows_read)

    def mixture_read(self) -> dict | None:
        """As TrainStream's, at the state handed out (not the step read ahead); None on a process that only
        receives rows."""
        return read_shares(self._state["tokens_by_source"]) if self._state is not None else None

    @property
    def tokens_available(self) -> None:
        return self.stream.tokens_available

    @property
    def seq_len(self) -> int:
        return self.stream.seq_len

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._ahead is not None:
            self._ahead[2].exception()  # let the read ahead finish before the stream is moved under it
            self._ahead = None
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()


class StreamExhausted(RuntimeError):
    """A finite stream ran out before the token budget was read."""
