"""Launching the app as a user does, in a subprocess (`python -m mha2mla_exp`, or torchrun with N processes), on a
tiny run: the tiny random model, a slice of the offline corpus, a few fp32 steps (so that launches compare
closely), no evaluation but the held-out perplexity. Shared by the multi-process, requeue and FSDP tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mha2mla_exp.bench.host_rss import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["model=tiny_random", *TINY_RUN, "train.tokens=4096", "rope=2-norm", "rope.r=2", "svd.d_kv=8"]


def app(processes: int = 1, torchrun: bool | None = None) -> list[str]:
    """The command that starts the app on `processes` processes: under torchrun's standalone rendezvous when there
    are several (or when asked: one process under torchrun is a mesh of one)."""
    if not (processes > 1 if torchrun is None else torchrun):
        return [sys.executable, "-m", "mha2mla_exp"]
    torchrun_args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [sys.executable, *torchrun_args, "-m", "mha2mla_exp"]


def app_env(**extra: str) -> dict:
    """The environment of a launched run: offline, no W&B, one torch thread per process."""
    return dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)


def launch(results_dir: Path, processes: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A tiny run (COMMON, then `extra`) into `results_dir`."""
    return subprocess.run(
        [*app(processes), *COMMON, *extra, f"results_dir={results_dir}"],
        cwd=ROOT,
        env=app_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=900,
    )


def only_record(results_dir: Path) -> tuple[dict, list[dict]]:
    """The one record under `results_dir` and its curve (metrics.jsonl: a line per step, the probe at step 0)."""
    [path] = list((results_dir / "default").glob("*/results.json"))
    curve = path.parent / "metrics.jsonl"  # copied from the trained model's folder once training is over
    metrics = [json.loads(line) for line in curve.read_text().splitlines()] if curve.exists() else []
    return json.loads(path.read_text()), metrics
