"""The schema registered in Hydra's ConfigStore: conf/config.yaml's defaults list starts with `run_schema`, so every
group YAML is merged onto its typed section (an unknown key or a wrong type fails at composition)."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from .sections import RunConfig

SCHEMA_NAME = "run_schema"


def register() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
