"""The aggregation on hand-written run directories (tests/fixtures/runs): exact table cells, plots, outputs."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from mha2mla_exp.aggregate import build_aggregate, comparisons, plots
from mha2mla_exp.aggregate.__main__ import main
from mha2mla_exp.aggregate.paired import Z95
from mha2mla_exp.aggregate.reference import paper_commonsense, paper_longbench
from mha2mla_exp.aggregate.render import main_view, to_latex
from mha2mla_exp.evaluation.samples import SAMPLES_FILE, write_samples

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
OURS_135M = "smollm2-135m"
PARTS = ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande")  # scored columns


@pytest.fixture(scope="module")
def agg():
    return build_aggregate([FIXTURES])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The CLI run once on the fixtures (writing plots takes seconds): its output dir and what it printed."""
    out_dir = tmp_path_factory.mktemp("aggregate")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([str(FIXTURES), "--out", str(out_dir)]) == 0
    return out_dir, printed.getvalue()


def row(table: pd.DataFrame, **where) -> pd.Series:
    """The single table row matching `where` (None matches an empty cell)."""
    mask = pd.Series(True, index=table.index)
    for column, value in where.items():
        mask &= table[column].isna() if value is None else (table[column] == value).fillna(False)
    assert mask.sum() == 1, f"{mask.sum()} rows match {where}"
    return table[mask].iloc[0]


def cells(series: pd.Series, columns) -> dict:
    return {c: (None if pd.isna(series[c]) else series[c]) for c in columns}


# ---------------------------------------------------------------- Table 1
def test_table1_our_rows_beside_the_paper(agg):
    t1 = agg.tables["table1"]
    cols = [
        "ours_model",
        "n_seeds",
        "train_tokens",
        "kv_mem_change_pct",
        "kv_mem_change_pct_paper",
        "avg",
        "avg_paper",
        "avg_delta",
        "avg_delta_paper",
        "vs",
        "mmlu",
        "mmlu_paper",
        "winogrande",
        "winogrande_paper",
    ]
    m = "135M SmolLM"
    assert cells(row(t1, model=m, method="original"), cols) == {
        "ours_model": OURS_135M,
        "n_seeds": 1,
        "train_tokens": 0,
        "kv_mem_change_pct": 0.0,
        "kv_mem_change_pct_paper": None,
        "avg": 44.5,
        "avg_paper": 44.5,
        "avg_delta": None,
        "avg_delta_paper": None,
        "vs": None,
        "mmlu": 30.0,
        "mmlu_paper": 29.8,
        "winogrande": 52.0,
        "winogrande_paper": 52.01,
    }
    # two seeds of the same configuration: their mean, each seed counted once; against the original
    ft = row(t1, model=m, method="finetuned_full_attention", ours_model=OURS_135M)
    assert cells(ft, cols) == {
        "ours_model": OURS_135M,
        "n_seeds": 2,
        "train_tokens": 500000,
        "kv_mem_change_pct": 0.0,
        "kv_mem_change_pct_paper": None,
        "avg": 44.5,
        "avg_paper": 44.25,
        "avg_delta": 0.0,
        "avg_delta_paper": -0.25,
        "vs": "original",
        "mmlu": 30.0,
        "mmlu_paper": 29.82,
        "winogrande": 52.0,
        "winogrande_paper": 51.07,
    }
    assert ft["seeds"] == "0,1" and ft["avg_seed_sd"] == pytest.approx(math.sqrt(0.5), abs=1e-4)  # 44 and 45
    assert cells(row(t1, model=m, d_kv=16, ours_model=OURS_135M), cols) == {
        "ours_model": OURS_135M,
        "n_seeds": 1,
        "train_tokens": 500000,
        "kv_mem_change_pct": -81.25,
        "kv_mem_change_pct_paper": -81.25,
        "avg": 41.0,
        "avg_paper": 41.84,
        "avg_delta": -3.5,
        "avg_delta_paper": -2.41,
        "vs": "FT full attention @ 500,000",
        "mmlu": 28.0,
        "mmlu_paper": 28.66,
        "winogrande": 50.0,
        "winogrande_paper": 49.8,
    }
    # these records carry no doc counts: a delta, but no interval and no verdict on it
    assert row(t1, model=m, d_kv=16, ours_model=OURS_135M)["verdict"] == "no interval"


def test_table1_failed_run_leaves_its_cells_empty(agg):
    cell = row(agg.tables["table1"], model="135M SmolLM", d_kv=32)
    assert cell["n_seeds"] == 0 and pd.isna(cell["ours_model"]) and pd.isna(cell["avg"])
    assert (cell["avg_paper"], cell["avg_delta_paper"]) == (43.06, -1.19)


def test_table1_paper_numbers_untouched(agg):
    t1 = agg.tables["table1"]
    paper = paper_commonsense().query("table == 1")
    assert list(t1["model"].drop_duplicates()) == ["135M SmolLM", "360M SmolLM", "1B7 SmolLM", "7B Llama2"]
    assert len(t1) == len(paper) == 20  # every paper row once, ours matched onto them
    assert t1["avg_paper"].tolist() == paper["avg"].tolist()
    assert row(t1, model="7B Llama2", d_kv=64)["r"] == 8  # the paper's r = d_h/16 with d_h = 128
    # 360M runs have only LongBench results: they must not appear as Table 1 rows
    assert (t1["ours_model"] == "smollm2-360m").sum() == 0


# ---------------------------------------------------------------- Table 2
def test_table2_longbench_by_precision(agg):
    t2 = agg.tables["table2"]
    m = "360M SmolLM"
    plain = row(t2, model=m, method="original", kv_quant="unquantized", ours_model="smollm2-360m")
    assert (plain["longbench_avg"], plain["avg_paper"], plain["kv_mem_change_pct"]) == (12.0, 13.5, 0.0)
    hqq = row(t2, model=m, method="original", kv_quant="Int4 HQQ", ours_model="smollm2-360m")
    assert (hqq["longbench_avg"], hqq["avg_paper"], hqq["avg_delta_paper"]) == (11.0, 13.4, pytest.approx(-0.1))
    assert hqq["kv_mem_change_pct"] == -73.44 and hqq["kv_mem_change_pct_paper"] == -75.0
    assert pd.isna(hqq["kv_dtype"]) and hqq["kv_grouping"] == "transformers"  # made before either was recorded
    quanto = row(t2, model=m, method="original", kv_quant="Int4 Quanto")
    assert quanto["n_seeds"] == 0 and pd.isna(quanto["longbench_avg"])
    assert quanto["avg_delta_paper"] == pytest.approx(-0.2)
    assert len(t2[t2["n_seeds"] == 0]) == len(paper_longbench()) - 2


# ---------------------------------------------------------------- Tables 3 and 5
def test_table3_strategies(agg):
    t3 = agg.tables["table3"]
    cols = ["n_seeds", "avg", "avg_paper", "avg_delta", "avg_delta_paper", "arc", "arc_paper"]
    m = "135M SmolLM"
    assert cells(row(t3, model=m, method="partial_rope", rope="high", ours_model=OURS_135M), cols) == {
        "n_seeds": 1,
        "avg": 43.0,
        "avg_paper": 43.4,
        "avg_delta": -1.5,
        "avg_delta_paper": pytest.approx(-0.85),
        "arc": 41.0,
        "arc_paper": 41.15,
    }
    assert cells(
        row(t3, model=m, method="partial_rope+svd", rope="2-norm", svd="split", ours_model=OURS_135M), cols
    ) == {
        "n_seeds": 1,
        "avg": 40.0,
        "avg_paper": 40.92,
        "avg_delta": -4.5,
        "avg_delta_paper": pytest.approx(-3.33),
        "arc": 37.0,
        "arc_paper": 37.85,
    }
    # the low-r Table 5 run and the d_kv=8 Table 1 run are not Table 3 configurations
    assert set(t3.loc[t3["n_seeds"] > 0, "rope"]) == {"full", "high", "2-norm"}


def test_table5_r_ablation(agg):
    t5 = agg.tables["table5"]
    m = "135M SmolLM"
    full = row(t5, model=m, method="finetuned_full_attention", ours_model=OURS_135M)
    assert (full["n_seeds"], full["avg"], full["avg_paper"]) == (2, 44.5, 44.25)
    low = row(t5, model=m, rope="low", r=2, ours_model=OURS_135M)
    assert (low["avg"], low["avg_paper"], low["avg_delta"], low["avg_delta_paper"]) == (
        38.0,
        37.94,
        -6.5,
        pytest.approx(-6.31),
    )
    diverged = row(t5, model=m, rope="uniform", r=8)
    assert diverged["n_seeds"] == 0 and pd.isna(diverged["avg"])


def test_runs_not_in_the_paper_get_their_own_row(tmp_path):
    run = json.loads((FIXTURES / "table3/smollm2-135m__2-norm-r4__split-dkv16/results.json").read_text())
    run["mla"]["svd"], run["mla"]["rope"] = "joint", "low"  # low + SVD: Table 3 never printed it
    (tmp_path / "x").mkdir()
    (tmp_path / "x/results.json").write_text(json.dumps(run))
    (tmp_path / "x/config.yaml").write_text("model: {paper_name: 135M SmolLM}\n")
    t3 = build_aggregate([tmp_path]).tables["table3"]
    extra = row(t3, model="135M SmolLM", rope="low", svd="joint")
    assert (extra["n_seeds"], extra["avg"]) == (1, 40.0) and pd.isna(extra["avg_paper"])
    assert extra.name == t3.index[t3["model"] == "135M SmolLM"].max()  # after the model's paper rows
    assert pd.isna(extra["avg_delta"]) and extra["verdict"] == "no baseline"  # no fine-tuned run: none guessed


# ---------------------------------------------------------------- rows: budgets, seeds, doc samples, intervals
def _record(method="mla", tokens=32768, seed=0, limit=50, d_kv=16, avg=0.30, n=50, status="ok", **extra):
    """A results.json in the runner's format with the commonsense block and its doc counts."""
    columns = PARTS
    scores = {c: avg for c in columns} | {"arc": avg, "avg": avg, "limit": limit}
    mla = None if method != "mla" else {"rope": "2-norm", "r": 4, "svd": "joint", "d_kv": d_kv}
    return {
        "run_name": f"{method}-{tokens}-{seed}-{limit}",
        "experiment": "x",
        "status": status,
        "setting_hash": f"{method}-{tokens}-{limit}-{d_kv}-{n}",  # the identity but the seed
        "model": {"name": "smollm2-135m"},
        "variant": method if method != "mla" else "mla",
        "mla": mla,
        "kv_quant": None,
        "kv": {"mem_change_pct": {8: -87.5, 16: -81.25, 32: -68.75}[d_kv] if mla else 0.0, "dtype": "float32"},
        "train": {"tokens": tokens, "objective": "ce"} if tokens else None,
        "eval": {
            "commonsense": scores,
            "meta": {
                "dtype": "float32",
                "commonsense": {
                    "limit": limit,
                    "mmlu_limit": 1,
                    "sample": "random",
                    "seed": 1234,
                    "source": "offline: ...",
                    "n_docs": {c: n for c in columns},
                },
            },
        }
        | extra,
    }


def _write(root: Path, name: str, record: dict, seed: int = 0, rows: list | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(record))
    (folder / "config.yaml").write_text(f"model: {{paper_name: 135M SmolLM}}\nseed: {seed}\ndata: {{name: sotu}}\n")
    if rows is not None:
        write_samples(rows, folder / SAMPLES_FILE)
    return folder


def test_rows_with_different_budgets_never_share_a_table_row(tmp_path):
    _write(tmp_path, "ft32k", _record("finetuned_full_attention", 32768, avg=0.40))
    _write(tmp_path, "mla32k", _record(tokens=32768, avg=0.32))
    _write(tmp_path, "mla8k", _record(tokens=8192, avg=0.31))
    _write(tmp_path, "mla0", _record(tokens=0, avg=0.35))
    _write(tmp_path, "original", _record("original", 0, avg=0.44))
    t1 = build_aggregate([tmp_path]).tables["table1"]
    ours = t1[(t1["d_kv"] == 16) & (t1["n_seeds"] > 0)].set_index("train_tokens")
    assert sorted(ours.index) == [0, 8192, 32768]  # one row per budget, never merged
    assert ours["avg"].to_dict() == {0: 35.0, 8192: 31.0, 32768: 32.0}
    # each against the baseline of its own budget; none at 8k, where no full-attention model was fine-tuned
    assert ours["vs"].to_dict() == {
        0: "original",
        8192: "FT full attention @ 8,192",
        32768: "FT full attention @ 32,768",
    }
    assert ours.loc[32768, "avg_delta"] == pytest.approx(-8.0) and ours.loc[0, "avg_delta"] == pytest.approx(-9.0)
    assert pd.isna(ours.loc[8192, "avg_delta"]) and ours.loc[8192, "verdict"] == "no baseline"
    # 50 docs per column, no per-doc results: an unpaired binomial interval, by hand
    se = lambda p: math.sqrt(sum((w * math.sqrt(p * (1 - p) / 50)) ** 2 for w in [1 / 6] * 5 + [1 / 12] * 2))
    half = Z95 * math.hypot(se(0.32), se(0.40)) * 100
    assert ours.loc[32768, "avg_delta_high"] - ours.loc[32768, "avg_delta"] == pytest.approx(half, abs=1e-3)
    assert ours.loc[32768, "ci"] == "unpaired binomial" and ours.loc[32768, "verdict"] == "lower"
    view = main_view(t1, with_kv_memory=True)
    assert list(view.loc[view["row"].str.startswith("2-norm") & (view["seeds"] != ""), "tokens"]) == [
        "0",
        "8,192",
        "32,768",
    ]


def test_different_doc_samples_are_never_paired_and_a_seed_counts_once(tmp_path):
    _write(tmp_path, "ft", _record("finetuned_full_attention", avg=0.40, limit=100, n=100))
    _write(tmp_path, "mla_a", _record(avg=0.30))  # 50 docs: other docs than the FT's
    _write(tmp_path, "mla_b", _record(avg=0.30, train_probe=True))  # the same seed again (a probe run)
    _write(tmp_path, "mla_seed1", _record(seed=1, avg=0.34), seed=1)
    t1 = build_aggregate([tmp_path]).tables["table1"]
    mla = row(t1, d_kv=16, ours_model=OURS_135M)
    assert (mla["n_seeds"], mla["seeds"], mla["avg"]) == (2, "0,1", pytest.approx(32.0))
    assert mla["avg_seed_sd"] == pytest.approx(math.sqrt(8.0), abs=1e-4)
    assert pd.isna(mla["avg_delta"]) and mla["verdict"] == "no baseline"


def _passkey_rows(correct: dict[int, list[int]]) -> list[dict]:
    return [
        {
            "suite": "long_context",
            "column": f"passkey@{length}",
            "task": f"passkey_L{length}",
            "doc_id": i,
            "doc_hash": f"{length}-{i}",
            "acc": float(v),
        }
        for length, values in correct.items()
        for i, v in enumerate(values)
    ]


def _passkey_record(method, kv_quant=None, correct=None, tokens=0, grouping=None):
    lengths = sorted(correct)
    scores = {f"passkey@{L}": sum(v) / len(v) for L, v in correct.items()}
    scores["avg"] = sum(scores.values()) / len(scores)
    quant = (
        None
        if kv_quant is None
        else {
            "backend": kv_quant[0],
            "nbits": kv_quant[1],
            "residual_length": 128,
            **({"grouping": grouping} if grouping else {}),
        }
    )
    return {
        "run_name": f"{method}-{kv_quant}",
        "experiment": "kv",
        "status": "ok",
        "model": {"name": "smollm2-135m"},
        "variant": "mla" if method == "mla" else method,
        "mla": {"rope": "2-norm", "r": 4, "svd": "joint", "d_kv": 16} if method == "mla" else None,
        "kv_quant": quant,
        "kv": {"mem_change_pct": 0.0, "dtype": "float32", "bytes_per_token_measured": 46080},
        "train": {"tokens": tokens, "objective": "ce"} if tokens else None,
        "eval": {
            "long_context": scores,
            "kv_cache": {"bytes_per_token_measured": 1000.0 if quant else None},
            "meta": {
                "dtype": "float32",
                "long_context": {"lengths": lengths, "depths": [0.0, 0.5, 1.0], "samples_per_depth": 2, "seed": 1234},
            },
        },
    }


def test_table2_comes_from_the_run_records_with_paired_intervals(tmp_path):
    base = {1024: [1, 1, 1, 1, 0, 1], 2048: [1, 1, 1, 0, 1, 1]}
    int2 = {1024: [0, 0, 1, 0, 0, 0], 2048: [0, 1, 0, 0, 0, 0]}
    _write(tmp_path, "orig", _passkey_record("original", correct=base), rows=_passkey_rows(base))
    _write(tmp_path, "orig_hqq2", _passkey_record("original", ("hqq", 2), int2), rows=_passkey_rows(int2))
    _write(
        tmp_path,
        "orig_hqq4",
        _passkey_record("original", ("hqq", 4), base, grouping="tokens"),
        rows=_passkey_rows(base),
    )
    _write(tmp_path, "mla", _passkey_record("mla", correct=int2), rows=_passkey_rows(int2))
    short = {512: [1, 0, 1, 1, 1, 1]}  # other lengths: a row of its own, its Avg over its own length
    _write(tmp_path, "orig_short", _passkey_record("original", correct=short), rows=_passkey_rows(short))
    t2 = build_aggregate([tmp_path]).tables["table2"]
    ours = t2[(t2["n_seeds"] > 0) & t2["eval_sample"].str.startswith("lengths=[1024", na=False)]
    other = row(
        t2, method="original", kv_quant="unquantized", eval_sample="lengths=[512] depths=[0.0, 0.5, 1.0] x2 seed=1234"
    )
    assert other["avg"] == pytest.approx(100 * 5 / 6, abs=1e-3) and other["avg_low"] < other["avg"] < other["avg_high"]
    assert pd.isna(other["passkey@1024"]) and other["verdict"] == "reference"
    hqq2 = row(ours, method="original", kv_quant="Int2 HQQ")
    # by hand: the mean over lengths of the per-length mean differences
    by_hand = 100 * ((sum(int2[1024]) - sum(base[1024])) / 6 + (sum(int2[2048]) - sum(base[2048])) / 6) / 2
    assert hqq2["avg_delta"] == pytest.approx(by_hand, abs=1e-4) and hqq2["ci"] == "paired bootstrap"
    assert hqq2["avg_delta_low"] <= by_hand <= hqq2["avg_delta_high"] and hqq2["verdict"] == "lower"
    same = row(ours, method="original", kv_quant="Int4 HQQ")  # same answers on every doc: zero width
    assert (same["avg_delta"], same["avg_delta_low"], same["avg_delta_high"]) == (0.0, 0.0, 0.0)
    assert same["verdict"] == "not resolved" and same["kv_grouping"] == "tokens"
    assert row(ours, method="partial_rope+svd")["vs"] == "original"
    assert row(ours, method="original", kv_quant="unquantized")["verdict"] == "reference"
    assert ours["passkey@1024"].notna().all() and len(ours) == 4


# ---------------------------------------------------------------- runs, empty results, outputs
# ---------------------------------------------------------------- runs, empty results, outputs
def test_non_ok_runs_listed_with_status(written):
    runs = pd.read_csv(written[0] / "runs.csv")
    assert len(runs) == 12
    left_out = runs[~runs["in_tables"]].set_index("run_name")
    assert left_out["status"].to_dict() == {
        "smollm2-135m__2-norm-r4__joint-dkv32": "failed",
        "smollm2-135m__uniform-r8__partial": "diverged",
    }
    assert left_out.loc["smollm2-135m__2-norm-r4__joint-dkv32", "error"].startswith("RuntimeError")


def test_runs_not_ok_stay_out_even_with_scores(tmp_path):
    source = FIXTURES / "table1/smollm2-135m__2-norm-r4__joint-dkv16"
    for status in ("ok", "running", "diverged"):
        run = json.loads((source / "results.json").read_text())
        run["status"], run["eval"]["commonsense"]["avg"] = status, {"ok": 0.41, "running": 0.2, "diverged": 0.1}[status]
        (tmp_path / status).mkdir()
        (tmp_path / status / "results.json").write_text(json.dumps(run))
    agg = build_aggregate([tmp_path])
    cell = row(agg.tables["table1"], model="smollm2-135m", d_kv=16)  # no config.yaml: no paper name
    assert (cell["n_seeds"], cell["avg"]) == (1, 41.0)
    assert sorted(agg.runs["status"]) == ["diverged", "ok", "running"]


def test_unreadable_record_is_listed_not_fatal(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken/results.json").write_text('{"status": "ok", ')
    agg = build_aggregate([tmp_path])
    assert agg.runs["status"].tolist() == ["unreadable"]
    assert agg.tables["table1"]["n_seeds"].sum() == 0


def test_written_tables_keep_empty_cells_empty(agg, written):
    tmp_path = written[0]
    for name, table in agg.tables.items():
        csv = pd.read_csv(tmp_path / "tables" / f"{name}.csv")
        assert list(csv.columns) == list(table.columns)
        assert csv["avg_paper"].tolist() == pytest.approx(table["avg_paper"].astype(float).tolist(), nan_ok=True)
        for view in (name, f"{name}_tasks"):
            markdown = (tmp_path / "tables" / f"{view}.md").read_text()
            latex = (tmp_path / "tables" / f"{view}.tex").read_text()
            assert "nan" not in markdown.lower() and "<NA>" not in markdown and "None" not in markdown
            assert "\\begin{tabular}" in latex and "nan" not in latex.lower()
    lines = [
        [c.strip() for c in l.split("|")[1:-1]]
        for l in (tmp_path / "tables/table1.md").read_text().splitlines()
        if l.startswith("|")
    ]
    rows = [dict(zip(lines[0], l)) for l in lines[2:]]
    assert len(lines[0]) <= 14  # a table a reader takes in: not 24 columns
    dkv32 = next(r for r in rows if r["row"] == "2-norm r=4, joint SVD d_kv=32")
    assert (dkv32["Avg ±95%"], dkv32["paper Avg"], dkv32["paper Δ"], dkv32["seeds"]) == ("", "43.06", "−1.19", "")
    ft = next(r for r in rows if r["row"] == "FT full attention")
    assert (ft["tokens"], ft["seeds"], ft["Avg ±95%"], ft["vs"]) == ("500,000", "2 (sd 0.7)", "44.5", "original")


def test_latex_escapes_what_latex_reads_as_markup():
    # pandas' to_latex (jinja2) escapes; the hand-written fallback it replaced wrote a backslash as \\ (a line break)
    latex = to_latex(pd.DataFrame({"row": ["a\\b & 5% of x_1", "−1.2"]}))
    assert r"a\textbackslash b \& 5\% of x\_1" in latex and "-1.2" in latex
    assert r"a\\b" not in latex


def test_cli_with_no_runs_writes_paper_only_tables(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MHA2MLA_RESULTS", raising=False)
    assert main([]) == 0  # results/runs absent
    out = capsys.readouterr().out
    assert "no run records found" in out
    t1 = pd.read_csv(tmp_path / "results/aggregate/tables/table1.csv")
    assert len(t1) == 20 and t1["n_seeds"].eq(0).all() and t1["avg"].isna().all()
    assert t1["avg_paper"].notna().all()
    assert "our columns are empty" in (tmp_path / "results/aggregate/tables/table1.md").read_text()
    # the paper's points are drawn; a figure of ours only is not written, and the CLI says why
    assert (tmp_path / "results/aggregate/plots/kv_memory_vs_avg.png").stat().st_size > 0
    assert (tmp_path / "results/aggregate/plots/kv_memory_vs_avg.pdf").stat().st_size > 0
    for name in ("strategy_comparison", "loss_curves", "long_context_vs_length"):
        assert not (tmp_path / f"results/aggregate/plots/{name}.png").exists()
        assert f"figure {name} not drawn: " in out


def test_cli_on_run_dirs(written):
    out = written[1]
    assert "12 runs" in out and "1 failed" in out and "1 diverged" in out


# ---------------------------------------------------------------- plots
def series(ax) -> dict[str, tuple[list, list]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.lines
        if not line.get_label().startswith("_")
    }  # errorbar's own lines are labelled by their container


def test_kv_memory_plot_draws_the_paper_line(agg):
    (ax,) = [a for a in plots.kv_memory_vs_avg(agg.tables["table1"], runs=agg.runs).axes if a.get_visible()]
    assert ax.get_xlabel() == "KV cache memory (% of MHA)" and ax.get_ylabel() == plots.AVG_LABEL
    assert ax.get_title().startswith("135M SmolLM · 500,000 fine-tune tokens")  # only the models and budgets we ran
    lines = series(ax)
    assert lines == {"paper (2.25B tokens)": ([12.5, 18.75, 31.25, 100.0], [40.97, 41.84, 43.06, 44.25])}
    ours = {c.get_label(): list(c.lines[0].get_ydata()) for c in ax.containers}
    # the MLA sweep is one series; its full-attention baseline stands alone at 100 % (no line joins them)
    assert ours == {"ours": [39.5, 41.0], "ours: FT full attention": [44.5]}
    assert ax.get_legend() is not None and not ax.get_legend().get_bbox_to_anchor().overlaps(ax.bbox)
    paper_only = plots.kv_memory_vs_avg(agg.tables["table1"].assign(n_seeds=0))
    assert [a.get_title() for a in paper_only.axes if a.get_visible()][0] == "135M SmolLM\nno runs of ours"
    with pytest.raises(plots.NoData):
        plots.kv_memory_vs_avg(agg.tables["table1"].iloc[0:0])


def test_kv_memory_plot_one_panel_per_budget_with_whiskers(tmp_path):
    for tokens in (8192, 32768):
        _write(tmp_path, f"ft{tokens}", _record("finetuned_full_attention", tokens, avg=0.40))
        for d_kv, avg in ((16, 0.31), (8, 0.30)):
            _write(tmp_path, f"mla{tokens}_{d_kv}", _record(tokens=tokens, d_kv=d_kv, avg=avg + tokens / 1e6))
    agg = build_aggregate([tmp_path])
    figure = plots.kv_memory_vs_avg(agg.tables["table1"], runs=agg.runs)
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title().split("\n")[0] for ax in panels] == [
        f"135M SmolLM · {t:,} fine-tune tokens" for t in (8192, 32768)
    ]
    for ax, tokens in zip(panels, (8192, 32768)):
        (mla,) = [c for c in ax.containers if c.get_label() == "ours"]
        y = list(mla.lines[0].get_ydata())
        assert y == pytest.approx([100 * (0.30 + tokens / 1e6), 100 * (0.31 + tokens / 1e6)])  # x ascending
        whiskers = mla.lines[2][0].get_segments()
        assert len(whiskers) == 2 and all(seg[0][1] < yy < seg[1][1] for seg, yy in zip(whiskers, y))
    one = plots.kv_memory_vs_avg(agg.tables["table1"], budgets=[32768], runs=agg.runs)  # the notebook's parameter
    assert len([ax for ax in one.axes if ax.get_visible()]) == 1


def test_strategy_plot(agg):
    figure = plots.strategy_comparison(agg.tables["table3"], agg.runs)
    assert [ax.get_title() for ax in figure.axes] == [
        "135M SmolLM: commonsense Avg (Table 3)",  # 1B7 has no run of ours: no panel
        "135M SmolLM: held-out perplexity, same strategies (ours)",
    ]
    ax = figure.axes[0]
    assert ax.get_ylabel() == plots.AVG_LABEL
    strategies = [t.get_text() for t in ax.get_xticklabels()]
    assert strategies == [
        "high",
        "low",
        "uniform",
        "2-norm",
        "high+SVD joint",
        "uniform+SVD joint",
        "2-norm+SVD joint",
        "2-norm+SVD split",
    ]
    tops = {(round(p.get_x() + p.get_width() / 2, 1), round(p.get_y() + p.get_height(), 2)) for p in ax.patches}
    paper = [43.4, 37.76, 43.76, 43.77, 41.04, 41.77, 41.84, 40.92]
    assert {(round(i - 0.2, 1), h) for i, h in enumerate(paper)} <= tops
    assert {(0.2, 43.0), (6.2, 41.0), (7.2, 40.0)} <= tops  # ours beside the paper's, where we ran them
    not_run = sorted(round(t.get_position()[0], 1) for t in ax.texts if t.get_text() == "not run")
    assert not_run == [1.2, 2.2, 3.2, 4.2, 5.2]  # never a silently missing bar
    assert "paper: FT full attention" in ax.get_legend_handles_labels()[1]
    with pytest.raises(plots.NoData):
        plots.strategy_comparison(agg.tables["table3"].assign(n_seeds=0), agg.runs)


def test_loss_curve_plot(agg):
    figure = plots.loss_curves(agg.curves, agg.runs)
    panels = {ax.get_title().split(" · ")[0]: ax for ax in figure.axes if ax.get_visible()}
    assert set(panels) == {"table1", "table3", "table5"}  # one per experiment
    ax = panels["table1"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("fine-tuning tokens", "training loss")
    lines = {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}
    mean = lines["FT full attention (mean of 2)"]
    assert list(mean.get_xdata()) == [125000, 250000, 375000, 500000]
    assert list(mean.get_ydata()) == pytest.approx([3.1, 2.9, 2.8, 2.7])  # a short curve: nothing to smooth
    raw = [line for line in ax.lines if line.get_alpha() == 0.2]
    assert len(raw) == len(lines)  # the raw curve faint behind each
    diverged = [line for line in panels["table5"].lines if line.get_linestyle() == "--"]
    assert [line.get_label() for line in diverged] == ["uniform r=8, 375,000 tokens [diverged]"]
    assert list(diverged[0].get_ydata()) == pytest.approx([3.5, 7.9, 12.4])  # 3 steps: too few to smooth
    with pytest.raises(plots.NoData):
        plots.loss_curves(agg.curves.iloc[0:0], agg.runs)


def test_long_context_plot(agg):
    ax = plots.long_context_vs_length(agg.runs).axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("context length (tokens)", "long-context score (%)")
    assert ax.get_xscale() == "log"
    lines = series(ax)
    assert set(lines) == {
        "smollm2-135m: original",
        "smollm2-135m: FT full attention (mean of 2)",
        "smollm2-135m: MLA 2-norm r=4 joint d_kv=16",
    }
    assert lines["smollm2-135m: FT full attention (mean of 2)"] == (
        [256, 512, 1024],
        pytest.approx([100.0, 100.0, 95.0]),
    )
    assert lines["smollm2-135m: MLA 2-norm r=4 joint d_kv=16"][1] == pytest.approx([100.0, 80.0, 40.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "512", "1024"]
    with pytest.raises(plots.NoData):
        plots.long_context_vs_length(agg.runs[agg.runs["method"] == "none"])


def test_plots_saved_as_png_and_pdf(written):
    tmp_path = written[0]
    files = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert files == [
        f"{name}.{ext}"
        for name in (
            "budget_vs_transmla",
            "kv_memory_vs_avg",
            "long_context_vs_length",
            "loss_curves",
            "recovery_curves",
            "recovery_study_curves",
            "strategy_comparison",
            "teacher_recovery_curves",
        )
        for ext in ("pdf", "png")
    ]
    assert all(p.stat().st_size > 1000 for p in (tmp_path / "plots").iterdir())
    assert (tmp_path / "plots/loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plots/loss_curves.pdf").read_bytes()[:4] == b"%PDF"


# ---------------------------------------------------------------- W&B
class _FakeRun:
    def __init__(self, name, state, config, summary):
        self.name, self.state, self.config, self.url = name, state, config, f"https://wandb.ai/e/p/runs/{name}"
        self.summary = type("Summary", (), {"_json_dict": {**summary, "_step": 40, "_wandb": {"runtime": 9}}})()


class _FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def runs(self, project):
        assert project == "e/p"
        return self._runs


def test_wandb_runs_join_the_tables():
    # shaped like the runner's W&B logging: the resolved Hydra config, a slash-keyed summary without `mla`
    config = {
        "model": {"name": "smollm2-135m", "paper_name": "135M SmolLM", "shape": {"head_dim": 64}},
        "variant": "mla",
        "seed": 0,
        "rope": {"strategy": "2-norm", "r": None, "score": "product"},
        "svd": {"method": "joint", "d_kv": 32, "sigma": "up", "init": "weight"},
        "kv_quant": {"backend": None, "nbits": None, "residual_length": 128},
    }
    summary = {
        "status": "ok",
        "kv/mem_change_pct": -68.75,
        "train/tokens": 500000,
        "train/objective": "ce",
        "eval/commonsense/avg": 0.42,
        "eval/commonsense/mmlu": 0.3,
        "eval/commonsense/limit": 200,
    }
    crashed = {"mla": {"rope": "2-norm", "r": 4, "svd": "joint", "d_kv": 8}}  # nested form, no status
    api = _FakeApi([_FakeRun("a", "finished", config, summary), _FakeRun("b", "crashed", config, crashed)])
    agg = build_aggregate([FIXTURES], wandb_project="e/p", wandb_api=api)
    cell = row(agg.tables["table1"], model="135M SmolLM", d_kv=32)
    assert (cell["n_seeds"], cell["avg"], cell["avg_delta"], cell["mmlu"]) == (1, 42.0, -2.5, 30.0)
    assert cell["r"] == 4  # rope.r: null resolved to d_h/16
    runs = agg.runs.set_index("run_name")
    assert runs.loc["b", "status"] == "failed" and runs.loc["b", "d_kv"] == 8
    assert "config.seed" in agg.records and "_step" not in agg.records


def test_non_default_options_are_a_row_of_their_own(tmp_path):
    source = FIXTURES / "table1/smollm2-135m__2-norm-r4__joint-dkv16"
    for name, score, avg in (("product", "product", 0.41), ("sum", "sum", 0.42)):
        run = json.loads((source / "results.json").read_text())
        run["mla"]["score"], run["eval"]["commonsense"]["avg"] = score, avg
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run))
        (tmp_path / name / "config.yaml").write_text((source / "config.yaml").read_text())
    agg = build_aggregate([tmp_path])
    t1 = agg.tables["table1"]
    rows = t1[(t1["model"] == "135M SmolLM") & (t1["d_kv"] == 16)]
    assert rows["options"].isna().tolist() == [True, False] and rows["options"].iloc[1] == "score=sum"
    assert rows["avg"].tolist() == [41.0, 42.0] and rows["avg_paper"].tolist() == [41.84, 41.84]
    assert sorted(agg.runs["label"]) == [
        "smollm2-135m: MLA 2-norm r=4 joint d_kv=16",
        "smollm2-135m: MLA 2-norm r=4 joint d_kv=16 (score=sum)",
    ]


# ---------------------------------------------------------------- comparisons: pairwise, dtype check
def _commonsense_rows(answers: dict[str, list[int]], gold: int = 0) -> list[dict]:
    """Per-doc rows: `answers[column]` the scored choice per doc (correct when equal to `gold`)."""
    rows = []
    for column, chosen in answers.items():
        metric = "acc" if column == "winogrande" else "acc_norm"
        for i, choice in enumerate(chosen):
            rows.append(
                {
                    "suite": "commonsense",
                    "column": column,
                    "task": column,
                    "doc_id": i,
                    "doc_hash": f"{column}{i}",
                    "gold": gold,
                    "pred": choice,
                    "pred_norm": choice,
                    metric: float(choice == gold),
                }
            )
    return rows


def _scores_of(answers):
    scores = {c: sum(v == 0 for v in a) / len(a) for c, a in answers.items()}
    scores["arc"] = (scores["arc_easy"] + scores["arc_challenge"]) / 2
    scores["avg"] = sum(scores[c] for c in ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande")) / 6
    return scores


def _recovery_runs(root: Path, runs: dict, n: int) -> pd.DataFrame:
    """Write teacher_recovery records, `runs`: name -> (method, tokens, d_kv, objective, on the teacher's text,
    correct docs of n in every column (the first ones), eval dtype[, seed]); the aggregate's runs frame of them."""
    for name, (method, tokens, d_kv, objective, teacher, correct, dtype, *seed) in runs.items():
        answers = {c: [0] * correct + [1] * (n - correct) for c in PARTS}
        record = _record(method, tokens, d_kv=d_kv, n=n) | {"experiment": "teacher_recovery", "run_name": name}
        record["eval"]["commonsense"].update(_scores_of(answers))
        record["eval"]["meta"]["dtype"] = dtype
        if objective:
            record["train"]["objective"] = objective
        if teacher:
            record["train_data"] = {"name": "teacher-samples", "source": "teacher"}
        _write(root, name, record, seed=seed[0] if seed else 0, rows=_commonsense_rows(answers))
    return build_aggregate([root]).runs


def test_recovery_grid_pairs_each_recovery_with_the_original_and_names_the_controls(tmp_path):
    """A row per fine-tuned run, its Avg − original paired on the same docs; a control (more tokens than its
    recovery's usual budget) says what differs; a run scored in another dtype is not paired; the plot draws a
    panel per KV saving and the control hollow."""
    from mha2mla_exp.aggregate.recovery_study import recovery_grid

    n = 20
    runs = {  # name: (method, tokens, d_kv, objective, on the teacher's text, correct docs of 20, eval dtype)
        "original": ("original", 0, 16, None, False, 16, "float32"),
        "ce_sotu": ("mla", 8192, 16, "ce", False, 10, "float32"),
        "ce_sotu_short": ("mla", 4096, 16, "ce", False, 9, "float32"),  # one of each on SOTU: ce's budget decides
        "ce_teacher": ("mla", 8192, 16, "ce", True, 12, "float32"),
        "ce_teacher_again": ("mla", 8192, 32, "ce", True, 14, "float32"),
        "ce_teacher_long": ("mla", 16384, 16, "ce", True, 13, "float32"),
        "kd_teacher": ("mla", 8192, 16, "kd", True, 11, "float32"),
        "kd_teacher_bf16": ("mla", 8192, 16, "kd", True, 11, "bfloat16"),
    }
    grid = recovery_grid(_recovery_runs(tmp_path, runs, n), "teacher_recovery")
    grid = grid.assign(delta=grid["delta"].round(6)).set_index("delta")
    # every column answered alike: Avg − original = (correct − 16) / 20 in points
    assert sorted(grid.index) == pytest.approx([-35.0, -30.0, -25.0, -20.0, -15.0, -10.0])
    assert grid.loc[-30.0, "recovery"] == "ce on sotu" and grid.loc[-25.0, "recovery"] == "kd on teacher-samples"
    assert (grid["recovery"] == "ce on teacher-samples").sum() == 3
    assert grid.loc[-15.0, "differs"] == "16,384 tokens"  # the controls, named
    assert grid.loc[-35.0, "differs"] == "4,096 tokens"
    assert (grid.drop(index=[-15.0, -35.0])["differs"] == "").all()
    assert sorted(grid["kv saving %"].unique()) == [-81.25, -68.75]
    assert (grid["high"] > grid.index).all() and (grid["low"] < grid.index).all()  # a paired interval each
    figure = plots.recovery_grid(grid.reset_index(), "t", -2.0)
    assert [ax.get_title(loc="left") for ax in figure.axes[:2]] == ["KV cache -68.75 %", "KV cache -81.25 %"]
    hollow = [line for ax in figure.axes for line in ax.lines if line.get_markerfacecolor() == "white"]
    assert sorted(line.get_xdata()[0] for line in hollow if len(line.get_xdata())) == pytest.approx([-35.0, -15.0])


def test_recovery_grid_takes_the_seeds_of_a_cell_as_one_row_on_their_per_document_mean(tmp_path):
    from mha2mla_exp.aggregate.recovery_study import recovery_grid

    n = 20
    runs = {
        "original": ("original", 0, 16, None, False, 16, "float32"),
        "kd_s0": ("mla", 8192, 16, "kd", True, 11, "float32", 0),
        "kd_s1": ("mla", 8192, 16, "kd", True, 13, "float32", 1),
        "ce": ("mla", 8192, 16, "ce", True, 14, "float32"),
    }
    grid = recovery_grid(_recovery_runs(tmp_path, runs, n), "teacher_recovery").set_index("recovery")
    assert len(grid) == 2
    assert grid.loc["kd on teacher-samples", "seeds"] == 2 and grid.loc["ce on teacher-samples", "seeds"] == 1
    assert grid.loc["kd on teacher-samples", "delta"] == pytest.approx((12 - 16) / n * 100)  # the seeds' mean, 12 docs


def test_recovery_matrix_lays_the_usual_recipes_out_as_conversion_by_recovery():
    """A cell per (saving, conversion) x recovery; a control is left to the grid; twins in two training precisions
    share their cell, each named; a cell of several seeds says how many; a combination not run is an empty cell."""
    from mha2mla_exp.aggregate.recovery_study import recovery_matrix

    def row(saving, conversion, recovery, delta, precision="fp32", differs="", seeds=1):
        return {
            "kv saving %": saving,
            "conversion": conversion,
            "recovery": recovery,
            "delta": delta,
            "low": delta - 1.5,
            "high": delta + 1.5,
            "resolved": abs(delta) > 1.5,
            "precision": precision,
            "differs": differs,
            "seeds": seeds,
            "run_dir": f"{conversion}/{recovery}/{precision}/{differs}",
        }

    grid = pd.DataFrame(
        [
            row(-81.25, "a", "ce on sotu", -6.6),
            row(-81.25, "a", "ce on teacher", -4.7),
            row(-81.25, "a", "ce on teacher", -5.1, precision="bf16-autocast"),
            row(-81.25, "a", "ce on teacher", -5.7, differs="1,536,000 tokens"),
            row(-68.75, "b", "kd on teacher", -1.0),
            row(-68.75, "b", "ce on teacher", -2.0, seeds=2),
        ]
    )
    matrix = recovery_matrix(grid).set_index(["kv saving %", "conversion"])
    assert list(matrix.index) == [(-68.75, "b"), (-81.25, "a")]
    assert matrix.loc[(-81.25, "a"), "ce on sotu"] == "-6.6 [-8.1, -5.1]"
    assert matrix.loc[(-81.25, "a"), "ce on teacher"] == "-4.7 [-6.2, -3.2] (fp32) / -5.1 [-6.6, -3.6] (bf16-autocast)"
    assert matrix.loc[(-68.75, "b"), "kd on teacher"] == "-1.0 [-2.5, +0.5] n.r."
    assert matrix.loc[(-68.75, "b"), "ce on teacher"] == "-2.0 [-3.5, -0.5] (2 seeds)"
    assert matrix.loc[(-68.75, "b"), "ce on sotu"] == "" and matrix.loc[(-81.25, "a"), "kd on teacher"] == ""


def test_recovery_interactions_difference_an_ingredients_gain_between_two_rows_on_the_same_docs(tmp_path):
    """kd − ce and teacher − SOTU at each of two conversions and their difference, paired: every run answers the
    first k docs of 20 right, so each gain is (k1 − k0) / 20 and the interaction the difference of two such; a
    control (more tokens) never stands in for its recovery's cell."""
    from mha2mla_exp.aggregate.recovery_study import recovery_grid, recovery_interactions

    n = 20
    runs = {
        "original": ("original", 0, 16, None, False, 16, "float32"),
        "s81_ce_sotu": ("mla", 8192, 16, "ce", False, 10, "float32"),
        "s81_ce_teacher": ("mla", 8192, 16, "ce", True, 12, "float32"),
        "s81_kd_teacher": ("mla", 4096, 16, "kd", True, 11, "float32"),
        "s81_kd_teacher_long": ("mla", 16384, 16, "kd", True, 19, "float32"),  # a control
        "s69_ce_sotu": ("mla", 8192, 32, "ce", False, 10, "float32"),
        "s69_ce_teacher": ("mla", 8192, 32, "ce", True, 14, "float32"),
        "s69_kd_teacher": ("mla", 4096, 32, "kd", True, 15, "float32"),
    }
    frame = _recovery_runs(tmp_path, runs, n)
    table = recovery_interactions(frame, "teacher_recovery", recovery_grid(frame, "teacher_recovery"))
    table = table.set_index("contrast")
    assert sorted(table.index) == [
        "objective: kd on teacher-samples − ce on teacher-samples",
        "text: ce on teacher-samples − ce on sotu",
    ]
    kd = table.loc["objective: kd on teacher-samples − ce on teacher-samples"]
    assert (kd["kv saving % (a)"], kd["kv saving % (b)"]) == (-68.75, -81.25)  # the smaller saving first
    assert kd["at a"].startswith("+5.0 [") and kd["at b"].startswith("-5.0 [")
    assert kd["estimate"] == pytest.approx(10.0) and kd["low"] <= 10.0 <= kd["high"]  # (15 − 14) − (11 − 12)
    text = table.loc["text: ce on teacher-samples − ce on sotu"]
    assert text["at a"].startswith("+20.0") and text["at b"].startswith("+10.0")  # 14 − 10 and 12 − 10 docs
    assert text["estimate"] == pytest.approx(10.0)
    assert text["training precisions"] == kd["training precisions"]


def test_dtype_check_counts_agreeing_answers_and_pairs_the_scores(tmp_path):
    columns = PARTS
    fp32 = {c: [i % 3 for i in range(30)] for c in columns}
    bf16 = {c: list(v) for c, v in fp32.items()}
    bf16["piqa"][:3] = [1, 0, 0]  # docs 1 and 2 flip to correct, doc 0 to wrong: 3 of 210 answers differ
    for dtype, answers in (("float32", fp32), ("bfloat16", bf16)):
        record = _record("original", 0, n=30)
        record["eval"]["commonsense"].update(_scores_of(answers))
        record["eval"]["meta"]["dtype"] = dtype
        _write(tmp_path, dtype, record, rows=_commonsense_rows(answers))
    agg = build_aggregate([tmp_path])
    check = comparisons.dtype_check(agg.runs).iloc[0]
    assert (check["dtype"], check["same answers"], check["docs"]) == ("BF16", 207, 210)
    assert check["piqa same %"] == pytest.approx(100 * 27 / 30) and check["mmlu same %"] == 100.0
    assert check["avg_delta"] == pytest.approx(100 * (1 / 30) / 6, abs=1e-4)  # one more correct PIQA doc
    # two dtypes are two rows of Table 1, never merged
    assert sorted(agg.tables["table1"].query("n_seeds > 0")["eval_dtype"]) == ["BF16", "FP32"]


def test_pairwise_compares_every_pair_on_the_same_docs(tmp_path):
    columns = PARTS
    answers = {
        "original": {c: [0] * 20 for c in columns},
        "finetuned_full_attention": {c: [0] * 18 + [1, 1] for c in columns},
        "mla": {c: [0] * 10 + [1] * 10 for c in columns},
    }
    for method, a in answers.items():
        record = _record(method, 0 if method == "original" else 32768, n=20) | {"experiment": "headline"}
        record["eval"]["commonsense"].update(_scores_of(a))
        _write(tmp_path, method, record, rows=_commonsense_rows(a))
    pairs = comparisons.pairwise(build_aggregate([tmp_path]).runs, "headline").set_index(["B", "A"])
    assert len(pairs) == 3
    mla_vs_ft = pairs.loc[("2-norm r=4, joint SVD d_kv=16 @ 32,768 tokens", "FT full attention @ 32,768 tokens")]
    assert mla_vs_ft["avg_delta"] == pytest.approx(-40.0) and mla_vs_ft["verdict"] == "B lower"
    assert mla_vs_ft["ci"] == "paired bootstrap" and mla_vs_ft["avg_delta_high"] < 0
    ft_vs_original = pairs.loc[("FT full attention @ 32,768 tokens", "original")]
    assert ft_vs_original["avg_delta"] == pytest.approx(-10.0)
    # the forest plot against the original: one bar per row paired with it, best on top, the goal line
    figure = plots.score_deltas_vs(pairs.reset_index(), "original", "t", target=-2.0)
    ax = figure.axes[0]
    assert [t.get_text().split(" @")[0] for t in ax.get_yticklabels()] == [
        "FT full attention",
        "2-norm r=4, joint SVD d_kv=16",
    ]
    points = [line.get_xdata()[0] for line in ax.lines if line.get_marker() == "o" and len(line.get_xdata())]
    assert points == pytest.approx([-10.0, -50.0])
    assert -2.0 in [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--"]


def test_rows_recovered_on_their_own_text_are_plotted_against_its_held_out_perplexity(tmp_path):
    columns = PARTS
    answers = {
        "original": ({c: [0] * 20 for c in columns}, None),
        "finetuned_full_attention": ({c: [0] * 18 + [1, 1] for c in columns}, 12.0),
        "mla": ({c: [0] * 10 + [1] * 10 for c in columns}, 20.0),
    }
    for method, (a, ppl) in answers.items():
        record = _record(method, 0 if method == "original" else 32768, n=20) | {"experiment": "teacher_recovery"}
        record["eval"]["commonsense"].update(_scores_of(a))
        if ppl is not None:  # recovered on a text of its own: its held-out perplexity on that text is recorded
            record["train_data"] = {"name": "teacher-samples", "source": "teacher"}
            record["eval"]["perplexity"] = {"heldout": 50.0, "heldout:teacher-samples": ppl}
        _write(tmp_path, method, record, rows=_commonsense_rows(a))
    pairs = comparisons.pairwise(build_aggregate([tmp_path]).runs, "teacher_recovery")
    against_original = pairs[pairs["A"] == "original"].set_index("B")["B recovery text ppl"]
    assert sorted(against_original) == [12.0, 20.0]
    figure = plots.scores_vs_recovery_ppl(pairs, "original", "t")
    avg_panel, hs_panel = figure.axes[0], figure.axes[1]
    assert "Avg" in avg_panel.get_title() and "HS" in hs_panel.get_title()
    (points,) = [line for line in avg_panel.lines if line.get_marker() == "o"]
    assert list(points.get_xdata()) == [12.0, 20.0]  # sorted by the perplexity
    assert list(points.get_ydata()) == pytest.approx([-10.0, -50.0])  # each row's paired delta to the original
    assert avg_panel.get_xscale() == "log"


def test_zero_shot_table_orders_by_kv_memory_and_divides_by_the_original(tmp_path):
    from mha2mla_exp.aggregate.pipeline import write_aggregate
    from mha2mla_exp.aggregate.zero_shot import zero_shot_table

    def zero_shot(name, variant, ppl, mla=None, kv=0.0, tokens=None):
        record = {
            "run_name": name,
            "experiment": "rorope_zero_shot",
            "status": "ok",
            "model": {"name": "smollm2-135m"},
            "variant": variant,
            "mla": mla,
            "kv_quant": None,
            "kv": {"mem_change_pct": kv, "dtype": "float32"},
            "train": {"tokens": tokens, "objective": "ce"} if tokens else None,
            "eval": {"perplexity": {"heldout": ppl}},
        }
        _write(tmp_path, name, record)

    zero_shot("orig", "original", 30.0)
    zero_shot("a", "partial_rope", 60.0, {"rope": "2-norm", "r": 4, "svd": "none"})
    zero_shot("b", "partial_rope", 45.0, {"rope": "rorope", "r": 4, "svd": "none"})
    zero_shot("c", "partial_rope+svd", 90.0, {"rope": "rorope", "r": 4, "svd": "joint", "d_kv": 16}, kv=-81.25)
    zero_shot("trained", "partial_rope", 40.0, {"rope": "2-norm", "r": 4, "svd": "none"}, tokens=1024)
    agg = build_aggregate([tmp_path])
    table = zero_shot_table(agg.runs, "rorope_zero_shot")
    assert list(table["RoPE"]) == ["original", "rorope r=4", "2-norm r=4", "rorope r=4"]  # fine-tuned run left out
    assert list(table["× original"]) == [1.0, 1.5, 2.0, 3.0]
    assert list(table["KV memory"])[-1] == "-81.25 %"
    assert (tmp_path / "out" / "tables" / "rorope_zero_shot.md") in write_aggregate(agg, tmp_path / "out")


def test_labels_name_a_kv_budget_and_the_teacher_set_they_recovered_on():
    """Two recoveries that differ only in the teacher set's size, or in the KV budget, must not read alike."""
    from mha2mla_exp.aggregate.records import flatten, train_data_label
    from mha2mla_exp.aggregate.render import row_label

    def teacher(train, held_out):
        return flatten(
            {
                "train_data": {
                    "name": "teacher-samples",
                    "source": "teacher",
                    "documents": {"train": train, "held_out": held_out},
                }
            }
        )

    assert train_data_label(teacher(1949, 99)) == "teacher-samples (2,048 samples)"
    assert train_data_label(teacher(5834, 310)) == "teacher-samples (6,144 samples)"
    assert train_data_label(flatten({"train_data": {"name": "sotu", "documents": {"train": 200}}})) == "sotu"
    assert train_data_label({}) is None
    budget = {"method": "mla", "rope": "rorope", "svd": "joint", "r": None, "d_kv": None}
    assert (
        row_label({**budget, "kv_elements": 72, "rope_dims": "32"})
        == "rorope + joint SVD, 72 KV elements (rope dims 32)"
    )
    assert row_label({**budget, "kv_elements": 120, "rope_dims": "46"}) != row_label(
        {**budget, "kv_elements": 72, "rope_dims": "32"}
    )
    assert row_label({**budget, "r": 4, "d_kv": 16}) == "rorope r=4, joint SVD d_kv=16"
