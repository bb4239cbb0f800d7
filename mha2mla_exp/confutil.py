"""Where the configs live and what composing them needs (the schema, two integer resolvers); config mappings as
plain dicts, with a missing value reported under its config group."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from .schema.store import register as register_schema

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # the Hydra config groups (an editable install's)

# integer arithmetic for configs, registered wherever the configs are composed: `d_kv: ${mla_div:${...head_dim},4}`.
# A division by 0 gives 0, for the field's own positivity check to name (train=paper's grad_accum on a bad launch).
if not OmegaConf.has_resolver("mla_div"):
    OmegaConf.register_new_resolver("mla_div", lambda a, b: int(a) // int(b) if int(b) else 0)
if not OmegaConf.has_resolver("mla_mul"):
    OmegaConf.register_new_resolver("mla_mul", lambda *xs: math.prod(int(x) for x in xs))
register_schema()  # conf/config.yaml composes onto the typed schema (mha2mla_exp/schema)


def as_plain_dict(cfg: Any, group: str) -> dict:
    """`cfg` (a DictConfig, resolved, or any mapping) as a dict; ValueError naming `group.key` on a ??? value."""
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as e:
            key = e.full_key if str(e.full_key).startswith(f"{group}.") else f"{group}.{e.full_key}"
            raise ValueError(f"{key}: missing (a ??? value): set it, e.g. on the command line") from None
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise ValueError(f"{group} config must be a mapping, got {type(cfg).__name__}")
