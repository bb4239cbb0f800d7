"""What the committed run records promise their readers, whatever run made them."""

import json
import subprocess
from pathlib import Path

from mha2mla_exp.runner.record import FINAL_STATUSES, STOPPED_STATUSES

ROOT = Path(__file__).resolve().parents[1]
ENDED = (*FINAL_STATUSES, *STOPPED_STATUSES)


def committed_records() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "results/runs/**/results.json"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in listed]


def test_no_committed_record_claims_to_be_still_running():
    """A record left "running" is a process that died without writing its end; a reader cannot tell it from one
    in progress, and the aggregate lists it beside finished runs."""
    records = committed_records()
    assert len(records) > 100
    unended = [str(p.relative_to(ROOT)) for p in records if json.loads(p.read_text()).get("status") not in ENDED]
    assert not unended, unended
