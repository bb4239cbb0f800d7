"""The aggregation on hand-written run directories (tests/fixtures/runs): exact table cells, plots, outputs."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from mha2mla_exp.aggregate import build_aggregate
from mha2mla_exp.aggregate import plots
from mha2mla_exp.aggregate.__main__ import main
from mha2mla_exp.aggregate.reference import paper_commonsense, paper_longbench
from mha2mla_exp.aggregate.render import to_markdown

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
OURS_135M = "smollm2-135m"


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
    cols = ["ours_model", "n_runs", "kv_mem_change_pct_ours", "kv_mem_change_pct_paper", "avg_ours", "avg_paper",
            "avg_delta_ours", "avg_delta_paper", "mmlu_ours", "mmlu_paper", "winogrande_ours", "winogrande_paper"]
    m = "135M SmolLM"
    assert cells(row(t1, model=m, method="original"), cols) == {
        "ours_model": OURS_135M, "n_runs": 1, "kv_mem_change_pct_ours": 0.0, "kv_mem_change_pct_paper": None,
        "avg_ours": 44.5, "avg_paper": 44.5, "avg_delta_ours": 0.0, "avg_delta_paper": 0.25,
        "mmlu_ours": 30.0, "mmlu_paper": 29.8, "winogrande_ours": 52.0, "winogrande_paper": 52.01}
    # two seeds of the same configuration -> their mean, counted
    assert cells(row(t1, model=m, method="finetuned_full_attention"), cols) == {
        "ours_model": OURS_135M, "n_runs": 2, "kv_mem_change_pct_ours": 0.0, "kv_mem_change_pct_paper": None,
        "avg_ours": 44.5, "avg_paper": 44.25, "avg_delta_ours": None, "avg_delta_paper": None,
        "mmlu_ours": 30.0, "mmlu_paper": 29.82, "winogrande_ours": 52.0, "winogrande_paper": 51.07}
    assert row(t1, model=m, method="finetuned_full_attention")["train_tokens_ours"] == 500000
    assert cells(row(t1, model=m, d_kv=16), cols) == {
        "ours_model": OURS_135M, "n_runs": 1, "kv_mem_change_pct_ours": -81.25, "kv_mem_change_pct_paper": -81.25,
        "avg_ours": 41.0, "avg_paper": 41.84, "avg_delta_ours": -3.5, "avg_delta_paper": -2.41,
        "mmlu_ours": 28.0, "mmlu_paper": 28.66, "winogrande_ours": 50.0, "winogrande_paper": 49.8}
    assert cells(row(t1, model=m, d_kv=8), ["avg_ours", "avg_paper", "avg_delta_ours", "avg_delta_paper",
                                            "kv_mem_change_pct_ours"]) == {
        "avg_ours": 39.5, "avg_paper": 40.97, "avg_delta_ours": -5.0, "avg_delta_paper": -3.28,
        "kv_mem_change_pct_ours": -87.5}


def test_table1_failed_run_leaves_its_cells_empty(agg):
    cell = row(agg.tables["table1"], model="135M SmolLM", d_kv=32)
    assert cell["n_runs"] == 0 and pd.isna(cell["ours_model"])
    assert all(pd.isna(cell[c]) for c in cell.index if c.endswith("_ours"))
    assert (cell["avg_paper"], cell["avg_delta_paper"]) == (43.06, -1.19)


def test_table1_layout_and_paper_numbers_untouched(agg):
    t1 = agg.tables["table1"]
    paper = paper_commonsense().query("table == 1")
    assert list(t1["model"].drop_duplicates()) == ["135M SmolLM", "360M SmolLM", "1B7 SmolLM", "7B Llama2"]
    assert len(t1) == len(paper) == 20          # every paper row once, ours matched onto them
    assert t1["avg_paper"].tolist() == paper["avg"].tolist()
    assert row(t1, model="7B Llama2", d_kv=64)["r"] == 8    # the paper's r = d_h/16 with d_h = 128
    assert list(t1.columns[:9]) == ["model", "ours_model", "method", "rope", "r", "svd", "d_kv", "options", "n_runs"]
    # 360M runs have only LongBench results: they must not appear as empty Table 1 rows
    assert (t1["ours_model"] == "smollm2-360m").sum() == 0


# ---------------------------------------------------------------- Table 2
def test_table2_longbench_by_precision(agg):
    t2 = agg.tables["table2"]
    cols = ["n_runs", "kv_mem_change_pct_ours", "kv_mem_change_pct_paper", "avg_ours", "avg_paper",
            "avg_delta_ours", "avg_delta_paper", "narrativeqa_ours", "narrativeqa_paper", "hotpotqa_ours",
            "hotpotqa_paper"]
    m = "360M SmolLM"
    assert cells(row(t2, model=m, method="original", precision="BF16"), cols) == {
        "n_runs": 1, "kv_mem_change_pct_ours": 0.0, "kv_mem_change_pct_paper": 0.0, "avg_ours": 12.0,
        "avg_paper": 13.5, "avg_delta_ours": None, "avg_delta_paper": None, "narrativeqa_ours": 2.0,
        "narrativeqa_paper": 2.4, "hotpotqa_ours": None, "hotpotqa_paper": 5.0}
    assert cells(row(t2, model=m, method="original", precision="Int4 HQQ"), cols) == {
        "n_runs": 1, "kv_mem_change_pct_ours": -73.44, "kv_mem_change_pct_paper": -75.0, "avg_ours": 11.0,
        "avg_paper": 13.4, "avg_delta_ours": -1.0, "avg_delta_paper": -0.1, "narrativeqa_ours": 2.0,
        "narrativeqa_paper": 2.7, "hotpotqa_ours": None, "hotpotqa_paper": 5.5}
    quanto = row(t2, model=m, method="original", precision="Int4 Quanto")
    assert quanto["n_runs"] == 0 and pd.isna(quanto["avg_ours"]) and quanto["avg_delta_paper"] == -0.2
    assert len(t2[t2["n_runs"] == 0]) == len(paper_longbench()) - 2


def test_table2_carries_our_long_context_probe(agg):
    t2 = agg.tables["table2"]
    ours = t2[t2["ours_model"] == OURS_135M].set_index("method")
    assert ours["long_context_avg_ours"].to_dict() == {
        "original": 90.0, "finetuned_full_attention": 98.34, "partial_rope+svd": 73.33}
    assert ours.loc["finetuned_full_attention", "n_runs"] == 2
    assert ours["avg_paper"].isna().all()       # the paper has no 135M LongBench rows


# ---------------------------------------------------------------- Tables 3 and 5
def test_table3_strategies(agg):
    t3 = agg.tables["table3"]
    cols = ["n_runs", "avg_ours", "avg_paper", "avg_delta_ours", "avg_delta_paper", "arc_ours", "arc_paper"]
    m = "135M SmolLM"
    assert cells(row(t3, model=m, method="partial_rope", rope="high"), cols) == {
        "n_runs": 1, "avg_ours": 43.0, "avg_paper": 43.4, "avg_delta_ours": -1.5, "avg_delta_paper": -0.85,
        "arc_ours": 41.0, "arc_paper": 41.15}
    assert cells(row(t3, model=m, method="partial_rope+svd", rope="2-norm", svd="split"), cols) == {
        "n_runs": 1, "avg_ours": 40.0, "avg_paper": 40.92, "avg_delta_ours": -4.5, "avg_delta_paper": -3.33,
        "arc_ours": 37.0, "arc_paper": 37.85}
    assert cells(row(t3, model=m, method="partial_rope+svd", rope="2-norm", svd="joint"), cols)["avg_delta_ours"] == -3.5
    # the low-r Table 5 run and the d_kv=8 Table 1 run are not Table 3 configurations
    assert set(t3.loc[t3["n_runs"] > 0, "rope"]) == {"full", "high", "2-norm"}
    assert len(t3) == len(paper_commonsense().query("table == 3"))


def test_table5_r_ablation(agg):
    t5 = agg.tables["table5"]
    cols = ["n_runs", "avg_ours", "avg_paper", "avg_delta_ours", "avg_delta_paper"]
    m = "135M SmolLM"
    full = row(t5, model=m, method="finetuned_full_attention")
    assert (full["r"], full["n_runs"], full["avg_ours"], full["avg_paper"]) == (32, 2, 44.5, 44.25)
    assert cells(row(t5, model=m, rope="low", r=2), cols) == {
        "n_runs": 1, "avg_ours": 38.0, "avg_paper": 37.94, "avg_delta_ours": -6.5, "avg_delta_paper": -6.31}
    diverged = row(t5, model=m, rope="uniform", r=8)
    assert diverged["n_runs"] == 0 and pd.isna(diverged["avg_ours"])
    assert list(t5["rope"].iloc[:2]) == ["full", "none"]


def test_runs_not_in_the_paper_get_their_own_row(tmp_path):
    run = json.loads((FIXTURES / "table3/smollm2-135m__2-norm-r4__split-dkv16/results.json").read_text())
    run["mla"]["svd"], run["mla"]["rope"] = "joint", "low"      # low + SVD: Table 3 never printed it
    (tmp_path / "x").mkdir()
    (tmp_path / "x/results.json").write_text(json.dumps(run))
    (tmp_path / "x/config.yaml").write_text("model: {paper_name: 135M SmolLM}\n")
    t3 = build_aggregate([tmp_path]).tables["table3"]
    extra = row(t3, model="135M SmolLM", rope="low", svd="joint")
    assert (extra["n_runs"], extra["avg_ours"]) == (1, 40.0) and pd.isna(extra["avg_paper"])
    assert extra.name == t3.index[t3["model"] == "135M SmolLM"].max()   # after the model's paper rows
    assert pd.isna(extra["avg_delta_ours"])     # no fine-tuned baseline among these runs: no delta guessed


# ---------------------------------------------------------------- runs, empty results, outputs
def test_non_ok_runs_listed_with_status(written):
    runs = pd.read_csv(written[0] / "runs.csv")
    assert len(runs) == 12
    left_out = runs[~runs["in_tables"]].set_index("run_name")
    assert left_out["status"].to_dict() == {"smollm2-135m__2-norm-r4__joint-dkv32": "failed",
                                           "smollm2-135m__uniform-r8__partial": "diverged"}
    assert left_out.loc["smollm2-135m__2-norm-r4__joint-dkv32", "error"].startswith("RuntimeError")


def test_runs_not_ok_stay_out_even_with_scores(tmp_path):
    source = FIXTURES / "table1/smollm2-135m__2-norm-r4__joint-dkv16"
    for status in ("ok", "running", "diverged"):
        run = json.loads((source / "results.json").read_text())
        run["status"], run["eval"]["commonsense"]["avg"] = status, {"ok": 0.41, "running": 0.2, "diverged": 0.1}[status]
        (tmp_path / status).mkdir()
        (tmp_path / status / "results.json").write_text(json.dumps(run))
    agg = build_aggregate([tmp_path])
    cell = row(agg.tables["table1"], model="smollm2-135m", d_kv=16)    # no config.yaml: no paper name
    assert (cell["n_runs"], cell["avg_ours"]) == (1, 41.0)
    assert sorted(agg.runs["status"]) == ["diverged", "ok", "running"]


def test_unreadable_record_is_listed_not_fatal(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken/results.json").write_text('{"status": "ok", ')
    agg = build_aggregate([tmp_path])
    assert agg.runs["status"].tolist() == ["unreadable"]
    assert agg.tables["table1"]["n_runs"].sum() == 0


def test_written_tables_keep_empty_cells_empty(agg, written):
    tmp_path = written[0]
    for name, table in agg.tables.items():
        csv = pd.read_csv(tmp_path / "tables" / f"{name}.csv")
        assert list(csv.columns) == list(table.columns)
        assert csv["avg_paper"].tolist() == pytest.approx(table["avg_paper"].astype(float).tolist(), nan_ok=True)
        markdown = (tmp_path / "tables" / f"{name}.md").read_text()
        latex = (tmp_path / "tables" / f"{name}.tex").read_text()
        assert "nan" not in markdown.lower().replace("narrativeqa", "") and "<NA>" not in markdown
        assert "\\begin{tabular}" in latex and "nan" not in latex.lower().replace("narrativeqa", "")
    lines = [[c.strip() for c in l.split("|")[1:-1]] for l in (tmp_path / "tables/table1.md").read_text().splitlines()
             if l.startswith("|")]
    rows = [dict(zip(lines[0], l)) for l in lines[2:]]
    dkv32 = next(r for r in rows if r["model"] == "135M SmolLM" and r["d_kv"] == "32")
    assert (dkv32["avg_ours"], dkv32["avg_paper"], dkv32["avg_delta_paper"], dkv32["n_runs"]) == ("", "43.06", "-1.19", "0")


def test_markdown_without_tabulate(monkeypatch, agg):
    def missing(*args, **kwargs):
        raise ImportError("Missing optional dependency 'tabulate'")
    monkeypatch.setattr(pd.DataFrame, "to_markdown", missing)
    text = to_markdown(agg.tables["table5"])
    header, rule, first = text.splitlines()[:3]
    assert header.startswith("| model | ours_model | method |") and rule.startswith("|---|")
    assert first.startswith("| 135M SmolLM | smollm2-135m | finetuned_full_attention | full | 32 |  | 2 | 44.50 | 44.25 |")


def test_cli_with_no_runs_writes_paper_only_tables(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MHA2MLA_RESULTS", raising=False)
    assert main([]) == 0                      # results/runs absent
    assert "no run records found" in capsys.readouterr().out
    t1 = pd.read_csv(tmp_path / "results/aggregate/tables/table1.csv")
    assert len(t1) == 20 and t1["n_runs"].eq(0).all() and t1["avg_ours"].isna().all()
    assert t1["avg_paper"].notna().all()
    assert "ours columns are empty" in (tmp_path / "results/aggregate/tables/table1.md").read_text()
    for name in ("kv_memory_vs_avg", "strategy_comparison", "loss_curves", "long_context_vs_length"):
        assert (tmp_path / f"results/aggregate/plots/{name}.png").stat().st_size > 0
        assert (tmp_path / f"results/aggregate/plots/{name}.pdf").stat().st_size > 0


def test_cli_on_run_dirs(written):
    out = written[1]
    assert "12 runs" in out and "1 failed" in out and "1 diverged" in out


# ---------------------------------------------------------------- plots
def series(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_kv_memory_plot(agg):
    ax = plots.kv_memory_vs_avg(agg.tables["table1"]).axes[0]
    assert ax.get_xlabel() == "KV cache memory (% of MHA)" and ax.get_ylabel() == plots.AVG_LABEL
    lines = series(ax)
    assert set(lines) == {"paper: 135M SmolLM", "paper: 360M SmolLM", "paper: 1B7 SmolLM", "paper: 7B Llama2",
                          "ours: smollm2-135m (135M SmolLM)"}
    assert lines["ours: smollm2-135m (135M SmolLM)"] == ([12.5, 18.75, 100.0], [39.5, 41.0, 44.5])
    assert lines["paper: 135M SmolLM"] == ([12.5, 18.75, 31.25, 100.0], [40.97, 41.84, 43.06, 44.25])
    only = plots.kv_memory_vs_avg(agg.tables["table1"], models=["135M SmolLM"]).axes[0]
    assert len(only.lines) == 2


def test_strategy_plot(agg):
    figure = plots.strategy_comparison(agg.tables["table3"])
    assert [ax.get_title() for ax in figure.axes] == ["135M SmolLM (Table 3)", "1B7 SmolLM (Table 3)"]
    ax = figure.axes[0]
    assert ax.get_xlabel() == "partial-RoPE strategy" and ax.get_ylabel() == plots.AVG_LABEL
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "high", "low", "uniform", "2-norm", "high+SVD joint", "uniform+SVD joint", "2-norm+SVD joint",
        "2-norm+SVD split"]
    bars = {c.get_label(): [b.get_height() for b in c] for c in ax.containers}
    assert bars["paper"] == [43.4, 37.76, 43.76, 43.77, 41.04, 41.77, 41.84, 40.92]
    ours = bars["ours: smollm2-135m (135M SmolLM)"]
    assert [None if math.isnan(h) else h for h in ours] == [43.0, None, None, None, None, None, 41.0, 40.0]
    assert {l.get_label() for l in ax.lines} == {"paper: FT full attention", "ours: FT full attention"}
    assert [c.get_label() for c in figure.axes[1].containers] == ["paper"]


def test_loss_curve_plot(agg):
    ax = plots.loss_curves(agg.curves).axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("fine-tuning tokens", "training loss")
    lines = series(ax)
    assert lines["smollm2-135m: FT full attention (mean of 2)"] == (
        [125000, 250000, 375000, 500000], pytest.approx([3.1, 2.9, 2.8, 2.7]))
    assert lines["smollm2-135m: partial RoPE uniform r=8 [diverged]"][1] == [3.5, 7.9, 12.4]
    assert len(lines) == 7                    # six ok variants + the diverged run; no curve for the originals
    dashed = [l.get_label() for l in ax.lines if l.get_linestyle() == "--"]
    assert dashed == ["smollm2-135m: partial RoPE uniform r=8 [diverged]"]


def test_long_context_plot(agg):
    ax = plots.long_context_vs_length(agg.runs).axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("context length (tokens)", "long-context score (%)")
    assert ax.get_xscale() == "log"
    lines = series(ax)
    assert set(lines) == {"smollm2-135m: original", "smollm2-135m: FT full attention (mean of 2)",
                          "smollm2-135m: MLA 2-norm r=4 joint d_kv=16"}
    assert lines["smollm2-135m: FT full attention (mean of 2)"] == (
        [256, 512, 1024], pytest.approx([100.0, 100.0, 95.0]))
    assert lines["smollm2-135m: MLA 2-norm r=4 joint d_kv=16"][1] == pytest.approx([100.0, 80.0, 40.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "512", "1024"]


def test_plots_saved_as_png_and_pdf(written):
    tmp_path = written[0]
    files = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert files == [f"{name}.{ext}" for name in ("kv_memory_vs_avg", "long_context_vs_length", "loss_curves",
                                                  "recovery_curves", "strategy_comparison") for ext in ("pdf", "png")]
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
    config = {"model": {"name": "smollm2-135m", "paper_name": "135M SmolLM", "shape": {"head_dim": 64}},
              "variant": "mla", "seed": 0, "rope": {"strategy": "2-norm", "r": None, "score": "product"},
              "svd": {"method": "joint", "d_kv": 32, "sigma": "up", "init": "weight"},
              "kv_quant": {"backend": None, "nbits": None, "residual_length": 128}}
    summary = {"status": "ok", "kv/mem_change_pct": -68.75, "train/tokens": 500000,
               "eval/commonsense/avg": 0.42, "eval/commonsense/mmlu": 0.3}
    crashed = {"mla": {"rope": "2-norm", "r": 4, "svd": "joint", "d_kv": 8}}   # nested form, no status
    api = _FakeApi([_FakeRun("a", "finished", config, summary), _FakeRun("b", "crashed", config, crashed)])
    agg = build_aggregate([FIXTURES], wandb_project="e/p", wandb_api=api)
    cell = row(agg.tables["table1"], model="135M SmolLM", d_kv=32)
    assert (cell["n_runs"], cell["avg_ours"], cell["avg_delta_ours"], cell["mmlu_ours"]) == (1, 42.0, -2.5, 30.0)
    assert cell["r"] == 4                      # rope.r: null resolved to d_h/16
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
    assert rows["avg_ours"].tolist() == [41.0, 42.0] and rows["avg_paper"].tolist() == [41.84, 41.84]
    assert sorted(agg.runs["label"]) == ["smollm2-135m: MLA 2-norm r=4 joint d_kv=16",
                                         "smollm2-135m: MLA 2-norm r=4 joint d_kv=16 (score=sum)"]
