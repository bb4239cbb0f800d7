"""Paired statistics against closed forms: a model against itself has a zero-width interval; a known
per-document difference gives the binomial interval; resampling is within tasks; the weights are the
paper's Avg; binomial standard errors by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from mha2mla_exp.aggregate.paired import (
    BOOTSTRAP_SEED,
    N_BOOTSTRAP,
    Z95,
    _combine,
    binomial_se,
    bootstrap_scores,
    commonsense_spec,
    doc_values,
    paired_bootstrap,
    paired_contrast,
    point_scores,
    resample_counts,
    unpaired_difference,
)

SPEC = commonsense_spec()
TASKS = {
    "mmlu": ["mmlu_a", "mmlu_b"],
    "arc_easy": ["arc_easy"],
    "arc_challenge": ["arc_challenge"],
    "piqa": ["piqa"],
    "hellaswag": ["hellaswag"],
    "openbookqa": ["openbookqa"],
    "winogrande": ["winogrande"],
}


def frame(correct: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per-document rows shaped like eval_samples.jsonl.gz: `correct[task]` is 0/1 per doc."""
    rows = []
    for column, tasks in TASKS.items():
        metric = "acc" if column == "winogrande" else "acc_norm"
        for task in tasks:
            for doc_id, value in enumerate(correct[task]):
                rows.append(
                    {
                        "suite": "commonsense",
                        "column": column,
                        "task": task,
                        "doc_id": doc_id,
                        "doc_hash": f"{task}-{doc_id}",
                        metric: float(value),
                    }
                )
    return pd.DataFrame(rows)


def sizes(n=400, mmlu=(100, 300)):
    return {"mmlu_a": mmlu[0], "mmlu_b": mmlu[1], **{t: n for ts in list(TASKS.values())[1:] for t in ts}}


def random_correct(seed=0, **kw):
    rng = np.random.default_rng(seed)
    return {t: rng.integers(0, 2, n) for t, n in sizes(**kw).items()}


def test_a_model_against_itself_has_a_zero_width_interval():
    values = doc_values([frame(random_correct())], SPEC)
    for name, interval in paired_bootstrap(values, values, SPEC).items():
        assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0), name
        assert not interval.resolved


def test_known_difference_on_one_task_gives_the_binomial_interval():
    base = random_correct(1)
    better = {t: v.copy() for t, v in base.items()}
    n, k = 400, 40
    base["piqa"] = np.ones(n)
    better["piqa"] = np.r_[np.zeros(k), np.ones(n - k)]  # worse on exactly k of n docs
    row, ref = doc_values([frame(better)], SPEC), doc_values([frame(base)], SPEC)
    out = paired_bootstrap(row, ref, SPEC, n_boot=20000)
    # the resampled mean difference is -Binomial(n, k/n)/n: its percentile interval, to one doc
    low, high = -stats.binom.ppf(0.975, n, k / n) / n, -stats.binom.ppf(0.025, n, k / n) / n
    assert out["piqa"].estimate == pytest.approx(-k / n)
    assert abs(out["piqa"].low - low) <= 1 / n and abs(out["piqa"].high - high) <= 1 / n
    assert out["piqa"].resolved
    # the other columns did not move; piqa weighs 1/6 in the Avg
    assert (out["hellaswag"].low, out["hellaswag"].high) == (0.0, 0.0)
    for field in ("estimate", "low", "high"):
        assert getattr(out["avg"], field) == pytest.approx(getattr(out["piqa"], field) / 6)


def test_arc_easy_counts_half_in_arc_and_a_twelfth_in_the_avg():
    base = random_correct(2)
    other = {t: v.copy() for t, v in base.items()}
    other["arc_easy"] = 1 - base["arc_easy"][:]  # every answer flipped
    out = paired_bootstrap(doc_values([frame(other)], SPEC), doc_values([frame(base)], SPEC), SPEC)
    d = (1 - 2 * base["arc_easy"]).mean()
    assert out["arc_easy"].estimate == pytest.approx(d)
    assert out["arc"].estimate == pytest.approx(d / 2) and out["avg"].estimate == pytest.approx(d / 12)
    assert out["avg"].low == pytest.approx(out["arc_easy"].low / 12)


def test_mmlu_docs_are_resampled_within_their_subject():
    base = random_correct(3)
    other = {t: v.copy() for t, v in base.items()}
    n1, n2, k = 100, 300, 50
    base["mmlu_a"], base["mmlu_b"] = np.ones(n1), np.ones(n2)
    other["mmlu_a"], other["mmlu_b"] = np.r_[np.zeros(k), np.ones(n1 - k)], np.ones(n2)
    out = paired_bootstrap(doc_values([frame(other)], SPEC), doc_values([frame(base)], SPEC), SPEC, n_boot=20000)
    assert out["mmlu"].estimate == pytest.approx(-k / (n1 + n2))  # pooled: the size-weighted mean
    p = k / n1  # only subject a varies: sd = sqrt(n1 p (1-p)) / (n1 + n2); pooled resampling would give 1.32x
    half = Z95 * math.sqrt(n1 * p * (1 - p)) / (n1 + n2)
    assert (out["mmlu"].high - out["mmlu"].low) / 2 == pytest.approx(half, rel=0.06)


def test_seeds_enter_as_their_per_document_mean():
    a, b = random_correct(4), random_correct(5)
    two = doc_values([frame(a), frame(b)], SPEC)
    scores = point_scores(two, SPEC)
    one_a, one_b = point_scores(doc_values([frame(a)], SPEC), SPEC), point_scores(doc_values([frame(b)], SPEC), SPEC)
    assert scores["avg"] == pytest.approx((one_a["avg"] + one_b["avg"]) / 2)


def test_different_documents_are_never_paired():
    a = doc_values([frame(random_correct(6))], SPEC)
    b = doc_values([frame(random_correct(6, n=399))], SPEC)
    with pytest.raises(ValueError, match="different documents"):
        paired_bootstrap(a, b, SPEC)
    renamed = frame(random_correct(6))
    renamed.loc[0, "doc_hash"] = "another text"
    with pytest.raises(ValueError, match="different documents"):
        paired_bootstrap(doc_values([renamed], SPEC), a, SPEC)


def test_binomial_standard_errors_by_hand():
    scores = {
        "mmlu": 0.3,
        "arc_easy": 0.5,
        "arc_challenge": 0.25,
        "piqa": 0.6,
        "hellaswag": 0.4,
        "openbookqa": 0.3,
        "winogrande": 0.5,
    }
    n = {
        "mmlu": 57,
        "arc_easy": 50,
        "arc_challenge": 50,
        "piqa": 50,
        "hellaswag": 50,
        "openbookqa": 50,
        "winogrande": 50,
    }
    se = binomial_se(scores, n, SPEC)
    by_hand = {c: math.sqrt(p * (1 - p) / n[c]) for c, p in scores.items()}
    assert se["piqa"] == pytest.approx(by_hand["piqa"])
    assert se["arc"] == pytest.approx(0.5 * math.hypot(by_hand["arc_easy"], by_hand["arc_challenge"]))
    six = [
        by_hand["mmlu"],
        se["arc"],
        by_hand["piqa"],
        by_hand["hellaswag"],
        by_hand["openbookqa"],
        by_hand["winogrande"],
    ]
    assert se["avg"] == pytest.approx(math.sqrt(sum(x * x for x in six)) / 6)
    d = unpaired_difference(0.40, 0.02, 0.37, 0.015)
    assert (d.estimate, d.high - d.estimate) == (pytest.approx(0.03), pytest.approx(Z95 * 0.025))
    assert not d.resolved and d.kind == "unpaired binomial"


def _worse_on_first(correct: dict[str, np.ndarray], k: int, task: str = "piqa") -> tuple[dict, dict]:
    """(worse, better): the same answers but on `task`'s first k docs, where better is right and worse wrong."""
    better = {t: v.astype(float).copy() for t, v in correct.items()}
    better[task][:k] = 1
    worse = {t: v.copy() for t, v in better.items()}
    worse[task][:k] = 0
    return worse, better


def test_an_interaction_of_one_effect_on_the_same_documents_is_exactly_zero():
    """(a - b) - (c - d) where both differences are the same k documents going wrong: zero on every resample,
    although each difference alone is resolved."""
    a, b = _worse_on_first(random_correct(7), 40)
    c, d = _worse_on_first(random_correct(8), 40)
    a, b, c, d = (doc_values([frame(x)], SPEC) for x in (a, b, c, d))
    assert paired_bootstrap(a, b, SPEC)["piqa"].resolved and paired_bootstrap(c, d, SPEC)["piqa"].resolved
    for name, interval in paired_contrast([a, d], [b, c], SPEC).items():
        assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0), name


def test_an_interaction_with_no_effect_on_one_side_is_the_other_sides_difference():
    a, b = _worse_on_first(random_correct(9), 40)
    c = random_correct(10)
    a, b, c = (doc_values([frame(x)], SPEC) for x in (a, b, c))
    alone, interaction = paired_bootstrap(a, b, SPEC), paired_contrast([a, c], [b, c], SPEC)
    assert interaction["avg"].estimate == pytest.approx(-40 / 400 / 6)
    for name in alone:
        assert (interaction[name].low, interaction[name].high) == pytest.approx((alone[name].low, alone[name].high))


def test_a_contrast_of_rows_on_different_documents_is_refused():
    a = doc_values([frame(random_correct(11))], SPEC)
    b = doc_values([frame(random_correct(11, n=399))], SPEC)
    with pytest.raises(ValueError, match="different documents"):
        paired_contrast([a, a], [a, b], SPEC)


# ---------------------------------------------------------------- resamples drawn once, the same intervals
def _fresh_column_means(diff: pd.Series, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """The bootstrap as it ran before its draws were shared: every call draws its own, stratum by stratum."""
    rng = np.random.default_rng(seed)
    strata, singles = [], {}
    for (column, _task), group in diff.groupby(level=["column", "task"], sort=True):
        x = group.to_numpy(dtype=float)
        (singles.setdefault(column, []).append(x) if len(x) == 1 else strata.append((column, x)))
    sums, counts = {}, {}
    for column, x in strata + [(column, np.concatenate(xs)) for column, xs in singles.items()]:
        draws = rng.multinomial(len(x), np.full(len(x), 1.0 / len(x)), size=n_boot)
        sums[column] = sums.get(column, 0.0) + draws @ x
        counts[column] = counts.get(column, 0) + len(x)
    return {c: sums[c] / counts[c] for c in sums}


@pytest.mark.parametrize("mmlu", [(100, 300), (1, 1)])  # (1, 1): two single-doc subjects, pooled into one stratum
def test_shared_resamples_give_the_intervals_of_fresh_draws_to_the_last_digit(mmlu):
    a = doc_values([frame(random_correct(12, mmlu=mmlu))], SPEC)
    shuffled = frame(random_correct(13, mmlu=mmlu)).sample(frac=1, random_state=0)  # other order: reindexed
    b = doc_values([shuffled], SPEC)
    before = resample_counts.cache_info()
    shared = paired_bootstrap(a, b, SPEC)
    again = paired_bootstrap(b, a, SPEC, n_boot=N_BOOTSTRAP)
    assert resample_counts.cache_info().hits > before.hits  # the second contrast drew nothing
    diff = a["value"] - b["value"].reindex(a.index)
    fresh = _combine(_fresh_column_means(diff, N_BOOTSTRAP, BOOTSTRAP_SEED), SPEC)
    tail = 100 * (1 - 0.95) / 2  # 2.500000000000002, as the intervals compute it
    for name, interval in shared.items():
        assert interval.low == np.percentile(fresh[name], tail)
        assert interval.high == np.percentile(fresh[name], 100 - tail)
        assert interval.estimate == -again[name].estimate
    own = bootstrap_scores(a, SPEC)
    fresh = _combine(_fresh_column_means(a["value"], N_BOOTSTRAP, BOOTSTRAP_SEED), SPEC)
    assert {k: (v.low, v.high) for k, v in own.items()} == {
        k: (np.percentile(r, tail), np.percentile(r, 100 - tail)) for k, r in fresh.items()
    }
