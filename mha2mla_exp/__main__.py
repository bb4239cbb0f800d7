"""`python -m mha2mla_exp [overrides]`: the Hydra app (single runs and multirun sweeps)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .runner import ConfigError, run, run_dir_for, validate

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("mha2mla_exp")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """Run one cell; in a sweep a failed cell is recorded and returned (runner.sweep sums the cells up at the
    end and exits non-zero if any failed) instead of stopping the others."""
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-checkpoint INFO lines drown the progress
    try:
        record = run(cfg)
    except ConfigError as err:
        log.error("invalid config: %s", err)
        if sweeping:
            print(f"[mha2mla_exp] skipped, invalid config: {err}")
            return {"status": "invalid", "error": str(err)}
        raise SystemExit(f"invalid config: {err}") from None
    except Exception as err:
        if sweeping:
            log.exception("run failed; continuing the sweep")
            return {"status": "failed", "error": f"{type(err).__name__}: {err}", "run_dir": _run_dir(cfg)}
        raise
    return {"status": record["status"], "error": record.get("error"), "run_dir": _run_dir(cfg)}


def _run_dir(cfg: DictConfig) -> str | None:
    try:
        return str(run_dir_for(cfg, validate(cfg)))
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
