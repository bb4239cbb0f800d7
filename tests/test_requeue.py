"""A sweep cell on submitit (the SLURM launcher's library, here its local executor) that is told its time is up
is requeued and resumes from its last checkpoint to the loss of an uninterrupted run; a sweep with failed
cells ends with a summary and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mha2mla_exp.runner import run
from tests.test_distributed import COMMON, ROOT

LONG = ["train.tokens=32768", "train.micro_batch_size=4", "train.grad_accum=2"]


def submitit_task(parent: psutil.Process) -> psutil.Process | None:
    for child in parent.children(recursive=True):
        try:
            if "submitit.core._submit" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def test_a_timed_out_cell_is_requeued_and_resumes_to_the_same_loss(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*COMMON, *LONG, f"results_dir={tmp_path / 'reference'}"])
    reference = run(cfg)

    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    out = tmp_path / "requeued"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "mha2mla_exp", "-m", *COMMON, *LONG, "seed=0", f"results_dir={out}",
         "hydra/launcher=submitit_local", "+hydra.launcher.max_num_timeout=2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 600
        while not list(out.glob("_trained/*/checkpoint/progress.json")):  # training is under way
            assert sweep.poll() is None, sweep.stdout.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.2)
        task = submitit_task(psutil.Process(sweep.pid))
        assert task is not None
        task.send_signal(signal.SIGUSR2)  # what SLURM (and submitit's local controller) send before the time limit
        output, _ = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output[-3000:]
    [path] = list(out.glob("default/*/results.json"))
    record = json.loads(path.read_text())
    assert record["status"] == "ok" and record["resumed"] is True
    logs = "".join(p.read_text() for p in out.rglob("*_log.*"))
    assert "Requeued job" in logs
    assert record["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-5)


def test_a_sweep_with_failed_cells_lists_them_and_exits_non_zero(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    # seq_len 1024 is past the tiny model's 512-token context: every fine-tuning cell is refused, the original runs
    result = subprocess.run(
        [sys.executable, "-m", "mha2mla_exp", "+experiment=smoke", "train.seq_len=1024", f"results_dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode != 0
    assert "sweep of 3 cells" in result.stdout
    summary = result.stdout.split("sweep of 3 cells:")[1].splitlines()[1:4]
    assert sorted(line.split()[1] for line in summary) == ["invalid", "invalid", "ok"]
    assert "2 of 3 cells failed" in result.stderr + result.stdout
    assert "train.seq_len: 1024 is longer than model 'tiny-random'" in result.stderr + result.stdout
