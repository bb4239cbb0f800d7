"""A table row is one setting (the run identity but its seed): runs that differ in anything that changes numbers
never share a row, seeds of one setting do; old records get their setting by re-planning, or stay apart.
Also: MMLU at one doc per subject varies in the bootstrap, and the run summary's standard error is the
aggregate's."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mha2mla_exp.aggregate import build_aggregate, paired
from mha2mla_exp.runner import record, run_config, validate
from tests.test_aggregate import _record, _write
from tests.test_configs import compose_cfg

TRAINED = ["variant=mla", "train.tokens=4096", "train.precision=fp32"]


def test_the_setting_hash_leaves_out_the_seed_and_only_the_seed():
    plans = {
        name: validate(run_config(compose_cfg(TRAINED + extra)))
        for name, extra in {
            "seed0": [],
            "seed1": ["seed=1"],
            "bf16": ["train.precision=bf16-autocast"],
            "warmup": ["train.warmup_steps=3"],
            "logging": ["train.log_every=7"],
        }.items()
    }
    assert plans["seed0"].identity.trained_hash != plans["seed1"].identity.trained_hash
    assert plans["seed0"].identity.setting_hash == plans["seed1"].identity.setting_hash
    assert plans["bf16"].identity.setting_hash != plans["seed0"].identity.setting_hash
    assert plans["warmup"].identity.setting_hash != plans["seed0"].identity.setting_hash
    assert (
        plans["logging"].identity.setting_hash == plans["seed0"].identity.setting_hash
    )  # an observer changes no number


def test_two_precisions_of_one_config_are_two_rows_and_two_seeds_one(tmp_path):
    for name, precision, seed, avg in [
        ("fp32_s0", "fp32", 0, 0.30),
        ("fp32_s1", "fp32", 1, 0.32),
        ("bf16_s0", "bf16-autocast", 0, 0.36),
    ]:
        rec = _record(tokens=32768, seed=seed, avg=avg)
        rec["train"] |= {"precision": {"mode": precision}}
        rec["setting_hash"] = f"setting-{precision}"
        _write(tmp_path, name, rec, seed=seed)
    t1 = build_aggregate([tmp_path]).tables["table1"]
    ours = t1[(t1["d_kv"] == 16) & (t1["n_seeds"] > 0)].set_index("precision")
    assert sorted(ours.index) == ["bf16-autocast", "fp32"]
    assert ours.loc["fp32", "n_seeds"] == 2 and ours.loc["fp32", "avg"] == pytest.approx(31.0)
    assert ours.loc["bf16-autocast", "n_seeds"] == 1 and ours.loc["bf16-autocast", "avg"] == pytest.approx(36.0)


def test_one_name_two_settings_never_merge_nor_pick_a_baseline(tmp_path):
    # the same names (every table key) but two settings, e.g. a record the current code cannot re-plan
    for name, setting, avg in [("ft_a", "a", 0.40), ("ft_b", "b", 0.44)]:
        _write(tmp_path, name, _record("finetuned_full_attention", avg=avg) | {"setting_hash": setting})
    _write(tmp_path, "mla", _record(avg=0.30))
    t1 = build_aggregate([tmp_path]).tables["table1"]
    ft = t1[(t1["method"] == "finetuned_full_attention") & (t1["n_seeds"] > 0)]
    assert sorted(ft["avg"]) == [40.0, 44.0]
    mla = t1[(t1["d_kv"] == 16) & (t1["n_seeds"] > 0)].iloc[0]
    assert mla["verdict"] == "no baseline: 2 settings" and pd.isna(mla["avg_delta"])


def test_a_record_without_a_setting_stands_alone(tmp_path):
    for name, seed in [("s0", 0), ("s1", 1)]:
        rec = _record(seed=seed)
        del rec["setting_hash"]
        _write(tmp_path, name, rec, seed=seed)
    t1 = build_aggregate([tmp_path]).tables["table1"]
    assert list(t1.loc[(t1["d_kv"] == 16) & (t1["n_seeds"] > 0), "n_seeds"]) == [1, 1]


def test_mmlu_at_one_doc_per_subject_varies_in_the_bootstrap():
    spec = paired.commonsense_spec(["mmlu"])
    rng = np.random.default_rng(0)
    index = pd.MultiIndex.from_tuples(
        [("mmlu", f"mmlu_subject{i}", 0) for i in range(57)], names=["column", "task", "doc_id"]
    )
    values = pd.DataFrame({"value": rng.integers(0, 2, 57).astype(float)}, index=index)
    interval = paired.bootstrap_scores(values, spec)["mmlu"]
    assert interval.high - interval.low > 0.1  # ~ 2 x 1.96 x sqrt(p (1-p) / 57) ~ 0.26
    # a subject of several docs is still its own stratum: these resamples keep its mean
    index2 = pd.MultiIndex.from_tuples(
        [("mmlu", "one_subject", i) for i in range(4)], names=["column", "task", "doc_id"]
    )
    same = pd.DataFrame({"value": [1.0, 1.0, 1.0, 1.0]}, index=index2)
    assert paired.bootstrap_scores(same, spec)["mmlu"].low == 1.0


def test_the_run_summary_uses_the_aggregates_standard_error(monkeypatch):
    calls = []
    real = paired.binomial_se
    monkeypatch.setattr(paired, "binomial_se", lambda *a, **k: calls.append(a) or real(*a, **k))
    cs = {c: 0.4 for c in ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande")}
    block = {"commonsense": cs | {"avg": 0.4}, "meta": {"commonsense": {"n_docs": {c: 100 for c in cs}}}}
    se = record.commonsense_avg_se(block)
    assert calls and se == pytest.approx(real(cs, {c: 100 for c in cs}, paired.commonsense_spec())["avg"])
