"""What a run IS, computed from its config: the schema version plus every field that changes numbers and differs
from its default. An observer (a field declared `observer=True`: logging, checkpoint cadence, how a batch is split)
never enters; a field added later with a default never moves an older run's identity, and a changed default does,
through `SCHEMA_VERSION` (tests/test_identity.py pins the defaults of each version).

- The trained model: model, data, conversion (rope, svd, calibration), distillation, fine-tune, objective, seed,
  variant and the device type, with `train.precision` and `train.global_batch_rows` as resolved at the runner's
  entry. Blocks that cannot matter are left out (the conversion of an unconverted model, a disabled distillation,
  the fine-tune of an untrained model) so that a change there does not split identical runs. Its weights are saved
  under this identity and reused by every evaluation of it.
- An evaluation: the eval suites (their dtype as resolved), the KV-cache quantization, the cache measurement.
- A setting: both but the seed. Runs of one setting are repeats of one measurement (a table's row)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import MISSING
from typing import Any

from .fields import default_of, fields_of, is_observer, section_type
from .sections import RunConfig

SCHEMA_VERSION = 1
TRAINED_SECTIONS = ("model", "data", "rope", "svd", "calibration", "distill", "objective", "train")
TRAINED_FIELDS = ("variant", "seed", "device", "legacy_run")
EVALUATION_SECTIONS = ("eval", "kv_quant")
EVALUATION_FIELDS = ("kv_measure_tokens",)


def changed_fields(obj: Any) -> Any:
    """The number-changing fields of a config section that differ from their defaults, nested; a plain value as
    itself. A section set where its default is null is kept even when all its fields are defaults ({})."""
    if isinstance(obj, dict):
        return {key: changed_fields(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [changed_fields(value) for value in obj]
    if not dataclasses.is_dataclass(obj):
        return obj
    changed = {}
    for f in fields_of(obj):
        if is_observer(f):
            continue
        value, default = getattr(obj, f.name), default_of(f)
        if dataclasses.is_dataclass(value):
            inner = changed_fields(value)
            if inner or default is None or default is MISSING:
                changed[f.name] = inner
        elif value != default or default is MISSING:
            changed[f.name] = changed_fields(value)
    return changed


def _device_type(device: str) -> str:
    return str(device).split(":")[0]


def trained_identity(
    cfg: RunConfig,
    *,
    converts: bool,
    trains: bool,
    distills: bool,
    calibrates: bool,
    whitened_factors: str | None = None,
) -> dict:
    """The settings that determine the trained (or converted) model's weights. `whitened_factors`: how
    activation-aware low-rank factors are split (mla.lowrank.FACTOR_SPLIT) where a training starts from them."""
    identity = {"schema": SCHEMA_VERSION}
    sections = set(TRAINED_SECTIONS)
    if not converts:
        sections -= {"rope", "svd", "calibration"}
    if not calibrates:
        sections.discard("calibration")
    if not distills:
        sections.discard("distill")
    if not trains:
        sections -= {"train", "objective"}
    for name in sorted(sections):
        block = changed_fields(getattr(cfg, name))
        if block:
            identity[name] = block
    for name in TRAINED_FIELDS:
        value = getattr(cfg, name)
        if name == "device":
            value = _device_type(value)
        if value != default_of(RunConfig.__dataclass_fields__[name]) or name == "device":
            identity[name] = value
    if whitened_factors is not None:
        identity["lowrank_factors"] = whitened_factors
    return identity


def evaluation_identity(cfg: RunConfig) -> dict:
    identity = {"schema": SCHEMA_VERSION}
    for name in EVALUATION_SECTIONS:
        block = changed_fields(getattr(cfg, name))
        if block:
            identity[name] = block
    for name in EVALUATION_FIELDS:
        value = getattr(cfg, name)
        if value != default_of(RunConfig.__dataclass_fields__[name]):
            identity[name] = value
    return identity


def setting_identity(trained: dict, evaluation: dict) -> dict:
    """Two runs are the same measurement up to their seed: the trained identity without its seed, the evaluation's."""
    return {"trained": {k: v for k, v in trained.items() if k != "seed"}, "eval": evaluation}


def digest(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def number_changing_defaults(cls: type = RunConfig, prefix: str = "") -> dict:
    """Every number-changing field's default, flat (`train.lr`: 0.0003): what a SCHEMA_VERSION promises."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if is_observer(f):
            continue
        path = f"{prefix}{f.name}"
        section = section_type(hints[f.name])
        if section is not None:
            out[path] = None if f.default is None else "section"
            out.update(number_changing_defaults(section, f"{path}."))
        else:
            default = default_of(f)
            out[path] = "MISSING" if default is MISSING else default
    return out
