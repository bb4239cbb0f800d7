"""The perplexity/compute view lists every ok run, and only those, with the compute columns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mha2mla_exp.aggregate import build_aggregate
from mha2mla_exp.aggregate.pipeline import PERPLEXITY_COLUMNS, perplexity_view

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

    aggregate = build_aggregate([runs])
    view = perplexity_view(aggregate.runs)
    assert list(view.columns) == list(PERPLEXITY_COLUMNS)
    assert len(view) == int((aggregate.runs["status"] == "ok").sum())
    row = view[view["heldout_ppl"] == 42.5]
    assert len(row) == 1
    assert row["distill_token_passes"].iloc[0] == 1024
    assert row["label"].iloc[0].endswith("+ layer-wise distillation")
