"""Every file the project writes goes through mha2mla_exp/atomic.py: whole or not at all, readable by the team."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mha2mla_exp.aggregate.files import write_text as aggregate_write_text
from mha2mla_exp.runner.record import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mha2mla_exp"
HELPER = PACKAGE / "atomic.py"
# a folder written whole and renamed into place (a file write inside it goes through the helper)
FOLDER_RENAMES = {"evaluation/tasks.py", "runner/trained.py", "train/recipe.py"}  # their own folder swaps


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_only_the_helper_replaces_a_file_or_makes_a_temporary_one():
    replacing = {name for name, text in sources().items() if "os.replace(" in text or "mkstemp(" in text}
    assert replacing == {"atomic.py"}


def test_a_rename_is_a_folders():
    renaming = {name for name, text in sources().items() if re.search(r"\brename\(", text)}
    assert renaming <= FOLDER_RENAMES | {"atomic.py"}, (
        f"a file or folder renamed into place outside mha2mla_exp/atomic.py: {renaming}"
    )


def test_a_new_file_gets_the_umasks_mode_and_keeps_an_existing_ones_content_on_failure(tmp_path):
    # a fresh interpreter per umask: the helper reads it once, at import (loaded alone, without torch)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('atomic', {str(HELPER)!r})\n"
        "atomic = importlib.util.module_from_spec(spec); spec.loader.exec_module(atomic)\n"
        "atomic.write_text(sys.argv[1], 'x')\n"
    )
    for umask, expected in ((0o022, 0o644), (0o027, 0o640)):
        target = tmp_path / f"umask{umask:o}.txt"
        subprocess.run([sys.executable, "-c", script, str(target)], check=True, umask=umask)
        assert mode(target) == expected, (oct(umask), oct(mode(target)))


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    from mha2mla_exp import atomic

    target = atomic.write_text(tmp_path / "record.json", "old")
    with pytest.raises(RuntimeError), atomic.atomic_path(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_committed_records_keep_their_bytes(tmp_path):
    """A record rewritten later (a resumed run, a migration) changes no byte of what is committed."""
    committed = sorted((ROOT / "results").rglob("results.json"))
    assert committed
    for path in committed:
        copy = tmp_path / "copy.json"
        write_json_atomic(copy, json.loads(path.read_text()))
        assert copy.read_bytes() == path.read_bytes(), path


def test_an_unchanged_aggregate_output_is_left_untouched(tmp_path):
    table = aggregate_write_text(tmp_path / "table.md", "| a |\n")
    before = table.stat().st_mtime_ns
    os.utime(table, ns=(before - 10**9, before - 10**9))  # any rewrite would move it forward
    aggregate_write_text(table, "| a |\n")
    assert table.stat().st_mtime_ns == before - 10**9
    aggregate_write_text(table, "| b |\n")
    assert table.read_text() == "| b |\n" and table.stat().st_mtime_ns != before - 10**9


RUN_ONE = """
import json, sys
from tests.test_runner import smoke_cfg
from mha2mla_exp.runner import run, run_config, run_dir_for, trained_model_for, validate
cfg = run_config(smoke_cfg(sys.argv[1], "mla_2-norm_joint", "train.tokens=2048", "train.log_every=1"))
assert run(cfg)["status"] == "ok"
print(json.dumps({"run": str(run_dir_for(validate(cfg))), "trained": str(trained_model_for(validate(cfg)).dir)}))
"""


def test_a_runs_records_are_readable_by_the_team(tmp_path):
    """Under the usual umask 022, a run's records are 0644 (mkstemp alone would leave them 0600)."""
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", RUN_ONE, str(tmp_path)],
        cwd=ROOT,
        env=env,
        umask=0o022,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folders = json.loads(done.stdout.strip().splitlines()[-1])
    records = [Path(folders["run"]) / "results.json", Path(folders["run"]) / "metrics.jsonl"]
    records.append(Path(folders["trained"]) / "trained.json")
    assert {str(p): oct(mode(p)) for p in records} == {str(p): "0o644" for p in records}
