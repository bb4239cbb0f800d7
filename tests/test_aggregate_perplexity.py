"""The perplexity/compute view lists every ok run, and only those, with the compute columns; the recovery plot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mha2mla_exp.aggregate import build_aggregate
from mha2mla_exp.aggregate.perplexity_pairs import PERPLEXITY_COLUMNS, perplexity_pairs, perplexity_view
from mha2mla_exp.aggregate.plots import VERDICT_COLORS, perplexity_ratios
from mha2mla_exp.aggregate.recovery_study import ppl_at, recovery_table

FIXTURES = Path(__file__).parent / "fixtures" / "runs"


def test_perplexity_view_has_ok_runs_with_compute(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES, runs)
    one = sorted(runs.glob("**/results.json"))[0]
    record = json.loads(one.read_text())
    record.update(status="ok", distill={"token_passes": 1024, "seconds": 3.0})
    record.setdefault("eval", {})["perplexity"] = {"heldout": 42.5}
    record.setdefault("timings", {})["distill_s"] = 3.0
    one.write_text(json.dumps(record))
    for seed, ppl in ((0, 30.0), (1, 20.0)):  # one label, two rows: ordered by their numbers
        path = runs / f"table1/smollm2-135m__ft-full-attention__seed{seed}/results.json"
        record = json.loads(path.read_text())
        record.setdefault("eval", {})["perplexity"] = {"heldout": ppl}
        path.write_text(json.dumps(record))

    aggregate = build_aggregate([runs])
    view = perplexity_view(aggregate.runs)
    assert list(view.columns) == list(PERPLEXITY_COLUMNS)
    assert len(view) == int((aggregate.runs["status"] == "ok").sum())
    row = view[view["heldout_ppl"] == 42.5]
    assert len(row) == 1
    assert row["distill_token_passes"].iloc[0] == 1024
    assert row["label"].iloc[0].endswith("+ layer-wise distillation")
    # the order is the rows' own, not their folders': runs read in another order give the same table
    assert list(view.loc[view["label"] == "smollm2-135m: FT full attention", "heldout_ppl"]) == [20.0, 30.0]
    assert perplexity_view(aggregate.runs.iloc[::-1]).equals(view)


def _recovery_run(
    root: Path,
    name: str,
    *,
    ppl: float,
    avg: float | None,
    train: dict | None,
    distill: dict | None,
    probes: list[dict] = (),
    experiment: str = "recovery",
    config: dict | None = None,
) -> None:
    base = json.loads((FIXTURES / "table3/smollm2-135m__2-norm-r4__split-dkv16/results.json").read_text())
    base.update(run_name=name, experiment=experiment, status="ok", train=train, distill=distill)
    base["mla"].update(svd="joint", init="activation")
    base["eval"] = {"perplexity": {"heldout": ppl}, "commonsense": {"avg": avg} if avg is not None else {}}
    base["timings"] = {"train_s": (train or {}).get("seconds"), "distill_s": (distill or {}).get("seconds")}
    (root / name).mkdir(parents=True)
    (root / name / "results.json").write_text(json.dumps(base))
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in probes))
    if config is not None:
        (root / name / "config.yaml").write_text(json.dumps(config))  # JSON is YAML


def test_recovery_plot_puts_distillation_compute_first(tmp_path):
    runs = tmp_path / "runs"
    _recovery_run(
        runs,
        "ft",
        ppl=160.0,
        avg=0.30,
        train={"tokens": 8192, "seconds": 60.0, "objective": "ce"},
        distill=None,
        probes=[
            {"step": 0, "tokens": 0, "elapsed_s": 0.0, "heldout_ppl_probe": 200.0},
            {"step": 2, "tokens": 4096, "elapsed_s": 30.0, "heldout_ppl_probe": 170.0, "loss": 5.0},
            {"step": 4, "tokens": 8192, "elapsed_s": 60.0, "heldout_ppl_probe": 160.0},
        ],
    )
    _recovery_run(runs, "distill", ppl=150.0, avg=0.31, train=None, distill={"token_passes": 1000, "seconds": 10.0})
    _recovery_run(
        runs,
        "both",
        ppl=120.0,
        avg=0.33,
        train={"tokens": 8192, "seconds": 60.0, "objective": "kd"},
        distill={"token_passes": 1000, "seconds": 10.0},
        probes=[
            {"step": 0, "tokens": 0, "elapsed_s": 0.0, "heldout_ppl_probe": 150.0},
            {"step": 4, "tokens": 8192, "elapsed_s": 60.0, "heldout_ppl_probe": 120.0},
        ],
    )
    aggregate = build_aggregate([runs])
    assert len(aggregate.probes) == 5
    figure = aggregate.figures()["recovery_curves"].figure
    ppl_seconds, ppl_tokens, avg_seconds, _ = figure.axes
    markers = {
        l.get_label(): (list(l.get_xdata()), list(l.get_ydata())) for l in ppl_seconds.lines if l.get_marker() == "o"
    }
    assert markers == {
        "d_kv=16: ce": ([60.0], [160.0]),
        "d_kv=16: ILD": ([10.0], [150.0]),
        "d_kv=16: ILD → kd": ([70.0], [120.0]),
    }
    curves = sorted((list(l.get_xdata()), list(l.get_ydata())) for l in ppl_tokens.lines if l.get_marker() != "o")
    assert curves == [([0.0, 4096.0, 8192.0], [200.0, 170.0, 160.0]), ([1000.0, 9192.0], [150.0, 120.0])]
    assert {l.get_label(): list(l.get_ydata()) for l in avg_seconds.lines} == {
        "d_kv=16: ce": [pytest.approx(30.0)],
        "d_kv=16: ILD": [pytest.approx(31.0)],
        "d_kv=16: ILD → kd": [pytest.approx(33.0)],
    }


def _probes(points):
    return [{"step": i, "tokens": 2048 * i, "elapsed_s": t, "heldout_ppl_probe": p} for i, (t, p) in enumerate(points)]


def test_recovery_table_keeps_conversions_and_recovery_corpora_apart(tmp_path):
    """teacher_recovery: two conversions x recipes on two corpora; each recipe is paired against ce on the run's
    corpus for its own conversion, the teacher-trained ones say so and show the teacher's held-out ppl."""
    runs = tmp_path / "runs"
    train = {"tokens": 8192, "seconds": 100.0, "objective": "ce", "precision": {"mode": "bf16-autocast"}}
    cfg = {"train": {"lr": 3e-4, "freeze_non_attention": False}}
    for rope, offset in (("2-norm", 0.0), ("rorope", 0.05)):
        _recovery_run(
            runs,
            f"{rope}_ce",
            ppl=150.0,
            avg=0.30 + offset,
            train=train,
            distill=None,
            experiment="teacher_recovery",
            probes=_probes([(0, 200.0), (100, 150.0)]),
            config=cfg,
        )
        _recovery_run(
            runs,
            f"{rope}_kd",
            ppl=140.0,
            avg=0.32 + offset,
            train=train | {"objective": "kd"},
            distill=None,
            experiment="teacher_recovery",
            probes=_probes([(0, 200.0), (100, 140.0)]),
            config=cfg,
        )
        for name in (f"{rope}_ce", f"{rope}_kd"):
            record = json.loads((runs / name / "results.json").read_text())
            record["mla"]["rope"] = rope
            if name.endswith("kd"):
                record["train_data"] = {"name": "teacher-samples"}
                record["eval"]["perplexity"]["heldout:teacher-samples"] = 9.5
            (runs / name / "results.json").write_text(json.dumps(record))
    aggregate = build_aggregate([runs])
    table = recovery_table(aggregate.runs, aggregate.probes, "teacher_recovery")
    assert set(table["conversion"].str.split(" ").str[0]) == {"2-norm", "rorope"}
    kd = table[table["recipe"] == "kd on teacher-samples, lr 3e-4"]
    assert len(kd) == 2 and (kd["ppl on its recovery text"] == 9.5).all()
    for _, row in kd.iterrows():  # +2 points over ce of the same conversion, not of the other one
        assert row["Δ Avg vs ce [95% CI]"].startswith("+2.0")
    assert table[table["recipe"] == "ce, lr 3e-4"]["ppl on its recovery text"].isna().all()


def test_recovery_study_table_compares_recipes_at_equal_seconds(tmp_path):
    runs = tmp_path / "runs"
    train = {"tokens": 8192, "seconds": 100.0, "objective": "ce", "precision": {"mode": "bf16-autocast"}}
    _recovery_run(
        runs,
        "ce",
        ppl=150.0,
        avg=0.30,
        train=train,
        distill=None,
        experiment="recovery_study",
        probes=_probes([(0, 200.0), (50, 160.0), (100, 150.0)]),
        config={"train": {"lr": 3e-4, "freeze_non_attention": False}},
    )
    # attention only: faster, so its curve is longer in tokens but ends at 60 s
    _recovery_run(
        runs,
        "kd_attn",
        ppl=140.0,
        avg=0.31,
        train=train | {"objective": "kd", "seconds": 60.0},
        distill=None,
        experiment="recovery_study",
        probes=_probes([(0, 200.0), (60, 140.0)]),
        config={"train": {"lr": 3e-4, "freeze_non_attention": True}},
    )
    _recovery_run(
        runs,
        "ild",
        ppl=130.0,
        avg=0.32,
        train=train | {"objective": "kd"},
        distill={"token_passes": 1000, "seconds": 20.0},
        experiment="recovery_study",
        probes=_probes([(0, 180.0), (100, 130.0)]),
        config={"train": {"lr": 3e-4, "freeze_non_attention": False}},
    )
    _recovery_run(runs, "original", ppl=30.0, avg=0.40, train=None, distill=None, experiment="recovery_study")
    original = json.loads((runs / "original/results.json").read_text())
    (runs / "original/results.json").write_text(json.dumps(original | {"variant": "original", "mla": None}))
    aggregate = build_aggregate([runs])
    table = recovery_table(aggregate.runs, aggregate.probes, "recovery_study").set_index("recipe")
    assert list(table.index) == [
        "original (unconverted)",
        "ILD → kd, lr 3e-4",
        "ce, lr 3e-4",
        "kd, attention only, lr 3e-4",
    ]
    assert table.loc["original (unconverted)", "final ppl"] == 30.0
    assert table.loc["original (unconverted)", "Δ Avg vs ce [95% CI]"].startswith("+10.0 [")
    at = table["ppl @ 60 s"]  # the shortest run's seconds, ILD's included
    assert at["ce, lr 3e-4"] == pytest.approx(math.exp(np.interp(60, [0, 50, 100], np.log([200, 160, 150]))))
    assert at["kd, attention only, lr 3e-4"] == pytest.approx(140.0)
    assert at["ILD → kd, lr 3e-4"] == pytest.approx(math.exp(np.interp(40, [0, 100], np.log([180, 130]))))
    assert table.loc["kd, attention only, lr 3e-4", "choice"] == "best per second"
    assert table["choice"].tolist().count("best per second") == 1
    assert table.loc["ILD → kd, lr 3e-4", "fine-tune s"] == 100.0 and table.loc["ILD → kd, lr 3e-4", "ILD s"] == 20.0
    assert table.loc["ce, lr 3e-4", "Δ Avg vs ce [95% CI]"] == ""  # the reference itself
    assert table.loc["ILD → kd, lr 3e-4", "Δ Avg vs ce [95% CI]"].startswith("+2.0 [")  # 32 - 30 points
    assert ppl_at(pd.DataFrame({"seconds": [0.0, 10.0], "ppl": [5.0, 4.0]}), 11.0) is None  # past its last probe


def _ppl_run(
    root: Path,
    name: str,
    *,
    rope: str,
    d_kv: int,
    seed: int,
    row_nll: list[float],
    experiment: str = "cpu10x_table3",
    r: int = 4,
    **mla,
) -> None:
    base = json.loads((FIXTURES / "table3/smollm2-135m__2-norm-r4__split-dkv16/results.json").read_text())
    base.update(run_name=name, experiment=experiment, status="ok")
    base["mla"].update(rope=rope, d_kv=d_kv, r=r, **mla)
    tokens = [511] * len(row_nll)
    base["eval"] = {
        "perplexity": {"heldout": math.exp(sum(row_nll) / len(row_nll)), "row_nll": row_nll, "row_tokens": tokens}
    }
    (root / name).mkdir(parents=True)
    (root / name / "results.json").write_text(json.dumps(base))
    (root / name / "config.yaml").write_text(json.dumps({"seed": seed}))


def test_perplexity_pairs_resolve_only_what_rows_and_seeds_agree_on(tmp_path):
    runs = tmp_path / "runs"
    rng = np.random.default_rng(0)
    base = list(4.0 + rng.normal(0, 0.3, 24))
    for seed, shift in ((0, 0.0), (1, 0.02)):
        _ppl_run(
            runs,
            f"2norm_s{seed}",
            rope="2-norm",
            d_kv=16,
            seed=seed,
            row_nll=[x + shift for x in base],
            experiment="cpu10x_table3" if seed == 0 else "cpu10x_seed1",
        )
        # high: 0.1 nats/token better on every row, in both seeds
        _ppl_run(
            runs,
            f"high_s{seed}",
            rope="high",
            d_kv=16,
            seed=seed,
            row_nll=[x + shift - 0.1 for x in base],
            experiment="cpu10x_table3" if seed == 0 else "cpu10x_seed1",
        )
        # uniform: better in seed 0, worse in seed 1 (training noise): never resolved
        _ppl_run(
            runs,
            f"uniform_s{seed}",
            rope="uniform",
            d_kv=16,
            seed=seed,
            row_nll=[x + shift + (-0.1 if seed == 0 else 0.15) for x in base],
        )
    _ppl_run(runs, "low_dkv8", rope="low", d_kv=8, seed=0, row_nll=base)  # two factors away from the rest
    pairs = perplexity_pairs(build_aggregate([runs]).runs, ("cpu10x_table3", "cpu10x_seed1"))
    by = {(row["A"].split(" r=")[0], row["B"].split(" r=")[0]): row for row in pairs.to_dict("records")}
    assert set(by) == {("2-norm", "high"), ("2-norm", "uniform"), ("high", "uniform")}
    # r = 8 is compared with its own strategy at r = 4, not with another strategy at r = 4 (two changes)
    _ppl_run(runs, "high_r8", rope="high", d_kv=16, seed=0, r=8, row_nll=[x - 0.3 for x in base])
    with_r8 = perplexity_pairs(build_aggregate([runs]).runs, ("cpu10x_table3", "cpu10x_seed1"))
    r8 = with_r8[with_r8["B"].str.contains("r=8") | with_r8["A"].str.contains("r=8")]
    assert len(r8) == 1 and r8.iloc[0]["A"].startswith("high r=4") and r8.iloc[0]["factor"] == "RoPE"
    # r = 8 has seed 0 only: its ratio is against high r = 4's seed 0, not against the mean of both seeds
    assert r8.iloc[0]["seeds"] == "0" and r8.iloc[0]["B/A"] == pytest.approx(math.exp(-0.2))
    high = by[("2-norm", "high")]
    assert high["factor"] == "RoPE" and high["seeds"] == "0,1" and high["held-out rows"] == 24
    assert high["B/A"] == pytest.approx(math.exp(-0.1)) and high["B/A high"] < 1 and high["verdict"] == "B lower"
    assert high["B/A per seed"] == pytest.approx((math.exp(-0.1), math.exp(-0.1)))
    uniform = by[("2-norm", "uniform")]
    assert uniform["verdict"] == "not resolved"  # the interval excludes 1 (+0.025 on every row), the seeds disagree
    assert uniform["B/A low"] > 1
    # the forest plot: one labelled row per pair at its ratio, the interval in its verdict's colour
    (ax,) = perplexity_ratios(pairs, "pairs").axes  # one question: strategy against strategy at equal r
    assert ax.get_title(loc="left").startswith("strategy against strategy at equal r, with SVD")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == len(pairs) == 3
    y_of = dict(zip(labels, ax.get_yticks()))
    high_y = next(y for label, y in y_of.items() if label.startswith("high") and "2-norm" in label)
    high_bar = next(ln for ln in ax.lines if ln.get_linestyle() == "-" and list(ln.get_ydata()) == [high_y] * 2)
    assert list(high_bar.get_xdata()) == pytest.approx([high["B/A low"], high["B/A high"]])
    assert high_bar.get_color() == VERDICT_COLORS["B lower"]


def test_perplexity_pairs_say_why_a_pair_has_no_interval(tmp_path):
    runs = tmp_path / "runs"
    _ppl_run(runs, "2norm", rope="2-norm", d_kv=16, seed=0, row_nll=[4.0] * 24)
    _ppl_run(runs, "high", rope="high", d_kv=16, seed=0, row_nll=[3.9] * 12)  # other (fewer) held-out rows
    _ppl_run(runs, "uniform", rope="uniform", d_kv=16, seed=0, row_nll=[4.1] * 24)
    record = json.loads((runs / "uniform/results.json").read_text())
    del record["eval"]["perplexity"]["row_nll"], record["eval"]["perplexity"]["row_tokens"]
    (runs / "uniform/results.json").write_text(json.dumps(record))
    pairs = perplexity_pairs(build_aggregate([runs]).runs, ("cpu10x_table3",))
    by = {(row["A"].split(" r=")[0], row["B"].split(" r=")[0]): row for row in pairs.to_dict("records")}
    assert by[("2-norm", "high")]["verdict"] == "not comparable: other held-out rows"
    assert by[("2-norm", "uniform")]["verdict"].startswith("no interval (per-row NLL not kept")
    assert by[("high", "uniform")]["verdict"].startswith("no interval")
    assert by[("2-norm", "high")]["B/A"] == pytest.approx(math.exp(-0.1))  # the ratio of the two means, no interval
    assert math.isnan(by[("2-norm", "high")]["B/A low"])


def test_perplexity_pairs_leave_out_two_changes_within_a_factor(tmp_path):
    runs = tmp_path / "runs"
    base = list(4.0 + np.random.default_rng(1).normal(0, 0.3, 24))
    _ppl_run(runs, "activation", rope="2-norm", d_kv=16, seed=0, row_nll=base, svd="joint", init="activation")
    _ppl_run(
        runs,
        "sqrt",
        rope="2-norm",
        d_kv=16,
        seed=0,
        row_nll=[x + 0.01 for x in base],
        svd="joint",
        init="activation",
        sigma="sqrt",
    )
    _ppl_run(
        runs, "weight", rope="2-norm", d_kv=16, seed=0, row_nll=[x + 0.3 for x in base], svd="joint", init="weight"
    )
    _ppl_run(
        runs, "split8", rope="2-norm", d_kv=8, seed=0, row_nll=[x + 0.2 for x in base], svd="split", init="activation"
    )
    pairs = perplexity_pairs(build_aggregate([runs]).runs, ("cpu10x_table3",)).to_dict("records")
    # one option each: sigma placement, and the weight SVD, each against activation-aware init; not sigma and
    # init at once, and not another SVD at another width (split d_kv=8 against joint d_kv=16)
    assert len(pairs) == 2 and {row["factor"] for row in pairs} == {"options"}
    assert all("init=activation" in row["A"] and "sigma" not in row["A"] for row in pairs)
    assert sorted("sigma=sqrt" in row["B"] for row in pairs) == [False, True]
    assert not any("d_kv=8" in row["A"] + row["B"] for row in pairs)


def test_ours_against_transmla_is_paired_over_the_same_rows_and_says_when_resolved(tmp_path):
    from mha2mla_exp.aggregate.zero_shot import budget_comparison, reference_conversions

    rng = np.random.default_rng(0)
    ref_nll = list(4.6 + 0.1 * rng.standard_normal(32))
    (tmp_path / "qk32_kv40.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "total": 72,
                "qk_mqa_dim": 32,
                "kv_lora_rank": 40,
                "original_cache": 384,
                "heldout_ppl": float(np.exp(np.mean(ref_nll))),
                "options": {"freqfold_chosen": 4},
                "transmla": {"commit": "9c0d25458a31"},
                "heldout_row_nll": ref_nll,
                "heldout_row_tokens": [511] * 32,
            }
        )
    )

    def run(name, nll, index=None):
        return {
            "status": "ok",
            "train_tokens": 0,
            "method": "partial_rope+svd",
            "experiment": "budget_zero_shot",
            "kv_mem_change_pct": -81.25,
            "kv_split": "searched",
            "rope": name,
            "rope_dims": "32",
            "r": None,
            "d_kv": None,
            "heldout_ppl": float(np.exp(np.mean(nll))) if nll else 100.0,
            "options": name,
            "heldout_row_nll": nll,
            "heldout_row_tokens": [511] * 32 if nll else None,
            "heldout_row_index": index,
        }

    runs = pd.DataFrame(
        [
            run("lower", [x - 0.02 for x in ref_nll]),
            run("same", [x + (0.01 if i % 2 else -0.01) for i, x in enumerate(ref_nll)]),
            run("unpaired", None),
            run("sampled rows", [x - 0.5 for x in ref_nll], index=list(range(0, 64, 2))),
        ]
    )
    table = budget_comparison(runs, reference_conversions(tmp_path)).set_index("options")
    assert table.loc["lower", "verdict"] == "ours lower"
    assert table.loc["lower", "ours / TransMLA [95 %]"].startswith(f"{np.exp(-0.02):.3f} [")
    assert table.loc["same", "verdict"] == "not resolved"
    assert table.loc["unpaired", "verdict"].startswith("no interval")
    # a lower ppl on other rows (a stratified sample) is not a win over the reference's first rows
    assert table.loc["sampled rows", "verdict"].startswith("not comparable")
    assert table.loc["sampled rows", "ours / TransMLA [95 %]"] == ""
    assert (table["KV elements"] == 72).all() and len(table) == 5  # TransMLA's own row beside ours
    from mha2mla_exp.aggregate.plots import budget_vs_reference

    ax = budget_vs_reference(table.reset_index()).axes[0]
    assert len(ax.lines) == 3 and ax.lines[0].get_linestyle() == "--"  # TransMLA first, dashed; the unpaired left out


def test_recovery_table_gives_a_settings_seeds_one_row_with_their_mean(tmp_path):
    runs = tmp_path / "runs"
    train = {"tokens": 8192, "seconds": 100.0, "objective": "ce", "precision": {"mode": "bf16-autocast"}}
    for seed, seconds, ppl in ((0, 100.0, 150.0), (1, 120.0, 160.0)):
        _recovery_run(
            runs,
            f"ce_s{seed}",
            ppl=ppl,
            avg=0.30,
            train=train | {"seconds": seconds},
            distill=None,
            experiment="recovery_study",
            probes=_probes([(0, 200.0), (seconds, ppl)]),
            config={"seed": seed, "train": {"lr": 3e-4, "freeze_non_attention": False}},
        )
    _recovery_run(
        runs,
        "kd",
        ppl=140.0,
        avg=0.32,
        train=train | {"objective": "kd"},
        distill=None,
        experiment="recovery_study",
        probes=_probes([(0, 200.0), (100, 140.0)]),
        config={"seed": 0, "train": {"lr": 3e-4, "freeze_non_attention": False}},
    )
    aggregate = build_aggregate([runs])
    table = recovery_table(aggregate.runs, aggregate.probes, "recovery_study").set_index("recipe")
    assert sorted(table.index) == ["ce, lr 3e-4", "kd, lr 3e-4"]  # the two seeds of ce are one row
    ce = table.loc["ce, lr 3e-4"]
    assert ce["seeds"] == 2 and table.loc["kd, lr 3e-4", "seeds"] == 1
    assert ce["fine-tune s"] == pytest.approx(110.0) and ce["final ppl"] == pytest.approx(155.0)
    assert ce["Avg"] == pytest.approx(30.0)
    assert ce["ppl @ 100 s"] == pytest.approx(np.mean([150.0, math.exp(np.interp(100, [0, 120], np.log([200, 160])))]))
