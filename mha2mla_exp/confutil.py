"""Where the configs live and what composing them needs (the schema, two integer resolvers); a composed config
(or any mapping) turned into the schema's typed dataclasses, once, with errors naming the field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import MissingMandatoryValue, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema.store import register as register_schema

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # the Hydra config groups (an editable install's)

# integer arithmetic for configs, registered wherever the configs are composed: `d_kv: ${mla_div:${...head_dim},4}`.
# A division by 0 gives 0, for the field's own positivity check to name (train=paper's grad_accum on a bad launch).
if not OmegaConf.has_resolver("mla_div"):
    OmegaConf.register_new_resolver("mla_div", lambda a, b: int(a) // int(b) if int(b) else 0)
if not OmegaConf.has_resolver("mla_mul"):
    OmegaConf.register_new_resolver("mla_mul", lambda *xs: math.prod(int(x) for x in xs))
# a fallback for a field the schema declares but leaves null (`oc.select` falls back only when the key is absent)
if not OmegaConf.has_resolver("mla_or"):
    OmegaConf.register_new_resolver("mla_or", lambda value, fallback: fallback if value is None else value)
if not OmegaConf.has_resolver("mla_min"):
    OmegaConf.register_new_resolver("mla_min", lambda *xs: min(int(x) for x in xs))
# SLURM's per-node memory request from the host-memory estimate (conf/hydra/launcher/slurm.yaml)
if not OmegaConf.has_resolver("mla_slurm_mem_gb"):
    OmegaConf.register_new_resolver(
        "mla_slurm_mem_gb",
        lambda model, train, data, tasks: __import__(
            "mha2mla_exp.train.memory", fromlist=["slurm_mem_gb_for"]
        ).slurm_mem_gb_for(model, train, data, int(tasks)),
    )
register_schema()  # conf/config.yaml composes onto the typed schema (mha2mla_exp/schema)

T = TypeVar("T")


def typed_section(cls: type[T], values: Any, group: str = "") -> T:
    """`values` (a composed config or any mapping) as the schema's dataclass `cls` (RunConfig, or one section such
    as TrainConfig under `group`): the schema's defaults for what it leaves out, its types and declared constraints
    checked; ValueError naming the field. The one conversion into the typed config: at the runner's entry, and for
    callers outside the runner (a benchmark, a test)."""
    from .schema.fields import check_values

    prefix = f"{group}." if group else ""
    try:
        section = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except MissingMandatoryValue as err:
        raise ValueError(f"{prefix}{err.full_key}: missing (a ??? value): set it, e.g. on the command line") from None
    except OmegaConfBaseException as err:
        key, message = getattr(err, "full_key", None), str(err).split("\n")[0]
        raise ValueError(f"{prefix}{key}: {message}" if key else message) from None
    problems = _unknown_options(section, prefix) + check_values(section, prefix)
    if problems:
        raise ValueError("; ".join(problems))
    return section


def _unknown_options(obj: Any, prefix: str) -> list[str]:
    """Keys a config added with `+` beside a section's declared fields (composition lets them through, and the
    typed object carries them as attributes): refused like any key the schema does not declare."""
    if not dataclasses.is_dataclass(obj):
        return []
    declared = {f.name for f in dataclasses.fields(obj)}
    problems = []
    for key, value in vars(obj).items():
        if key in declared:
            problems += _unknown_options(value, f"{prefix}{key}.")
        else:
            problems.append(f"{prefix}{key}: not an option of {type(obj).__name__} (schema/sections.py)")
    return problems
