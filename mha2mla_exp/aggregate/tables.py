"""Tables of the paper's kind (its Tables 1, 2, 3 and 5: `kinds.PaperTable` entries of the catalog), our runs
beside its numbers, every number of ours with its uncertainty. A `TableSpec` says which rows a table holds.

A row of ours is one (configuration, budget, evaluation sample) triple (`records.ROW_KEYS`): fine-tune
tokens and the documents scored are columns, so runs that differ in either are never merged. Runs that
differ only in their seed are one row: the mean over seeds, their spread, and each seed counted once.

Every row is compared with its baseline on the same documents:
- by default (Tables 1, 3, 5): a converted model against the full-attention model fine-tuned on the same tokens
  (the original model when neither was fine-tuned); the full-attention fine-tune against the original;
- `by_precision` (Table 2): every row against the original model with an unquantized cache (the paper's
  convention).
The baseline must share the model, data, evaluation sample and evaluation dtype; otherwise there is no
delta. With per-document results on both sides the interval is a paired bootstrap (`paired.py`); without,
an unpaired binomial one, marked so. A delta whose 95% interval contains 0 is "not resolved".
The paper's deltas are computed by the same rule from its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pandas as pd

from ..schema.commonsense_suite import paper_columns
from . import paired
from .records import METHODS, PAPER_HEAD_DIM, ROW_KEYS, UNQUANTIZED
from .reference import paper_commonsense, paper_longbench

UNCONVERTED = ("original", "finetuned_full_attention")
KV_QUANT_ORDER = (UNQUANTIZED, "Int4 HQQ", "Int4 Quanto", "Int2 HQQ", "Int2 Quanto")
NOT_RESOLVED = "not resolved"


@dataclass(frozen=True)
class TableSpec:
    """Which rows (ours and the paper's) a table of the paper's kind holds, and how our rows are scored."""

    suite: str  # commonsense | long_context: where our score comes from
    select: Callable[[pd.DataFrame], pd.Series]  # rows (ours and the paper's) that belong to the table
    paper_score: str  # the paper's headline column: avg | longbench.avg
    paper_tasks: tuple[str, ...] | None = None  # the paper's task columns (None: the commonsense suite's)
    paper_table: int | None = None  # the paper's table whose rows stand beside ours (None: none)
    by_precision: bool = False  # rows per KV quantization; baseline the unquantized original
    with_kv_memory: bool = False
    extras: dict[str, str] = field(default_factory=dict)  # canonical column -> table column: ours, mean over
    #                                                       seeds, no interval (a row may have only these)

    @property
    def score(self) -> str:
        return "avg" if self.suite == "commonsense" else "long_context.avg"

    @property
    def tasks(self) -> tuple[str, ...]:
        """The paper's task columns, the suite's read when the table is built."""
        return paper_columns() if self.paper_tasks is None else self.paper_tasks


# ---------------------------------------------------------------- which rows belong where
def _head_dim(frame: pd.DataFrame) -> pd.Series:
    known = frame["model"].map(PAPER_HEAD_DIM)
    if "head_dim" in frame:
        known = frame["head_dim"].astype("Float64").fillna(known.astype("Float64"))
    return known.astype("Float64")


def _equals_or_unknown(values: pd.Series, expected: pd.Series) -> pd.Series:
    """values == expected, and True where expected is unknown (a model whose head dim nobody recorded)."""
    return (expected.isna() | (values.astype("Float64") == expected)).fillna(False).astype(bool)


def _default_r(frame):
    return _equals_or_unknown(frame["r"], _head_dim(frame) / 16)  # paper default r = d_h/16


def _unquantized(frame):
    return frame["kv_quant"] == UNQUANTIZED


def _table1_mla(frame):
    return (
        (frame["method"] == "partial_rope+svd")
        & (frame["rope"] == "2-norm")
        & (frame["svd"] == "joint")
        & _default_r(frame)
    )


def select_table1(frame):
    return _unquantized(frame) & (frame["method"].isin(UNCONVERTED) | _table1_mla(frame))


def select_table2(frame):
    return frame["method"].isin(UNCONVERTED) | _table1_mla(frame)


def select_table3(frame):
    # Table 3 fixes r = d_h/16 and, for the SVD rows, d_kv = d_h/4 (16 for SmolLM)
    partial = (frame["method"] == "partial_rope") & _default_r(frame)
    low_rank = (
        (frame["method"] == "partial_rope+svd")
        & _default_r(frame)
        & _equals_or_unknown(frame["d_kv"], _head_dim(frame) / 4)
    )
    return _unquantized(frame) & (frame["method"].isin(UNCONVERTED) | partial | low_rank)


def select_table5(frame):
    return _unquantized(frame) & frame["method"].isin(UNCONVERTED + ("partial_rope",))


# ---------------------------------------------------------------- rows of ours
def _text(value) -> str:
    return "" if _missing(value) else str(value)


def _key(row: dict, columns) -> tuple:
    return tuple(_text(row.get(c)) for c in columns)


def seeds_once(records: list[dict], columns) -> dict[tuple, list[dict]]:
    """Records grouped by their values in `columns` and their setting (the run identity but the seed), each seed
    once: runs of one setting and seed are one measurement (the same run again in another experiment), the first
    in the given order stands for it. The key is the `columns` values, then the setting."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        group = groups.setdefault(_key(record, tuple(columns) + ("setting",)), [])
        if _text(record.get("seed")) not in {_text(r.get("seed")) for r in group}:
            group.append(record)
    return groups


@lru_cache(maxsize=256)
def _samples(path: str) -> pd.DataFrame:
    from ..evaluation.samples import samples_frame

    return samples_frame(path)


def _passkey_columns(columns) -> list[str]:
    lengths = sorted(
        {c for c in columns if c.startswith("long_context.passkey@")}, key=lambda c: int(c.rsplit("@", 1)[1])
    )
    return [c.removeprefix("long_context.") for c in lengths]


def _score_spec(spec: TableSpec, runs: pd.DataFrame) -> paired.ScoreSpec:
    """The table's score columns (for the long-context suite: every length any run has)."""
    if spec.suite == "commonsense":
        return paired.commonsense_spec()
    return paired.mean_spec(_passkey_columns(runs.columns))


def _row_spec(spec: TableSpec, record: dict) -> paired.ScoreSpec:
    """One row's score: the long-context Avg is the mean over the lengths that row was evaluated at."""
    if spec.suite == "commonsense":
        return paired.commonsense_spec()
    return paired.mean_spec(_passkey_columns(k for k, v in record.items() if not _missing(v)))


def _missing(value) -> bool:
    return value is None or (not isinstance(value, (list, dict, str)) and pd.isna(value))


def _ours_column(spec: TableSpec, name: str) -> str:
    """The canonical-frame column of a score column (`avg`, `mmlu`, `passkey@1024`)."""
    if spec.suite == "commonsense":
        return name
    return f"long_context.{name}"


@dataclass
class Row:
    key: dict
    runs: list[dict]  # one per seed
    scores: dict[str, float] = field(default_factory=dict)  # points, mean over seeds
    intervals: dict[str, paired.Interval] = field(default_factory=dict)  # of the scores, points
    values: pd.DataFrame | None = None  # per-document values (seed means), fractions
    se: dict[str, float] = field(default_factory=dict)  # binomial, fractions
    spec: paired.ScoreSpec | None = None  # how its per-document values make its scores

    @property
    def seeds(self) -> list:
        return [r.get("seed") for r in self.runs]


def rows_of_ours(spec: TableSpec, ours: pd.DataFrame) -> list[Row]:
    """Our runs as rows: one per (configuration, budget, eval sample), seeds counted once, with scores and
    their intervals."""
    sample = ours[f"eval_sample_{spec.suite}"]
    for extra in spec.extras:  # a row scored only on an extra (LongBench) is keyed by that suite's docs
        sample = sample.fillna(ours[f"eval_sample_{extra.split('.')[0]}"])
    ours = ours.assign(eval_sample=sample)
    scored = ours[spec.score].notna()
    for extra in spec.extras:
        scored |= ours[extra].notna()
    ours = ours[ours["eval_sample"].notna() & scored]
    records = (
        ours.assign(_has_samples=ours["samples_file"].notna())
        .sort_values(["_has_samples", "run_dir"], ascending=[False, True])
        .to_dict("records")
    )
    rows = {
        key: Row(key={c: runs[0].get(c) for c in ROW_KEYS}, runs=runs)
        for key, runs in seeds_once(records, ROW_KEYS).items()
    }
    for row in rows.values():
        score_spec = row.spec = _row_spec(spec, row.runs[0])
        columns = {name: _ours_column(spec, name) for name in score_spec.reported}
        columns |= {v: k for k, v in spec.extras.items()}
        for name, column in columns.items():
            values = [r.get(column) for r in row.runs]
            values = [float(v) for v in values if v is not None and not pd.isna(v)]
            if len(values) == len(row.runs):
                row.scores[name] = float(np.mean(values))
        if "avg" not in row.scores:
            continue
        if all(isinstance(r.get("samples_file"), str) for r in row.runs):  # NaN where a frame has none
            frames = [_samples(r["samples_file"]) for r in row.runs]
            row.values = paired.doc_values([f[f["suite"] == spec.suite] for f in frames], score_spec)
            row.intervals = {k: _points(v) for k, v in paired.bootstrap_scores(row.values, score_spec).items()}
        else:
            fractions = {c: row.scores[c] / 100 for c in score_spec.metric if c in row.scores}
            row.se = paired.binomial_se(fractions, row.runs[0].get("eval_docs") or {}, score_spec)
            row.intervals = {k: _points(paired.binomial_interval(row.scores[k] / 100, se)) for k, se in row.se.items()}
    return list(rows.values())


def _points(interval: paired.Interval) -> paired.Interval:
    return paired.Interval(100 * interval.estimate, 100 * interval.low, 100 * interval.high, interval.kind)


def _baseline_key(key: dict, spec: TableSpec) -> dict | None:
    """The row key of `key`'s baseline (see the module docstring), or None for a row that has none."""
    original = {
        "method": "original",
        "rope": "full",
        "r": None,
        "svd": "none",
        "d_kv": None,
        "options": None,
        "distill_token_passes": None,
        "kv_quant": UNQUANTIZED,
        "kv_grouping": None,
        "train_tokens": 0,
        "objective": None,
        "trainable": None,
        "lr": None,
        "warmup": None,
        "precision": None,
    }
    if spec.by_precision:
        if key["method"] == "original" and key["kv_quant"] == UNQUANTIZED:
            return None
        return key | original
    if key["method"] == "original":
        return None
    if key["method"] == "finetuned_full_attention" or not key["train_tokens"]:
        return key | original
    # the full-attention fine-tune of the same budget and recovery recipe
    recipe = {k: key.get(k) for k in ("objective", "trainable", "lr", "warmup", "precision")}
    return key | original | recipe | {"method": "finetuned_full_attention", "train_tokens": key["train_tokens"]}


def _describe_baseline(key: dict) -> str:
    name = {"original": "original", "finetuned_full_attention": "FT full attention"}.get(key["method"], key["method"])
    return f"{name} @ {int(key['train_tokens']):,}" if key["train_tokens"] else name


def delta(row: Row, base: Row) -> dict[str, paired.Interval]:
    """Row minus baseline, every reported column, in points: paired when both have per-document results on
    the same docs, unpaired binomial when neither or one has them; empty when their docs differ."""
    score_spec = row.spec
    if score_spec is None or score_spec != base.spec:
        return {}
    if row.values is not None and base.values is not None:
        if not paired.same_documents(row.values, base.values):
            return {}
        return contrast([row], [base])
    ses = (row.se or _se_from_intervals(row), base.se or _se_from_intervals(base))
    out = {}
    for name in score_spec.reported:
        if name not in row.scores or name not in base.scores:
            continue
        if name in ses[0] and name in ses[1]:
            out[name] = _points(
                paired.unpaired_difference(row.scores[name] / 100, ses[0][name], base.scores[name] / 100, ses[1][name])
            )
        else:  # a record without doc counts (e.g. from W&B): the difference, but no interval
            out[name] = paired.Interval(row.scores[name] - base.scores[name], np.nan, np.nan, "none")
    return out


def contrast(plus: list[Row], minus: list[Row]) -> dict[str, paired.Interval]:
    """The sum of `plus` minus the sum of `minus`, every reported column, in points, paired on their common
    documents (all rows must have per-document results on the same docs). An interaction, (a1 - a0) - (b1 - b0):
    `contrast([a1, b0], [a0, b1])`."""
    return {
        k: _points(v)
        for k, v in paired.paired_contrast([r.values for r in plus], [r.values for r in minus], plus[0].spec).items()
    }


def _se_from_intervals(row: Row) -> dict[str, float]:
    """A bootstrap interval read as a normal one (for an unpaired comparison with a run without per-doc results)."""
    return {k: (v.high - v.low) / 2 / paired.Z95 / 100 for k, v in row.intervals.items()}


# ---------------------------------------------------------------- the table
def _paper_key(row: dict) -> tuple:
    """What a row of ours shares with its paper row: the configuration, not the budget or the docs (nor our
    conversion options); the unconverted model has no RoPE/SVD settings (Table 5 prints r=32 on it)."""
    if row.get("method") in UNCONVERTED:
        return _key(row, ("model", "method", "kv_quant"))
    return _key(row, ("model", "method", "rope", "r", "svd", "d_kv", "kv_quant"))


def _paper_deltas(paper: pd.DataFrame, all_paper: pd.DataFrame, spec: TableSpec) -> pd.Series:
    """The paper's delta by the same baseline rule, the baselines looked up among all its rows of the model."""
    lookup = {}
    for record in all_paper.to_dict("records"):
        lookup.setdefault(_paper_key(record), record.get(spec.paper_score))
    out = []
    for record in paper.to_dict("records"):
        base_key = _baseline_key({c: record.get(c) for c in ROW_KEYS} | {"train_tokens": 1}, spec)
        base = None if base_key is None else lookup.get(_paper_key(base_key))
        value = record.get(spec.paper_score)
        out.append(np.nan if base is None or pd.isna(base) or pd.isna(value) else value - base)
    return pd.Series(out, index=paper.index, dtype=float)


def _verdict(row: Row, base_key: dict | None, base: Row | None, delta: dict) -> str | None:
    if "avg" not in row.scores:
        return None  # scored on an extra only (e.g. LongBench): no interval, no verdict
    if base_key is None:
        return "reference"
    if base is None:
        return "no baseline"
    if "avg" not in delta:
        return "no baseline: other docs"
    if delta["avg"].resolved is None:
        return "no interval"
    if not delta["avg"].resolved:
        return NOT_RESOLVED
    return "higher" if delta["avg"].estimate > 0 else "lower"


def build_table(spec: TableSpec, runs: pd.DataFrame, paper: pd.DataFrame, all_paper: pd.DataFrame) -> pd.DataFrame:
    """One table (the full frame written as CSV; `render` makes the compact views)."""
    ours = runs[runs["status"] == "ok"] if len(runs) else runs
    if len(ours) and "distill_token_passes" in ours:
        # the paper's tables hold the paper's recipe; distilled runs are in the perplexity view and recovery plot
        ours = ours[ours["distill_token_passes"].isna()]
    ours = ours[spec.select(ours)] if len(ours) else ours
    score_spec = _score_spec(spec, runs if len(runs) else pd.DataFrame())
    rows = rows_of_ours(spec, ours) if len(ours) else []
    by_key: dict[tuple, list[Row]] = {}
    for r in rows:
        by_key.setdefault(_key(r.key, ROW_KEYS), []).append(r)

    paper = paper[spec.select(paper)].copy() if len(paper) else paper
    paper["avg_delta_paper"] = _paper_deltas(paper, all_paper, spec)
    paper_by_key = {}
    for record in paper.to_dict("records"):
        paper_by_key.setdefault(_paper_key(record), record)

    records, matched = [], set()
    for row in rows:
        base_key = _baseline_key(row.key, spec)
        bases = [] if base_key is None else by_key.get(_key(base_key, ROW_KEYS), [])
        base = bases[0] if len(bases) == 1 else None  # two settings under one name: no baseline is chosen
        diff = delta(row, base) if base is not None else {}
        pkey = _paper_key(row.key)
        matched.add(pkey)
        record = _identity(row.key, row.runs[0]) | _paper_cells(paper_by_key.get(pkey), spec)
        record |= row_cells(row, diff, spec.score, _task_columns(spec, score_spec))
        record |= {
            "vs": None if base_key is None else _describe_baseline(base_key),
            "verdict": _verdict(row, base_key, base, diff) if len(bases) < 2 else "no baseline: 2 settings",
            "setting": row.runs[0].get("setting"),
            "kv_mem_change_pct": row.runs[0].get("kv_mem_change_pct"),
        }
        record |= {column: row.scores.get(column) for column in spec.extras.values()}
        records.append(record)
    for key, paper_row in paper_by_key.items():  # the paper's rows we have no run for
        if key not in matched:
            records.append(_identity(paper_row, {}) | _paper_cells(paper_row, spec) | {"n_seeds": 0})
    table = pd.DataFrame.from_records(records)
    columns = _columns(spec, score_spec, table)
    table = _sorted(table, spec)[columns].reset_index(drop=True)
    floats = table.select_dtypes("float").columns
    table[floats] = table[floats].round(4)  # points: 1e-4 is far below any interval; no float noise in the CSV
    return table


def row_cells(row: Row, diff: dict[str, paired.Interval], score: str, tasks) -> dict:
    """A row's numbers: seeds, its Avg with interval and seed spread, the difference to its baseline with its
    interval, and per task the score and the difference (points)."""
    avg = row.intervals.get("avg")
    seed_scores = [float(r[score]) for r in row.runs if not pd.isna(r.get(score))]
    cells = {
        "n_seeds": len(row.runs),
        "seeds": ",".join(_text(s) for s in row.seeds),
        "per_doc": row.values is not None,
        "ci": diff["avg"].kind if "avg" in diff and diff["avg"].kind != "none" else None,
        "avg": row.scores.get("avg"),
        "avg_low": avg.low if avg else None,
        "avg_high": avg.high if avg else None,
        "avg_seed_sd": float(np.std(seed_scores, ddof=1)) if len(seed_scores) > 1 else None,
    }
    for name, prefix in [("avg", "avg_delta")] + [(t, f"{t}_delta") for t in tasks]:
        if name != "avg":
            cells[name] = row.scores.get(name)
        interval = diff.get(name)
        cells |= {
            prefix: interval.estimate if interval else None,
            f"{prefix}_low": interval.low if interval else None,
            f"{prefix}_high": interval.high if interval else None,
        }
    return cells


def _task_columns(spec: TableSpec, score_spec: paired.ScoreSpec) -> list[str]:
    if spec.suite == "commonsense":
        return list(paper_columns())
    return [c for c in score_spec.metric]


def _identity(key: dict, run: dict) -> dict:
    out = {c: key.get(c) for c in ROW_KEYS}
    out["kv_dtype"] = run.get("kv_dtype", key.get("kv_dtype"))
    out["kv_bytes_per_token"] = run.get("kv_bytes_per_token")
    out["eval_docs"] = run.get("eval_docs")
    out["experiment"] = run.get("experiment")
    out["paper_order"] = key.get("paper_order")
    return out


def _paper_cells(paper_row: dict | None, spec: TableSpec) -> dict:
    paper_row = paper_row or {}
    out = {
        "avg_paper": paper_row.get(spec.paper_score),
        "avg_delta_paper": paper_row.get("avg_delta_paper"),
        "kv_mem_change_pct_paper": paper_row.get("kv_mem_change_pct"),
        "paper_order": paper_row.get("paper_order"),
    }
    prefix = "" if spec.suite == "commonsense" else "longbench."
    for task in spec.tasks:
        out[f"{task}_paper"] = paper_row.get(prefix + task)
    return out


def _columns(spec: TableSpec, score_spec: paired.ScoreSpec, table: pd.DataFrame) -> list[str]:
    columns = [
        "model",
        "ours_model",
        "experiment",
        "method",
        "rope",
        "r",
        "svd",
        "d_kv",
        "options",
        "distill_token_passes",
        "objective",
        "trainable",
        "lr",
        "warmup",
        "precision",
    ]
    if spec.by_precision:
        columns += ["kv_quant", "kv_grouping", "kv_dtype", "kv_bytes_per_token"]
    columns += [
        "data",
        "train_tokens",
        "eval_sample",
        "eval_docs",
        "eval_dtype",
        "n_seeds",
        "seeds",
        "per_doc",
        "avg",
        "avg_low",
        "avg_high",
        "avg_seed_sd",
        "vs",
        "ci",
        "avg_delta",
        "avg_delta_low",
        "avg_delta_high",
        "verdict",
        "avg_paper",
        "avg_delta_paper",
    ]
    if spec.with_kv_memory:
        columns += ["kv_mem_change_pct", "kv_mem_change_pct_paper"]
    columns += list(spec.extras.values())
    for task in _task_columns(spec, score_spec):
        columns += [task, f"{task}_delta", f"{task}_delta_low", f"{task}_delta_high"]
    columns += [f"{task}_paper" for task in spec.tasks] + ["setting"]
    for column in columns:
        if column not in table:
            table[column] = None
    return columns


def _sorted(table: pd.DataFrame, spec: TableSpec) -> pd.DataFrame:
    """The paper's row order; ours at their paper row, by budget; ours without a paper row after their model's."""
    if not len(table):
        return table
    model_rank = table.groupby("model", dropna=False, sort=False)["paper_order"].transform("min")
    method_rank = table["method"].map({m: i for i, m in enumerate(METHODS)}).fillna(len(METHODS))
    order = pd.DataFrame(
        {
            "model_rank": model_rank.astype(float).fillna(np.inf),
            "model": table["model"].map(_text),
            "paper_order": table["paper_order"].astype(float).fillna(np.inf),
            "method_rank": method_rank,
            "rope": table["rope"].map(_text),
            "r": pd.to_numeric(table["r"], errors="coerce").fillna(-1),
            "svd": table["svd"].map(_text),
            "d_kv": -pd.to_numeric(table["d_kv"], errors="coerce").fillna(0),
            "options": table["options"].map(_text),
            "kv_quant": table["kv_quant"].map(lambda q: KV_QUANT_ORDER.index(q) if q in KV_QUANT_ORDER else 99),
            "kv_grouping": table["kv_grouping"].map(_text),
            "ours_model": table["ours_model"].map(_text),
            "train_tokens": pd.to_numeric(table["train_tokens"], errors="coerce").fillna(-1),
            "eval_sample": table["eval_sample"].map(_text),
            "eval_dtype": table["eval_dtype"].map(_text),
        }
    )
    return table.loc[order.sort_values(list(order.columns), kind="stable").index]


def paper_rows(spec: TableSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The paper's rows of `spec`'s table, and all the paper's rows of its suite (where baselines are looked up);
    empty when the table has no paper counterpart."""
    every = paper_longbench() if spec.suite == "long_context" else paper_commonsense()
    if spec.paper_table is None:
        return every.iloc[0:0].copy(), every
    return every[every["table"] == spec.paper_table].copy(), every


__all__ = ["TableSpec", "build_table", "paper_rows", "NOT_RESOLVED"]
