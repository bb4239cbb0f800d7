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

import hashlib
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from ..schema.commonsense_suite import avg_weights, paper_parts, suite

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
N_BOOTSTRAP = 4000
BOOTSTRAP_SEED = 20250220


@dataclass(frozen=True)
class ScoreSpec:
    """How per-document values make a score: the metric per column and the weights of the columns in it."""

    metric: Mapping[str, str]  # column -> per-doc metric (acc_norm, acc)
    weights: Mapping[str, float]  # column -> weight in the headline score (they sum to 1)
    derived: Mapping[str, Mapping[str, float]] = None  # extra reported columns as weighted means of columns

    @property
    def reported(self) -> dict[str, dict[str, float]]:
        """Every reported column (each plain column, the derived ones, and `avg`) as weights over columns."""
        out = {c: {c: 1.0} for c in self.metric}
        out.update({k: dict(v) for k, v in (self.derived or {}).items()})
        out["avg"] = dict(self.weights)
        return out


def commonsense_spec(columns: Sequence[str] | None = None) -> ScoreSpec:
    """The commonsense suite's Avg and its columns of several tasks (ARC), by the suite's metrics and weights
    (schema/commonsense_suite.py)."""
    metric = {c: row.metric for c, row in suite().items() if columns is None or c in columns}
    return ScoreSpec(metric=metric, weights=avg_weights(), derived=paper_parts())


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
        one = pd.DataFrame(
            {
                "column": rows["column"],
                "task": rows["task"],
                "doc_id": rows["doc_id"],
                "value": value,
                "doc_hash": rows.get("doc_hash"),
            }
        ).set_index(["column", "task", "doc_id"])
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
    layout_a, layout_b = _layout(a.index), _layout(b.index)
    if layout_a.documents != layout_b.documents:
        return False
    ha = a["doc_hash"].to_numpy(dtype=object)
    hb = b["doc_hash"] if layout_b.ordered == layout_a.ordered else b["doc_hash"].reindex(a.index)
    hb = hb.to_numpy(dtype=object)
    known = pd.notna(ha) & pd.notna(hb)
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
@dataclass(frozen=True)
class _Layout:
    """What pairing and resampling need of a (column, task, doc_id) index, worked out once per index."""

    ordered: str  # a digest of its documents in their order: two indexes alike need no reindexing
    documents: str  # a digest of the same documents, order aside
    strata: tuple[tuple[str, np.ndarray], ...]  # (column, positions of its docs) per stratum, `_strata`'s order


_LAYOUTS: dict[int, tuple[weakref.ref, _Layout]] = {}  # id(index) -> (the index, its layout)


def _layout(index: pd.MultiIndex) -> _Layout:
    """`index`'s layout; pandas indexes never change, so it is kept for as long as the index lives."""
    known = _LAYOUTS.get(id(index))
    if known is not None and known[0]() is index:
        return known[1]
    ids = ["\x1f".join(map(str, key)) for key in index]
    layout = _Layout(
        hashlib.sha256("\x1e".join(ids).encode()).hexdigest(),
        hashlib.sha256("\x1e".join(sorted(ids)).encode()).hexdigest(),
        _strata(index),
    )
    if len(_LAYOUTS) > 4096:  # dead entries of long sessions (tests): start over
        _LAYOUTS.clear()
    _LAYOUTS[id(index)] = (weakref.ref(index), layout)
    return layout


def _strata(index: pd.MultiIndex) -> tuple[tuple[str, np.ndarray], ...]:
    """(column, positions of its docs) per stratum: each task of a column, its single-doc tasks pooled into one
    (a stratum of one doc never varies). Strata in (column, task) order, then the pooled ones; docs in their order
    in `index` (pandas' groupby order)."""
    column_codes, columns = pd.factorize(index.get_level_values("column"), sort=True)
    task_codes, _ = pd.factorize(index.get_level_values("task"), sort=True)
    order = np.lexsort((task_codes, column_codes))  # stable: a stratum keeps its docs' order
    keys = np.stack([column_codes[order], task_codes[order]])
    starts = np.flatnonzero(np.r_[True, (keys[:, 1:] != keys[:, :-1]).any(axis=0)])
    strata, singles = [], {}
    for start, end in zip(starts, np.r_[starts[1:], len(order)]):
        column = str(columns[column_codes[order[start]]])
        if end - start == 1:
            singles.setdefault(column, []).append(order[start:end])
        else:
            strata.append((column, order[start:end]))
    return tuple(strata + [(column, np.concatenate(positions)) for column, positions in singles.items()])


@lru_cache(maxsize=8)
def resample_counts(sizes: tuple[int, ...], n_boot: int, seed: int) -> tuple[np.ndarray, ...]:
    """Per stratum of `sizes` docs, how often each doc is drawn in each of `n_boot` resamples: (size x n_boot),
    read-only, in the smallest unsigned type that holds them (a count rarely passes 10).

    The draws depend on nothing but the strata's sizes, their order and the seed, so every contrast over the same
    documents shares them: drawn once here, not once per contrast (drawing them was nearly all of the
    aggregate's time). Drawn in the same order from one generator, they are the very draws each contrast made
    on its own, so the intervals are the same to the last digit."""
    rng = np.random.default_rng(seed)
    counts = []
    for n in sizes:
        draws = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)
        dtype = (
            np.uint8
            if draws.max() <= np.iinfo(np.uint8).max
            else np.uint16
            if n <= np.iinfo(np.uint16).max
            else np.int64
        )
        compact = np.ascontiguousarray(draws.T, dtype=dtype)
        compact.flags.writeable = False  # shared by every caller
        counts.append(compact)
    return tuple(counts)


def _dyadic_scale(values: np.ndarray, most: int = 16) -> float | None:
    """The least 2**k (k <= `most`) that makes every value an integer, where the integers stay far below 2**53
    (then every sum of counts times values is exact, whatever the order of its terms); None otherwise (a mean
    over three seeds, a NaN)."""
    if not len(values) or not np.isfinite(values).all():
        return None
    for k in range(most + 1):
        scaled = values * 2.0**k
        if np.array_equal(scaled, np.rint(scaled)):
            return 2.0**k if np.abs(scaled).max() * len(values) < 2.0**40 else None
    return None


def _bootstrap_column_means(values: np.ndarray, layout: _Layout, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """Per column, `n_boot` resampled means of `values` (docs resampled within each stratum of `layout`).

    A resample's sum is sum over docs of count x value. Per-document values are nearly always multiples of a
    power of two (0/1 scores, their differences, means over two seeds): the sums are then exact integers over a
    power of two, summed here in integers over the docs with a non-zero value, a fraction of the memory traffic
    of the float product and the very same numbers. Other values take the float product as always."""
    counts = resample_counts(tuple(len(positions) for _, positions in layout.strata), n_boot, seed)
    scale = _dyadic_scale(values)
    sums: dict[str, np.ndarray] = {}
    n_docs: dict[str, int] = {}
    for (column, positions), draws in zip(layout.strata, counts):
        x = values[positions]
        if scale is None:
            total = np.ascontiguousarray(draws.T, dtype=float) @ x
        else:
            units = np.rint(x * scale).astype(np.int64)
            total = np.zeros(n_boot, dtype=np.int64)
            for unit in np.unique(units[units != 0]):
                total += unit * draws[units == unit].sum(axis=0, dtype=np.int64)
        sums[column] = sums.get(column, 0) + total
        n_docs[column] = n_docs.get(column, 0) + len(x)
    if scale is not None:
        sums = {c: total / scale for c, total in sums.items()}  # exact: the integers are far below 2**53
    return {c: sums[c] / n_docs[c] for c in sums}


_BOUNDS: dict[bytes, dict[str, tuple[float, float]]] = {}  # a resampling's percentile bounds, by its inputs


def _percentile_bounds(
    values: np.ndarray, layout: _Layout, spec: ScoreSpec, n_boot: int, seed: int, level: float
) -> dict[str, tuple[float, float]]:
    """(low, high) of every reported column's resampled score. One table's contrast is often another's (a row
    against the original in a grid and in a pairwise table): the bounds are kept by a digest of everything they
    depend on, so each is resampled once."""
    key = hashlib.sha256(values.tobytes() + repr((layout.ordered, spec.reported, n_boot, seed, level)).encode())
    known = _BOUNDS.get(key.digest())
    if known is None:
        resampled = _combine(_bootstrap_column_means(values, layout, n_boot, seed), spec)
        tail = 100 * (1 - level) / 2
        known = {
            name: (float(np.percentile(r, tail)), float(np.percentile(r, 100 - tail))) for name, r in resampled.items()
        }
        if len(_BOUNDS) > 65536:
            _BOUNDS.clear()
        _BOUNDS[key.digest()] = known
    return known


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    kind: str  # "paired bootstrap" | "unpaired binomial" | "bootstrap" | "binomial" | "none"

    @property
    def resolved(self) -> bool | None:
        """The interval excludes 0 (None: there is no interval)."""
        if math.isnan(self.low) or math.isnan(self.high):
            return None
        return not (self.low <= 0.0 <= self.high)


def paired_bootstrap(
    row: pd.DataFrame,
    baseline: pd.DataFrame,
    spec: ScoreSpec,
    *,
    n_boot: int = N_BOOTSTRAP,
    seed: int = BOOTSTRAP_SEED,
    level: float = 0.95,
) -> dict[str, Interval]:
    """Row minus baseline for every reported column, with its paired percentile bootstrap interval.
    Both are `doc_values` frames over the same documents."""
    return paired_contrast([row], [baseline], spec, n_boot=n_boot, seed=seed, level=level)


def paired_contrast(
    plus: Sequence[pd.DataFrame],
    minus: Sequence[pd.DataFrame],
    spec: ScoreSpec,
    *,
    n_boot: int = N_BOOTSTRAP,
    seed: int = BOOTSTRAP_SEED,
    level: float = 0.95,
) -> dict[str, Interval]:
    """The sum of `plus` minus the sum of `minus` for every reported column, each document resampled once for all
    of them (paired percentile bootstrap); all are `doc_values` frames over the same documents. An interaction,
    (a - b) - (c - d), is `paired_contrast([a, d], [b, c])`: where the two differences move together on the same
    documents, its interval is narrower than theirs combined as if independent."""
    frames = [*plus, *minus]
    if not frames or any(not same_documents(frames[0], other) for other in frames[1:]):
        raise ValueError("paired_contrast: the rows were evaluated on different documents")
    index = frames[0].index
    layout = _layout(index)

    def aligned(frame: pd.DataFrame) -> np.ndarray:
        same_order = _layout(frame.index).ordered == layout.ordered
        return (frame["value"] if same_order else frame["value"].reindex(index)).to_numpy(dtype=float)

    diff = sum(aligned(f) for f in plus) - sum(aligned(f) for f in minus)
    estimate = _combine(_column_means(pd.DataFrame({"value": diff}, index=index)), spec)
    bounds = _percentile_bounds(diff, layout, spec, n_boot, seed, level)
    return {name: Interval(estimate[name], *bounds[name], "paired bootstrap") for name in estimate}


def bootstrap_scores(
    values: pd.DataFrame, spec: ScoreSpec, *, n_boot: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED, level: float = 0.95
) -> dict[str, Interval]:
    """Every reported column's score with its percentile bootstrap interval (docs resampled within tasks)."""
    estimate = point_scores(values, spec)
    bounds = _percentile_bounds(values["value"].to_numpy(dtype=float), _layout(values.index), spec, n_boot, seed, level)
    return {name: Interval(estimate[name], *bounds[name], "bootstrap") for name in estimate}


# ---------------------------------------------------------------- without per-document results
def binomial_se(scores: Mapping[str, float], n_docs: Mapping[str, int], spec: ScoreSpec) -> dict[str, float]:
    """Standard errors of every reported column from the column scores (fractions) and their doc counts,
    each column's docs independent Bernoulli draws."""
    se = {
        c: math.sqrt(scores[c] * (1 - scores[c]) / n_docs[c])
        for c in spec.metric
        if c in scores and n_docs.get(c) and scores[c] is not None and not pd.isna(scores[c])
    }
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
    same = x == y.reindex(x.index)
    out = {c: (int(g.sum()), int(len(g))) for c, g in same.groupby(level="column")}
    out["all"] = (int(same.sum()), int(len(same)))
    return out
