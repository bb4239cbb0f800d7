"""Comparisons the paper's tables do not hold, made from the same rows and statistics (`tables`, `paired`):

- `pairwise(runs, experiment, suite)`: every pair of one experiment's rows scored on the same docs, each
  difference with its paired 95% interval;
- `dtype_check(runs)`: one model on the same docs evaluated in two dtypes: how many per-document answers
  agree, and the paired difference of the scores (what bf16 evaluation changes).
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from ..schema.commonsense_suite import paper_columns
from . import paired
from .records import METHODS, ROW_KEYS
from .render import eval_docs_label, row_label
from .tables import TableSpec, _key, _samples, delta, row_cells, rows_of_ours

_ALL = {
    suite: TableSpec(suite, lambda frame: pd.Series(True, index=frame.index), "avg")
    for suite in ("commonsense", "long_context")
}


def _ok(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "ok"] if len(runs) else runs


def _label(row) -> str:
    key = row.key
    if key["method"] == "original":
        return row_label(key)
    return f"{row_label(key)} @ {int(key['train_tokens'] or 0):,} tokens"


def pairwise(runs: pd.DataFrame, experiment: str, suite: str = "commonsense") -> pd.DataFrame:
    """Every pair (A, B) of `experiment`'s rows on the same docs and dtype: B - A with its 95% interval."""
    ours = _ok(runs)
    ours = ours[ours["experiment"] == experiment] if len(ours) else ours
    rows = rows_of_ours(_ALL[suite], ours) if len(ours) else []
    rows = sorted(
        (r for r in rows if "avg" in r.scores),
        key=lambda r: (METHODS.index(r.key["method"]) if r.key["method"] in METHODS else 9, r.key["train_tokens"] or 0),
    )
    records = []
    for a, b in itertools.combinations(rows, 2):
        if not same_docs(a, b):
            continue
        diff = delta(b, a)
        tasks = paper_columns() if suite == "commonsense" else list(b.spec.metric)
        cells = row_cells(b, diff, _ALL[suite].score, tasks)
        records.append(
            {
                "B": _label(b),
                "A": _label(a),
                "eval docs": eval_docs_label(b.runs[0]),
                "A avg": a.scores["avg"],
                "B recovery text ppl": _recovery_text_ppl(b),
            }
            | cells
            | {"verdict": _verdict(diff.get("avg"))}
        )
    return pd.DataFrame.from_records(records)


def same_docs(a, b) -> bool:
    """Two rows scored on the same documents in the same dtype: the only rows that are ever paired."""
    return (a.key["eval_sample"], a.key["eval_dtype"]) == (b.key["eval_sample"], b.key["eval_dtype"])


def _recovery_text_ppl(row) -> float | None:
    """The held-out perplexity of a row's model on the text it recovered on, where that is not the corpus (the
    teacher's samples); the mean over seeds."""
    values = [float(r["train_data_heldout_ppl"]) for r in row.runs if not pd.isna(r.get("train_data_heldout_ppl"))]
    return float(np.mean(values)) if values else None


def _verdict(interval: paired.Interval | None) -> str | None:
    if interval is None or interval.resolved is None:
        return None
    return "not resolved" if not interval.resolved else ("B higher" if interval.estimate > 0 else "B lower")


def dtype_check(runs: pd.DataFrame) -> pd.DataFrame:
    """Rows that differ only in their evaluation dtype, with per-document results: per column, how many
    scored answers agree, and the paired difference of the scores (other dtype - FP32)."""
    ours = _ok(runs)
    spec = paired.commonsense_spec()
    rows = [r for r in (rows_of_ours(_ALL["commonsense"], ours) if len(ours) else []) if r.values is not None]
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(_key(row.key, [k for k in ROW_KEYS if k != "eval_dtype"]), []).append(row)
    records = []
    for members in groups.values():
        reference = next((r for r in members if r.key["eval_dtype"] == "FP32"), None)
        for other in members:
            if reference is None or other is reference:
                continue
            frames = [_samples(r.runs[0]["samples_file"]) for r in (reference, other)]
            agree = paired.answer_agreement(*frames, spec)
            diff = delta(other, reference)
            record = {
                "model": _label(other),
                "eval docs": eval_docs_label(other.runs[0]).split(" · ")[0],
                "reference": "FP32",
                "dtype": other.key["eval_dtype"],
                "same answers": agree["all"][0],
                "docs": agree["all"][1],
                "same answers %": 100 * agree["all"][0] / agree["all"][1],
            }
            for column, (same, n) in agree.items():
                if column != "all":
                    record[f"{column} same %"] = 100 * same / n
            record |= {"avg FP32": reference.scores["avg"], "avg": other.scores["avg"]}
            record |= {
                k: v for k, v in row_cells(other, diff, "avg", paper_columns()).items() if k.startswith("avg_delta")
            }
            records.append(record)
    return pd.DataFrame.from_records(records)
