"""Uncertainty of a score and of a difference between two models, from per-document results.

A *score* is a weighted mean of column means: Avg = sum_c w_c * mean over column c's docs of its metric
(the paper's Avg: MMLU, PIQA, HellaSwag, OBQA, Winogrande 1/6 each, ARC-Easy and ARC-Challenge 1/12 each,
since ARC is their mean; MMLU pools its subjects' docs, lm-eval's size-weighted mean). Docs live in
strata (lm-eval's leaf tasks: one per MMLU subject, one per other task).

- `paired_bootstrap`: a row against its baseline on the *same* documents: resample docs with replacement
  within each stratum (a column's single-doc strata, e.g. MMLU at one doc per subject, pooled into one: a
  stratum of one doc never varies), the same resample for both models, and take the percentile 95% interval of the
  difference; the same resamples give every column's interval. Several seeds of one configuration
  enter as their per-document mean (the seeds are evaluated on the same docs). `paired_contrast` does the same
  for any sum and difference of rows on the same documents, e.g. an interaction (a - b) - (c - d).
- `binomial`: a run without per-document results: each column's binomial standard error
  sqrt(p (1 - p) / n), propagated through the weights; a difference of two such scores is treated as
  independent (conservative when both were evaluated on the same docs, which are positively correlated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
N_BOOTSTRAP = 4000
BOOTSTRAP_SEED = 20250220

# column -> {record column: weight}; the paper's Avg and its ARC
COMMONSENSE_WEIGHTS = {"mmlu": 1 / 6, "arc_easy": 1 / 12, "arc_challenge": 1 / 12, "piqa": 1 / 6,
                       "hellaswag": 1 / 6, "openbookqa": 1 / 6, "winogrande": 1 / 6}
DERIVED = {"arc": {"arc_easy": 0.5, "arc_challenge": 0.5}}


@dataclass(frozen=True)
class ScoreSpec:
    """How per-document values make a score: the metric per column and the weights of the columns in it."""

    metric: Mapping[str, str]            # column -> per-doc metric (acc_norm, acc)
    weights: Mapping[str, float]         # column -> weight in the headline score (they sum to 1)
    derived: Mapping[str, Mapping[str, float]] = None  # extra reported columns as weighted means of columns

    @property
    def reported(self) -> dict[str, dict[str, float]]:
        """Every reported column (each plain column, the derived ones, and `avg`) as weights over columns."""
        out = {c: {c: 1.0} for c in self.metric}
        out.update({k: dict(v) for k, v in (self.derived or {}).items()})
        out["avg"] = dict(self.weights)
        return out


def commonsense_spec(columns: Sequence[str] | None = None) -> ScoreSpec:
    """The paper's commonsense Avg (acc_norm; Winogrande acc)."""
    from ..evaluation.commonsense import COLUMNS, MMLU_METRIC

    metric = {"mmlu": MMLU_METRIC, **{c: spec[2] for c, spec in COLUMNS.items()}}
    if columns is not None:
        metric = {c: m for c, m in metric.items() if c in columns}
    return ScoreSpec(metric=metric, weights=COMMONSENSE_WEIGHTS, derived=DERIVED)


def mean_spec(columns: Sequence[str], metric: str = "acc") -> ScoreSpec:
    """An unweighted mean of columns (the long-context Avg: passkey at each length)."""
    columns = list(columns)
    return ScoreSpec(metric={c: metric for c in columns}, weights={c: 1 / len(columns) for c in columns})


# ---------------------------------------------------------------- per-document values
def doc_values(frames: Sequence[pd.DataFrame], spec: ScoreSpec) -> pd.DataFrame:
    """Per-document values of one configuration: index (column, task, doc_id), columns `value` (the
    mean over `frames`, one per seed) and `doc_hash`. Docs must be the same in every frame."""
    values, hashes = [], None
    for frame in frames:
        rows = frame[frame["column"].isin(list(spec.metric))]
        metric = rows["column"].map(spec.metric)
        value = pd.Series(np.nan, index=rows.index)
        for name in metric.unique():
            value[metric == name] = rows.loc[metric == name, name].astype(float)
        one = pd.DataFrame({"column": rows["column"], "task": rows["task"], "doc_id": rows["doc_id"],
                            "value": value, "doc_hash": rows.get("doc_hash")}).set_index(["column", "task", "doc_id"])
        if one.index.duplicated().any():
            raise ValueError("per-document results hold a document twice")
        if hashes is not None and not one.index.sort_values().equals(hashes.index.sort_values()):
            raise ValueError("the seeds of one configuration were evaluated on different documents")
        hashes = one["doc_hash"] if hashes is None else hashes
        values.append(one["value"])
    if not values:
        raise ValueError("doc_values: no per-document results")
    mean = pd.concat(values, axis=1).mean(axis=1)
    return pd.DataFrame({"value": mean, "doc_hash": hashes.reindex(mean.index)})


def same_documents(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """True when two `doc_values` frames cover exactly the same documents (ids and, where known, text hashes)."""
    if not a.index.sort_values().equals(b.index.sort_values()):
        return False
    ha, hb = a["doc_hash"], b["doc_hash"].reindex(a.index)
    known = ha.notna() & hb.notna()
    return bool((ha[known] == hb[known]).all())


def _column_means(values: pd.DataFrame) -> dict[str, float]:
    return values["value"].groupby(level="column").mean().to_dict()


def _combine(column_means: Mapping[str, np.ndarray | float], spec: ScoreSpec) -> dict:
    out = {}
    for name, weights in spec.reported.items():
        if all(c in column_means for c in weights):
            out[name] = sum(w * column_means[c] for c, w in weights.items())
    return out


def point_scores(values: pd.DataFrame, spec: ScoreSpec) -> dict[str, float]:
    """Every reported column's score (fractions) from per-document values."""
    return _combine(_column_means(values), spec)


# ---------------------------------------------------------------- bootstrap
def _strata(diff: pd.Series):
    """(column, docs' values) per stratum: each task of a column, its single-doc tasks pooled into one."""
    singles: dict[str, list[np.ndarray]] = {}
    for (column, _task), group in diff.groupby(level=["column", "task"], sort=True):
        x = group.to_numpy(dtype=float)
        if len(x) == 1:
            singles.setdefault(column, []).append(x)
        else:
            yield column, x
    for column, xs in singles.items():
        yield column, np.concatenate(xs)


def _bootstrap_column_means(diff: pd.Series, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """Per column, `n_boot` resampled means of `diff` (docs resampled within each stratum, `_strata`)."""
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for column, x in _strata(diff):
        n = len(x)
        draws = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)  # how often each doc is drawn
        sums[column] = sums.get(column, 0.0) + draws @ x
        counts[column] = counts.get(column, 0) + n
    return {c: sums[c] / counts[c] for c in sums}


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    kind: str                  # "paired bootstrap" | "unpaired binomial" | "bootstrap" | "binomial" | "none"

    @property
    def resolved(self) -> bool | None:
        """The interval excludes 0 (None: there is no interval)."""
        if math.isnan(self.low) or math.isnan(self.high):
            return None
        return not (self.low <= 0.0 <= self.high)


def paired_bootstrap(row: pd.DataFrame, baseline: pd.DataFrame, spec: ScoreSpec, *, n_boot: int = N_BOOTSTRAP,
                     seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> dict[str, Interval]:
    """Row minus baseline for every reported column, with its paired percentile bootstrap interval.
    Both are `doc_values` frames over the same documents."""
    return paired_contrast([row], [baseline], spec, n_boot=n_boot, seed=seed, level=level)


def paired_contrast(plus: Sequence[pd.DataFrame], minus: Sequence[pd.DataFrame], spec: ScoreSpec, *,
                    n_boot: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> dict[str, Interval]:
    """The sum of `plus` minus the sum of `minus` for every reported column, each document resampled once for all
    of them (paired percentile bootstrap); all are `doc_values` frames over the same documents. An interaction,
    (a - b) - (c - d), is `paired_contrast([a, d], [b, c])`: where the two differences move together on the same
    documents, its interval is narrower than theirs combined as if independent."""
    frames = [*plus, *minus]
    if not frames or any(not same_documents(frames[0], other) for other in frames[1:]):
        raise ValueError("paired_contrast: the rows were evaluated on different documents")
    index = frames[0].index
    diff = sum(f["value"].reindex(index) for f in plus) - sum(f["value"].reindex(index) for f in minus)
    estimate = _combine(_column_means(pd.DataFrame({"value": diff})), spec)
    resampled = _combine(_bootstrap_column_means(diff, n_boot, seed), spec)
    tail = 100 * (1 - level) / 2
    return {name: Interval(estimate[name], float(np.percentile(resampled[name], tail)),
                           float(np.percentile(resampled[name], 100 - tail)), "paired bootstrap")
            for name in estimate}


def bootstrap_scores(values: pd.DataFrame, spec: ScoreSpec, *, n_boot: int = N_BOOTSTRAP,
                     seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> dict[str, Interval]:
    """Every reported column's score with its percentile bootstrap interval (docs resampled within tasks)."""
    estimate = point_scores(values, spec)
    resampled = _combine(_bootstrap_column_means(values["value"], n_boot, seed), spec)
    tail = 100 * (1 - level) / 2
    return {name: Interval(estimate[name], float(np.percentile(resampled[name], tail)),
                           float(np.percentile(resampled[name], 100 - tail)), "bootstrap") for name in estimate}


# ---------------------------------------------------------------- without per-document results
def binomial_se(scores: Mapping[str, float], n_docs: Mapping[str, int], spec: ScoreSpec) -> dict[str, float]:
    """Standard errors of every reported column from the column scores (fractions) and their doc counts,
    each column's docs independent Bernoulli draws."""
    se = {c: math.sqrt(scores[c] * (1 - scores[c]) / n_docs[c]) for c in spec.metric
          if c in scores and n_docs.get(c) and scores[c] is not None and not pd.isna(scores[c])}
    out = {}
    for name, weights in spec.reported.items():
        if all(c in se for c in weights):
            out[name] = math.sqrt(sum((w * se[c]) ** 2 for c, w in weights.items()))
    return out


def binomial_interval(estimate: float, se: float) -> Interval:
    return Interval(estimate, estimate - Z95 * se, estimate + Z95 * se, "binomial")


def unpaired_difference(a: float, se_a: float, b: float, se_b: float) -> Interval:
    """a - b with the normal 95% interval of two independent estimates."""
    se = math.hypot(se_a, se_b)
    return Interval(a - b, a - b - Z95 * se, a - b + Z95 * se, "unpaired binomial")


def scored_answers(frame: pd.DataFrame, spec: ScoreSpec) -> pd.Series:
    """The choice each document's metric scores (argmax of length-normalised ll for acc_norm, of ll for acc),
    indexed like `doc_values`."""
    rows = frame[frame["column"].isin(list(spec.metric))]
    norm = rows["column"].map(spec.metric) == "acc_norm"
    answer = rows["pred_norm"].where(norm, rows["pred"])
    return pd.Series(answer.to_numpy(), index=pd.MultiIndex.from_frame(rows[["column", "task", "doc_id"]]))


def answer_agreement(a: pd.DataFrame, b: pd.DataFrame, spec: ScoreSpec) -> dict[str, tuple[int, int]]:
    """Per column and overall (`all`): (documents with the same scored answer, documents), two runs on the
    same documents."""
    x, y = scored_answers(a, spec), scored_answers(b, spec)
    if not x.index.sort_values().equals(y.index.sort_values()):
        raise ValueError("answer_agreement: the two runs were evaluated on different documents")
    same = (x == y.reindex(x.index))
    out = {c: (int(g.sum()), int(len(g))) for c, g in same.groupby(level="column")}
    out["all"] = (int(same.sum()), int(len(same)))
    return out
