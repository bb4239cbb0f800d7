"""A sweep cell on submitit (the SLURM launcher's library, here its local executor) that is told its time is up
checkpoints at the next step, is requeued and resumes from there to the loss of an uninterrupted run; a stop
signal outside submitit, and a checkpoint swap cut between its renames, lose no step either; a sweep with
failed cells ends with a summary and a non-zero exit."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from hydra import compose, initialize_config_dir

from mha2mla_exp.runner import run, run_config, trained_model_for, validate
from mha2mla_exp.train import TrainingStopped
from mha2mla_exp.train.recipe import recover_checkpoint
from tests.launches import COMMON, ROOT

LONG = ["train.tokens=32768", "train.micro_batch_size=4", "train.grad_accum=2"]
# no periodic checkpoint: whatever a stopped run resumes from was written because of the stop
NO_PERIODIC = [o for o in COMMON if not o.startswith("train.checkpoint_every=")] + [
    "train.checkpoint_every=0",
    "train.log_every=1",
]


def compose_run(results_dir, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, f"results_dir={results_dir}"])


def logged_steps(results_dir: pathlib.Path) -> int:
    lines = [line for p in results_dir.glob("_trained/*/metrics.jsonl") for line in p.read_text().splitlines()]
    return sum('"loss"' in line for line in lines)


def submitit_task(parent: psutil.Process) -> psutil.Process | None:
    for child in parent.children(recursive=True):
        try:
            if "submitit.core._submit" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow
def test_a_timed_out_cell_is_requeued_and_resumes_to_the_same_loss(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*COMMON, *LONG, f"results_dir={tmp_path / 'reference'}"])
    reference = run(run_config(cfg))

    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    out = tmp_path / "requeued"
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mha2mla_exp",
            "-m",
            *NO_PERIODIC,
            *LONG,
            "seed=0",
            f"results_dir={out}",
            "hydra/launcher=submitit_local",
            "+hydra.launcher.max_num_timeout=2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 600
        while logged_steps(out) < 3:  # training is under way
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
    assert record["train"]["resumed_from_step"] >= 3  # the checkpoint the signal asked for, not step 0
    assert record["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-5)


def test_a_stop_signal_checkpoints_at_the_next_step_and_a_relaunch_resumes_there(tmp_path):
    overrides = [*NO_PERIODIC, "train.tokens=8192"]  # 32 steps
    reference = run(run_config(compose_run(tmp_path / "reference", *overrides)))
    cfg = compose_run(tmp_path / "stopped", *overrides)

    def signal_once_training_runs():
        while logged_steps(tmp_path / "stopped") < 3:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGUSR2)  # as SLURM does before the time limit (no submitit here)

    threading.Thread(target=signal_once_training_runs, daemon=True).start()
    with pytest.raises(TrainingStopped):
        run(run_config(cfg))
    progress = trained_model_for(validate(run_config(cfg))).dir / "checkpoint" / "progress.json"
    stopped_at = json.loads(progress.read_text())["step"]
    assert 3 <= stopped_at < reference["train"]["steps"]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the handler is put back

    resumed = run(run_config(cfg))
    assert resumed["status"] == "ok" and resumed["train"]["resumed_from_step"] == stopped_at
    assert resumed["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-5)


def test_a_checkpoint_swap_cut_between_its_renames_resumes_from_the_new_checkpoint(tmp_path, monkeypatch):
    overrides = [*COMMON, "train.tokens=4096"]  # checkpoints at steps 2, 4, 6...
    reference = run(run_config(compose_run(tmp_path / "reference", *overrides)))
    cfg = compose_run(tmp_path / "cut", *overrides)
    rename = pathlib.Path.rename
    swaps = []

    def cut_at_the_second_swap(self, target):
        if self.name == "checkpoint.tmp":
            swaps.append(self)
            if len(swaps) == 2:  # step 4's: `checkpoint` is already `checkpoint.old`, `.tmp` is complete
                raise OSError("killed between the renames")
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", cut_at_the_second_swap)
    with pytest.raises(OSError, match="between the renames"):
        run(run_config(cfg))
    monkeypatch.setattr(pathlib.Path, "rename", rename)
    root = trained_model_for(validate(run_config(cfg))).dir
    assert not (root / "checkpoint").exists() and (root / "checkpoint.old").exists()

    resumed = run(run_config(cfg))
    assert resumed["train"]["resumed_from_step"] == 4
    assert resumed["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-5)


def test_an_incomplete_new_checkpoint_falls_back_to_the_old_one(tmp_path):
    ckpt = tmp_path / "checkpoint"
    (tmp_path / "checkpoint.tmp").mkdir()  # cut while the processes were still writing it: no progress.json
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "progress.json").write_text('{"step": 2}')
    recover_checkpoint(ckpt)
    assert json.loads((ckpt / "progress.json").read_text())["step"] == 2
    recover_checkpoint(ckpt)  # a complete checkpoint is left alone
    assert json.loads((ckpt / "progress.json").read_text())["step"] == 2


def test_a_sweep_with_failed_cells_lists_them_and_exits_non_zero(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    # seq_len 1024 is past the tiny model's 512-token context: every fine-tuning cell is refused, the original runs
    result = subprocess.run(
        [sys.executable, "-m", "mha2mla_exp", "+experiment=smoke", "train.seq_len=1024", f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "sweep of 3 cells" in result.stdout
    summary = result.stdout.split("sweep of 3 cells:")[1].splitlines()[1:4]
    assert sorted(line.split()[1] for line in summary) == ["invalid", "invalid", "ok"]
    assert "2 of 3 cells failed" in result.stderr + result.stdout
    assert "train.seq_len: 1024 is longer than model 'tiny-random'" in result.stderr + result.stdout
