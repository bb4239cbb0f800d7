"""Per-document results: lm-eval's logged samples reduced to one row per (task, doc), written into the
run directory as gzipped JSON lines (`eval_samples.jsonl.gz`), so that two models can be compared on
the same documents (paired statistics, `mha2mla_exp.aggregate.paired`).

A row: `suite`, `column` (the record's score it feeds, e.g. `arc_easy`; `mmlu` for every MMLU subject),
`task` (lm-eval's leaf task), `doc_id` (index in the task's evaluation split), `doc_hash` (lm-eval's hash
of the document, so a pairing can check it compares the same text), `target` (lm-eval's), lm-eval's
per-doc metrics (`acc`, `acc_norm`, ...), and the raw outputs: for multiple choice `gold` (the correct
choice's index), `ll` (log-likelihood per choice), `is_greedy`, `pred` (argmax ll) and `pred_norm`
(argmax ll / characters, lm-eval's acc_norm rule); for generation `response`; for rolling
log-likelihood `ll`.

This module imports neither torch nor lm-eval, so the aggregation can read the files cheaply.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable
from pathlib import Path

from ..atomic import atomic_path

SAMPLES_FILE = "eval_samples.jsonl.gz"


def _plain(value):
    """JSON-able copies of lm-eval's values (numpy scalars, tuples)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


def _argmax(values) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first maximum, as numpy.argmax


def _gold_index(task, doc, choices):
    """The correct choice's index, as lm-eval's multiple-choice scoring finds it (Winogrande-style tasks
    with several contexts give it as doc_to_text; a target string is looked up among the choices)."""
    gold = task.doc_to_text(doc) if getattr(task, "multiple_input", False) else task.doc_to_target(doc)
    if isinstance(gold, str):
        return choices.index(gold) if gold in choices else None
    return _plain(gold)


def rows_from_lm_eval(task_name: str, task, logged: Iterable[dict]) -> list[dict]:
    """lm-eval's `log_samples` entries of one task -> compact rows (see the module docstring)."""
    output_type = getattr(task, "OUTPUT_TYPE", None)
    rows = []
    for sample in logged:
        row = {
            "task": task_name,
            "doc_id": int(sample["doc_id"]),
            "doc_hash": sample.get("doc_hash"),
            "target": _plain(sample.get("target")),
        }
        for metric in sample.get("metrics", []):
            row[metric] = _plain(sample.get(metric))
        resps = sample.get("filtered_resps", [])
        if output_type == "multiple_choice":
            lls = [float(r[0]) for r in resps]
            choices = task.doc_to_choice(sample["doc"])
            row.update(
                gold=_gold_index(task, sample["doc"], choices),
                ll=lls,
                is_greedy=[bool(r[1]) for r in resps],
                pred=_argmax(lls),
                pred_norm=_argmax([ll / len(c) for ll, c in zip(lls, choices)]),
            )
        elif output_type == "generate_until":
            row["response"] = resps[0] if len(resps) == 1 else _plain(resps)
        elif output_type in ("loglikelihood", "loglikelihood_rolling"):
            first = resps[0] if resps else None
            row["ll"] = float(first[0] if isinstance(first, (list, tuple)) else first)
        rows.append(row)
    return rows


def write_samples(rows: list[dict], path: str | Path) -> Path:
    """Write `rows` as gzipped JSON lines at `path`, atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        # mtime=0: the same rows give the same bytes
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, io.TextIOWrapper(gz, encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, allow_nan=True) + "\n")
    return path


def read_samples(path: str | Path) -> list[dict]:
    """The rows of a per-document file (`write_samples`), in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def samples_frame(path: str | Path):
    """The rows as a pandas DataFrame (one row per document)."""
    import pandas as pd

    return pd.DataFrame.from_records(read_samples(path))


def summary(rows: list[dict]) -> dict:
    """What the run record says about the file: its name and rows per suite."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.get("suite", "?")] = counts.get(row.get("suite", "?"), 0) + 1
    return {"file": SAMPLES_FILE, "rows": len(rows), "rows_per_suite": counts}
