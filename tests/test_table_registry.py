"""The aggregate's table registry: a table is one entry (experiments, builder, caption) and write_aggregate builds
whatever is registered; its outputs are written only when their bytes change."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from mha2mla_exp.aggregate import TABLES, build_aggregate, comparisons, write_aggregate
from mha2mla_exp.aggregate.kinds import Pairwise
from mha2mla_exp.aggregate.plots import figure_bytes, loss_curves
from mha2mla_exp.aggregate.table_registry import Entry, Inputs, TableFiles, TableRegistry

FIXTURES = Path(__file__).parent / "fixtures" / "runs"  # experiments table1, table2, table3, table5


@pytest.fixture(scope="module")
def agg():
    return build_aggregate([FIXTURES])


@dataclass(frozen=True, kw_only=True)
class RunCount(Entry):
    """A throwaway kind: one row per run it was handed, so the test sees which runs an entry reads."""

    caption: str

    def build(self, inputs: Inputs) -> list:
        runs = inputs.runs.sort_values("run_dir")
        frame = pd.DataFrame({"experiment": runs["experiment"], "run": runs["run_name"]})
        return [TableFiles(self.name, {"": frame}, self.caption, "one row per run", csv=frame)]


@pytest.fixture
def registered():
    """Register entries for one test and take them out again, whatever the test does."""
    names = []

    def add(entry):
        TABLES.add(entry)
        names.append(entry.name)
        return entry

    yield add
    for name in names:
        TABLES.remove(name)


def test_a_registered_entry_is_built_by_write_aggregate_from_its_experiments_only(agg, tmp_path):
    entry = TABLES.add(RunCount(name="throwaway_runs", experiments=("table3", "table5"), caption="Throwaway: runs"))
    try:
        written = write_aggregate(agg, tmp_path / "with")
    finally:
        TABLES.remove(entry.name)
    csv = tmp_path / "with/tables/throwaway_runs.csv"
    assert csv in written and (tmp_path / "with/tables/throwaway_runs.md") in written
    table = pd.read_csv(csv)
    assert sorted(set(table["experiment"])) == ["table3", "table5"]  # never another experiment's runs
    assert len(table) == int(agg.runs["experiment"].isin(["table3", "table5"]).sum()) == 4
    assert (tmp_path / "with/tables/throwaway_runs.md").read_text().startswith("# Throwaway: runs\n\none row per run")
    write_aggregate(agg, tmp_path / "without")  # unregistered: not written
    assert "throwaway_runs" not in TABLES and not (tmp_path / "without/tables/throwaway_runs.csv").exists()
    assert (tmp_path / "without/tables/table1.csv").exists()


def test_a_new_pairwise_table_is_one_entry(agg, tmp_path, registered):
    entry = registered(Pairwise(name="throwaway_pairs", experiments=("table1",), caption="Experiment table1: pairs"))
    write_aggregate(agg, tmp_path, entries=[entry])
    pairs = pd.read_csv(tmp_path / "tables/throwaway_pairs.csv")
    direct = comparisons.pairwise(agg.runs, "table1")
    assert len(pairs) == len(direct) > 0
    assert list(pairs["B"]) == list(direct["B"])
    assert list(pairs["avg_delta"]) == pytest.approx(list(direct["avg_delta"]))
    assert (tmp_path / "tables/throwaway_pairs.md").read_text().startswith("# Experiment table1: pairs")


def test_registry_refuses_a_name_twice_and_names_the_known_ones():
    registry = TableRegistry()
    registry.add(RunCount(name="a", caption=""))
    with pytest.raises(ValueError, match="registered twice"):
        registry.add(RunCount(name="a", caption="again"))
    with pytest.raises(ValueError, match="expected one of 'a'"):
        registry.get("b")
    with pytest.raises(TypeError):
        RunCount(name="c", experiments="table1", caption="")  # a string, not a tuple of names


def test_two_entries_writing_one_file_fail(agg, tmp_path, registered):
    clash = registered(RunCount(name="table1_tasks", caption="clash"))  # table1 writes tables/table1_tasks.md
    with pytest.raises(ValueError, match="tables/table1_tasks is written by both 'table1' and 'table1_tasks'"):
        write_aggregate(agg, tmp_path, entries=[TABLES.get("table1"), clash])


def test_the_catalog_declares_the_experiments_it_reads():
    pairwise = {e.name: e.experiments for e in TABLES if isinstance(e, Pairwise)}
    assert pairwise["teacher_recovery_pairs"] == ("teacher_recovery",)
    assert all(e.experiments is None or (isinstance(e.experiments, tuple) and e.experiments) for e in TABLES)


# ---------------------------------------------------------------- byte-stable outputs
def test_a_second_write_with_nothing_changed_rewrites_nothing(agg, tmp_path):
    first = write_aggregate(agg, tmp_path)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in first}
    for path in first:  # an old timestamp: a rewrite would move it
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    second = write_aggregate(build_aggregate([FIXTURES]), tmp_path)
    assert sorted(second) == sorted(first)
    assert all(p.stat().st_mtime_ns == 1_000_000_000 for p in second)
    assert all(p.read_bytes() == before[p][1] for p in second)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_a_changed_output_is_rewritten(agg, tmp_path):
    table1 = [TABLES.get("table1")]
    write_aggregate(agg, tmp_path, entries=table1)
    table = tmp_path / "tables/table1.csv"
    original = table.read_bytes()
    table.write_bytes(b"stale")
    write_aggregate(agg, tmp_path, entries=table1)
    assert table.read_bytes() == original


def test_a_pdf_has_the_same_bytes_whenever_it_is_drawn(agg, monkeypatch):
    # matplotlib dates a PDF from SOURCE_DATE_EPOCH when set: two dates, the same bytes
    figure = loss_curves(agg.curves, agg.runs)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    early = figure_bytes(figure, "pdf")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "2000000000")
    assert figure_bytes(figure, "pdf") == early and early.startswith(b"%PDF")
    assert figure_bytes(figure, "png") == figure_bytes(figure, "png")
