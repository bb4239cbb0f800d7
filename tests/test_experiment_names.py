"""Every experiment name a user reads launches: each name the README, the docs, the report and the committed records
use is dry-launched (one row, in-process) with `experiment=NAME`, and `+experiment=NAME` is the same launch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from mha2mla_exp.confutil import experiment_launches, launch_arguments
from tests.compositions import CONF, expand

ROOT = CONF.parent
DOCS = [ROOT / "README.md", ROOT / "results" / "REPORT.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_in_docs() -> set[str]:
    # names are lower case: `experiment=NAME` is a placeholder
    return {name for doc in DOCS for name in re.findall(r"experiment=([a-z0-9_]+)\b", doc.read_text())}


def named_by_records() -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", "results/runs"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {path.split("/")[2] for path in listed if path.count("/") >= 3}


NAMES = sorted(named_in_docs() | named_by_records())


@pytest.fixture(scope="module")
def offline_checks():
    """What validation would ask the hub answered as on a machine with access (the plan is what is tested)."""
    patch = pytest.MonkeyPatch()
    patch.setattr("mha2mla_exp.runner.config.probe_architecture", lambda cfg: (None, []))
    patch.setattr("mha2mla_exp.runner.config.probe_hub_datasets", lambda mixture: [])
    yield
    patch.undo()


def test_the_names_come_from_the_docs_and_the_records():
    assert {"partial_rope_ablation", "table3", "headline"} <= named_in_docs()
    assert {"cpu10x_table3", "cpu_table1", "default"} <= named_by_records()


def test_with_or_without_plus_is_one_launch_and_a_budget_name_pins_its_budget():
    assert launch_arguments(["experiment=partial_rope_ablation", "dry_run=true"]) == [
        "+experiment=table3",
        "budget=main",
        "dry_run=true",
    ]
    assert launch_arguments(["+experiment=cpu10x_table3"]) == launch_arguments(["experiment=cpu10x_table3"])
    assert launch_arguments(["experiment=cpu10x_table3", "budget=cpu10x"]) == ["+experiment=table3", "budget=cpu10x"]
    assert launch_arguments(["-m", "experiment=table1,table3"]) == ["-m", "+experiment=table1,table3"]
    assert launch_arguments(["experiment=default", "rope=high"]) == ["rope=high"]
    with pytest.raises(ValueError, match="another budget records under another name: experiment=table3 budget=paper"):
        launch_arguments(["experiment=cpu10x_table3", "budget=paper"])


@pytest.mark.parametrize("name", NAMES)
def test_every_name_in_the_docs_and_records_dry_launches_and_records_under_a_name_that_launches_it(
    name, offline_checks, tmp_path, capsys
):
    from mha2mla_exp.runner import run, run_config

    assert name in experiment_launches(), f"{name}: no experiment file or budget name launches it"
    arguments = launch_arguments([f"experiment={name}", f"results_dir={tmp_path}", "logger=none", "dry_run=true"])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sweep = compose(config_name="config", overrides=arguments, return_hydra_config=True).hydra.sweeper
        first_row = expand(arguments)[0][1] if sweep._target_.endswith("RowsSweeper") else arguments
        cfg = compose(config_name="config", overrides=first_row)
    outcome = run(run_config(cfg))
    assert outcome["status"] == "planned", outcome
    launch, recorded = experiment_launches()[name], cfg.experiment
    assert experiment_launches()[recorded][:1] == launch[:1], f"{name} records under {recorded}, another study"
    if not launch or launch[0] != f"+experiment={name}":  # not a file's own name: the name its runs record under
        assert recorded == name


def test_the_headline_command_launches_without_a_plus(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha2mla_exp",
            "experiment=partial_rope_ablation",
            "hydra.sweeper.only=[ft_full_attention]",
            "dry_run=true",
            f"results_dir={tmp_path}",
            "logger=none",
        ],
        cwd=ROOT,  # this checkout's package, whichever one the environment installed
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sweep of 1 cells" in out.stdout
    assert f"{tmp_path}/partial_rope_ablation/" in out.stdout
