"""A multirun's ending: one line per cell, and a non-zero exit when any cell failed.

Hydra keeps sweeping after a cell fails (the app catches the error and records it, so the other cells still
run), which would make a sweep whose every cell failed exit 0. Each cell's outcome is appended to
`<sweep dir>/cells.jsonl` as it ends (in the cell's own process: joblib and SLURM run cells elsewhere), and
the launching process reads them back when the sweep is over. A cell another process is making (`deferred`:
its trained model; `busy`: the very run, runner/lock.py) is neither failed nor done: the summary lists it and the
sweep exits non-zero, so that nothing chained after it reads a partial set; relaunching the sweep completes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .record import BUSY

OUTCOMES = "cells.jsonl"
FAILED = ("failed", "invalid", "interrupted", "crashed", "refused")  # refused: a dry run's launch that would be


class SweepFailed(SystemExit):
    """Some cells of a multirun failed; the message lists them. A SystemExit: Hydra turns an Exception raised
    in a callback into a warning, and the exit code is the point."""


class SweepSummary(Callback):
    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        hydra = HydraConfig.get()
        if str(hydra.mode) not in ("MULTIRUN", "RunMode.MULTIRUN") or os.environ.get("RANK", "0") != "0":
            return  # one line per cell, from its main process
        outcome = {"cell": hydra.job.num, "overrides": " ".join(hydra.overrides.task)}
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, dict):
            outcome |= job_return.return_value
        else:
            outcome |= {"status": "crashed", "error": repr(getattr(job_return, "_return_value", None))}
        with (Path(hydra.sweep.dir) / OUTCOMES).open("a") as f:
            f.write(json.dumps(outcome) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        path = Path(config.hydra.sweep.dir) / OUTCOMES
        outcomes = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        outcomes.sort(key=lambda o: o["cell"])
        print(summary_table(outcomes))
        failed = [o for o in outcomes if o.get("status") in FAILED]
        deferred = [o for o in outcomes if o.get("status") == "deferred"]
        busy = [o for o in outcomes if o.get("status") == BUSY]
        if failed or deferred or busy:  # a sweep that is not complete must not exit as if it were
            raise SweepFailed(
                "; ".join(
                    filter(
                        None,
                        [
                            f"{len(failed)} of {len(outcomes)} cells failed: "
                            + "; ".join(f"#{o['cell']} {o['overrides']}: {o.get('error')}" for o in failed)
                            if failed
                            else "",
                            f"{len(deferred)} cells deferred while another process made their trained model: "
                            "relaunch the same sweep to evaluate them (finished cells are skipped)"
                            if deferred
                            else "",
                            f"{len(busy)} cells already running in another process: relaunch the same sweep "
                            "once it ends (their records are not overwritten)"
                            if busy
                            else "",
                        ],
                    )
                )
            )


def summary_table(outcomes: list[dict]) -> str:
    lines = [f"[mha2mla_exp] sweep of {len(outcomes)} cells:"]
    for o in outcomes:
        where = o.get("run_dir") or ""
        error = f"  ({o['error']})" if o.get("error") and o.get("status") in (*FAILED, "blocked", BUSY) else ""
        lines.append(f"  #{o['cell']:<3} {o.get('status', '?'):<12} {o['overrides']}  {where}{error}")
    return "\n".join(lines)
