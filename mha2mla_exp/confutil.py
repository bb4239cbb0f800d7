"""Where the configs live and what composing them needs (the schema, two integer resolvers); a composed config
(or any mapping) turned into the schema's typed dataclasses, once, with errors naming the field."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf
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


@functools.cache
def experiment_launches() -> dict[str, tuple[str, ...]]:
    """Every name a run is recorded under -> the overrides that launch it: each conf/experiment file by its own name,
    each name a study records under at a budget (its `budget.names`, the one place those names are declared) as
    that study at that budget, and the schema's default name as no experiment at all."""
    from .schema.sections import RunConfig

    launches: dict[str, tuple[str, ...]] = {RunConfig.experiment: ()}
    files = sorted((CONF_DIR / "experiment").glob("*.yaml"))
    launches.update({path.stem: (f"+experiment={path.stem}",) for path in files})
    for path in files:
        names = (yaml.safe_load(path.read_text()).get("budget") or {}).get("names") or {}
        for budget, name in names.items():
            if name in launches:
                raise ValueError(f"conf/experiment: {name!r} names two launches ({path.name} at budget {budget})")
            launches[name] = (f"+experiment={path.stem}", f"budget={budget}")
    return launches


def launch_arguments(argv: list[str]) -> list[str]:
    """The command line as Hydra takes it: `experiment=NAME` and `+experiment=NAME` alike, NAME being any name a run
    is recorded under (`experiment=partial_rope_ablation`: Table 3 at the main budget). conf/config.yaml keeps no
    `experiment: null` default: Hydra then refuses `+experiment=` ("Multiple values for experiment"), the form
    every script, record and compose call uses. A sweep over names, or an unknown one, is left to Hydra, which
    lists the files."""
    out: list[str] = []
    for argument in argv:
        key, _, name = argument.partition("=")
        if key.lstrip("+") != "experiment" or not name:
            out.append(argument)
            continue
        launch = experiment_launches().get(name, (f"+experiment={name}",))
        budget = next((a for a in launch if a.startswith("budget=")), None)
        typed = [a.lstrip("+") for a in argv if a.lstrip("+").startswith("budget=")]
        if budget and any(a != budget for a in typed):
            raise ValueError(
                f"experiment={name} is {launch[0].lstrip('+')} at {budget}; "
                f"another budget records under another name: {launch[0].lstrip('+')} {typed[-1]}"
            )
        out += [a for a in launch if a not in typed]
    return out


T = TypeVar("T")


def typed_section(cls: type[T], values: Any, group: str = "") -> T:
    """`values` (a composed config or any mapping) as the schema's dataclass `cls` (RunConfig, or one section such
    as TrainConfig under `group`): the schema's defaults for what it leaves out, its types and declared constraints
    checked; ValueError naming the field. The one conversion into the typed config: at the runner's entry, and for
    callers outside the runner (a benchmark, a test)."""
    from .schema.fields import check_values

    prefix = f"{group}." if group else ""
    try:
        section = OmegaConf.to_object(OmegaConf.merge(_schema_of(cls), values))
    except MissingMandatoryValue as err:
        raise ValueError(f"{prefix}{err.full_key}: missing (a ??? value): set it, e.g. on the command line") from None
    except OmegaConfBaseException as err:
        key, message = getattr(err, "full_key", None), str(err).split("\n")[0]
        raise ValueError(f"{prefix}{key}: {message}" if key else message) from None
    problems = _unknown_options(section, prefix) + check_values(section, prefix)
    if problems:
        raise ValueError("; ".join(problems))
    return section


@functools.lru_cache(maxsize=None)
def _schema_of(cls: type) -> DictConfig:
    """The schema's structured config for `cls`, built once a process (0.16 s each time otherwise): OmegaConf.merge
    copies it, never changes it. Its default factories run once too: none reads anything a run changes."""
    return OmegaConf.structured(cls)


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
