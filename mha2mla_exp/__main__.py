"""`python -m mha2mla_exp [overrides]`: the Hydra app (single runs and multirun sweeps)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .runner import ConfigError, run

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("mha2mla_exp")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        run(cfg)
    except ConfigError as err:
        log.error("invalid config: %s", err)
        if sweeping:  # one impossible cell of a grid must not stop the others
            print(f"[mha2mla_exp] skipped, invalid config: {err}")
            return
        raise SystemExit(f"invalid config: {err}") from None
    except Exception:
        # in a sweep one failed run (recorded as failed in its results.json) must not stop the others
        if sweeping:
            log.exception("run failed; continuing the sweep")
            return
        raise


if __name__ == "__main__":
    sys.exit(main())
