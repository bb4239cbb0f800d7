"""Offline long-context suite over real long text (the SOTU speeches by default), as lm-eval tasks.

- passkey@L: a 5-digit pass key (after Mohtashami & Jaggi, 2023) hidden at several depths
  of real text; prompt + answer fit in L tokens; greedy; score 1 when the first number generated
  is the key. A generation task, so it runs on the (quantized) KV cache being evaluated.
- long-document perplexity @L: the first L-1 tokens of the most recent speeches, scored in one
  window (lm-eval's loglikelihood_rolling), reported as token perplexity. These speeches may sit in
  a SOTU fine-tuning split: compare only models fine-tuned on the same data (the record names them).

Docs are built with the evaluated model's tokenizer (lengths are in its tokens), written as jsonl
next to generated task YAMLs, and are a pure function of (tokenizer, texts, config).
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

from ..schema.sections import LongContextConfig
from .tasks import Function, run_tasks, write_task_folder

PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. The pass key is {key}."
QUESTION = "\n\nWhat is the pass key? The pass key is"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def check(cfg: LongContextConfig) -> None:
    """Fail before any model work: what the schema's per-field ranges cannot say of the lists and their lengths."""
    if any(not 0.0 <= d <= 1.0 for d in cfg.depths):
        raise ValueError(f"passkey depths must lie in [0, 1], got {cfg.depths}")
    if any(L <= cfg.max_gen_toks for L in cfg.lengths) or any(L < 16 for L in cfg.ppl_lengths):
        raise ValueError(f"long-context lengths too short: {cfg.lengths} / {cfg.ppl_lengths}")


def longest(cfg: LongContextConfig) -> int:
    """The longest sequence the suite scores (a passkey prompt or a perplexity document): it must fit the window."""
    return max((*cfg.lengths, *cfg.ppl_lengths), default=0)


def load_texts(paths=None) -> list[tuple[str, str]]:
    """(name, text) of the haystack documents, in a fixed (sorted) order."""
    if paths is None:
        from ..assets import asset_documents

        files = asset_documents("sotu")
    else:
        files = sorted(Path(p) for p in paths)
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing or not files:
        raise FileNotFoundError(f"long-context texts not found: {missing or 'none given'}")
    return [(Path(f).stem, Path(f).read_text(encoding="utf-8", errors="replace").strip()) for f in files]


class _Haystack:
    """Token streams of the documents, tokenized lazily (the full corpus is never tokenized)."""

    def __init__(self, tokenizer, texts):
        self.tok, self.texts, self._ids = tokenizer, texts, {}

    def ids(self, i: int) -> list[int]:
        if i not in self._ids:
            self._ids[i] = self.tok(self.texts[i][1] + "\n\n", add_special_tokens=False).input_ids
        return self._ids[i]

    def filler(self, start: int, n_tokens: int) -> str:
        """About `n_tokens` tokens of text from document `start` on (wrapping), ending on a sentence."""
        ids, i = [], start
        while len(ids) < n_tokens:
            ids += self.ids(i % len(self.texts))
            i += 1
            if i - start > len(self.texts):
                raise ValueError("the long-context texts are too short for the requested length")
        text = self.tok.decode(ids[:n_tokens], skip_special_tokens=True)
        cut = max(text.rfind(". "), text.rfind(".\n"))  # end on a sentence if one ends near the end,
        if cut < 0.9 * len(text):  # else on a word
            cut = text.rfind(" ") - 1
        return text[: cut + 1]


def _insert(filler: str, needle: str, depth: float) -> str:
    """Put `needle` at the sentence boundary nearest to `depth` (0: start, 1: end) of `filler`."""
    bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(filler)] + [len(filler)]
    target = depth * len(filler)
    pos = min(bounds, key=lambda b: abs(b - target))
    head, tail = filler[:pos].rstrip(), filler[pos:].lstrip()
    return " ".join(part for part in (head, needle, tail) if part)


def passkey_docs(tokenizer, texts, length: int, cfg: LongContextConfig) -> list[dict]:
    """The passkey docs at one length: `samples_per_depth` per depth, each fitting `length` tokens."""
    hay = _Haystack(tokenizer, texts)
    limit = length - cfg.max_gen_toks  # the prompt's token budget (BOS included)
    fixed = len(tokenizer(PREFIX + NEEDLE.format(key=12345) + QUESTION).input_ids)
    if limit - fixed < 32:
        raise ValueError(f"passkey length {length} is too short for the prompt ({fixed} tokens) and the answer")
    docs = []
    for depth in cfg.depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"passkey depth {depth} is outside [0, 1]")
        for i in range(cfg.samples_per_depth):
            rng = random.Random(f"passkey:{cfg.seed}:{length}:{depth}:{i}")  # str seeds are stable
            key = str(rng.randint(10000, 99999))
            start = rng.randrange(len(texts))
            budget = limit - fixed - 2
            for _ in range(8):  # decode/re-encode may shift a few tokens: shrink until it fits
                prompt = PREFIX + _insert(hay.filler(start, budget), NEEDLE.format(key=key), depth) + QUESTION
                n = len(tokenizer(prompt).input_ids)
                if n <= limit:
                    break
                budget -= n - limit + 2
            else:
                raise RuntimeError(f"could not fit a passkey prompt into {limit} tokens")
            docs.append(
                {
                    "input": prompt,
                    "answer": key,
                    "length": length,
                    "depth": depth,
                    "n_tokens": n,
                    "source": texts[start][0],
                }
            )
    return docs


def ppl_docs(tokenizer, texts, length: int, n_docs: int) -> list[dict]:
    """The first `length - 1` tokens of the `n_docs` most recent documents that are long enough
    (one more position for lm-eval's prefix token makes `length`)."""
    docs = []
    for name, text in sorted(texts, key=lambda t: t[0], reverse=True):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < length:
            continue
        chunk = tokenizer.decode(ids[: length - 1 - 4], skip_special_tokens=True)  # slack for re-encoding
        n = len(tokenizer.encode(chunk))  # exactly the tokens HFLM's rolling loglikelihood scores
        if n > length - 1:
            continue
        docs.append({"text": chunk, "n_tokens": n, "length": length, "source": name})
        if len(docs) == n_docs:
            return docs
    raise ValueError(f"only {len(docs)} documents have {length} tokens; {n_docs} were asked for")


# ---- lm-eval hooks (referenced as !function from the generated YAMLs)
_NUMBER = re.compile(r"\d+")


def passkey_process_results(doc, results):
    found = _NUMBER.search(results[0])
    return {"acc": float(found is not None and found.group(0) == doc["answer"])}


def ppl_process_results(doc, results):
    ll = results[0][0] if isinstance(results[0], (tuple, list)) else results[0]
    return {"token_perplexity": (float(ll), int(doc["n_tokens"]))}


def token_perplexity(items) -> float:
    ll = sum(x for x, _ in items)
    n = sum(n for _, n in items)
    return math.exp(-ll / n)


def _jsonl(docs) -> str:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def task_folder(tokenizer, cfg: LongContextConfig, texts=None) -> tuple[Path, dict[int, str], dict[int, str]]:
    """Write docs + task YAMLs; returns (folder, {length: passkey task}, {length: ppl task})."""
    texts = texts if texts is not None else load_texts(cfg.texts)
    fp = f"{type(tokenizer).__name__}-{len(tokenizer)}"
    files, extra, passkey, ppl = {}, {}, {}, {}
    for length in cfg.lengths:
        name = f"passkey_L{length}"
        extra[f"{name}.jsonl"] = _jsonl(passkey_docs(tokenizer, texts, length, cfg))
        passkey[length] = name
        files[f"{name}.yaml"] = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": f"__DIR__/{name}.jsonl"}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{input}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": cfg.max_gen_toks, "do_sample": False},
            "process_results": Function(f"{__name__}.passkey_process_results"),
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1, "tokenizer": fp},
        }
    for length in cfg.ppl_lengths:
        name = f"longdoc_ppl_L{length}"
        extra[f"{name}.jsonl"] = _jsonl(ppl_docs(tokenizer, texts, length, cfg.ppl_docs))
        ppl[length] = name
        files[f"{name}.yaml"] = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": f"__DIR__/{name}.jsonl"}},
            "test_split": "test",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "process_results": Function(f"{__name__}.ppl_process_results"),
            "metric_list": [
                {
                    "metric": "token_perplexity",
                    "higher_is_better": False,
                    "aggregation": Function(f"{__name__}.token_perplexity"),
                }
            ],
            "metadata": {"version": 1, "tokenizer": fp},
        }
    return write_task_folder("long_context", files, extra), passkey, ppl


def evaluate_long_context(
    lm, tokenizer, cfg: LongContextConfig, *, window: int | None = None, texts=None
) -> tuple[dict, dict, dict, list[dict]] | None:
    """Returns (long_context scores: passkey@L and avg, perplexities: longdoc@L, metadata, per-document rows);
    None on a rank other than 0 of a multi-process evaluation."""
    window = window or lm.max_length
    check(cfg)
    if longest(cfg) > window:
        raise ValueError(f"long-context length {longest(cfg)} exceeds the evaluation window {window}")
    folder, passkey, ppl = task_folder(tokenizer, cfg, texts)
    run = run_tasks(lm, [*passkey.values(), *ppl.values()], include_path=folder, include_defaults=False)
    if run is None:  # another rank of a multi-process evaluation: rank 0 holds the results
        return None
    scores = {f"passkey@{L}": run.metrics[t]["acc"] for L, t in passkey.items()}
    if scores:
        scores["avg"] = sum(scores.values()) / len(scores)
    perplexities = {f"longdoc@{L}": run.metrics[t]["token_perplexity"] for L, t in ppl.items()}
    by_depth = {}
    for L, t in passkey.items():
        cells: dict[float, list[float]] = {}
        for s in run.samples.get(t, []):
            cells.setdefault(s["doc"]["depth"], []).append(s["acc"])
        by_depth[f"passkey@{L}"] = {str(d): sum(v) / len(v) for d, v in sorted(cells.items())}
    meta = {
        "lengths": list(cfg.lengths),
        "depths": list(cfg.depths),
        "samples_per_depth": cfg.samples_per_depth,
        "seed": cfg.seed,
        "by_depth": by_depth,
        "ppl_lengths": list(cfg.ppl_lengths),
        "ppl_docs": cfg.ppl_docs,
        "texts": "sotu asset" if cfg.texts is None else list(cfg.texts),
        "task_dir": str(folder),
        "ppl_sources": sorted({s["doc"]["source"] for t in ppl.values() for s in run.samples.get(t, [])}),
    }
    column_of = {t: f"passkey@{L}" for L, t in passkey.items()} | {t: f"longdoc@{L}" for L, t in ppl.items()}
    rows = [{"suite": "long_context", "column": column_of[row["task"]], **row} for row in run.rows]
    return scores, perplexities, meta, rows
