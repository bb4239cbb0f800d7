"""`python -m mha2mla_exp [overrides]`: the Hydra app (single runs and multirun sweeps)."""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .confutil import CONF_DIR, launch_arguments
from .runner import ConfigError, run, run_config

log = logging.getLogger("mha2mla_exp")


def export_submitit_distributed_env() -> None:
    """A SLURM cell with several tasks (hydra.launcher.tasks_per_node=N): give each task the RANK / WORLD_SIZE /
    MASTER_ADDR that torchrun would, so accelerate sets up the process group as under `torchrun`."""
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """Run one cell; in a sweep a failed cell is recorded and returned (runner.sweep sums the cells up at the
    end and exits non-zero if any failed) instead of stopping the others."""
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-checkpoint INFO lines drown the progress
    export_submitit_distributed_env()
    try:
        record = run(run_config(cfg))  # the composed config becomes the typed RunConfig here, once
    except ConfigError as err:
        log.error("invalid config: %s", err)
        if sweeping:
            print(f"[mha2mla_exp] skipped, invalid config: {err}")
            return {"status": "invalid", "error": str(err)}
        raise SystemExit(f"invalid config: {err}") from None
    except Exception as err:
        if sweeping:
            log.exception("run failed; continuing the sweep")
            return {"status": "failed", "error": f"{type(err).__name__}: {err}"}
        raise
    return {"status": record["status"], "error": record.get("error"), "run_dir": record.get("run_dir")}


if __name__ == "__main__":
    try:
        sys.argv[1:] = launch_arguments(sys.argv[1:])  # `experiment=NAME` with or without `+`, any recorded name
    except ValueError as err:
        raise SystemExit(f"invalid command line: {err}") from None
    sys.exit(main())
