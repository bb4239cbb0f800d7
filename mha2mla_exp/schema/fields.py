"""How an option is declared: `setting(default, doc, check=..., observer=...)`.

Each option is a dataclass field whose metadata carries its documentation, its value constraint (checked once, at the
runner's entry, by `check_values`) and whether it is an observer: a setting that changes no number of a run (logging,
checkpoint cadence, how a batch is split into micro-batches) and so never enters a run's identity."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, field
from typing import Any, Callable

Check = Callable[[Any], "str | None"]  # a value -> None when valid, else what it must be


def setting(
    default: Any = MISSING,
    doc: str = "",
    *,
    check: Check | None = None,
    observer: bool = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """One option: its default, what it means, its constraint and whether it only observes the run."""
    metadata = {"doc": doc, "check": check, "observer": observer}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, doc: str = "", *, observer: bool = False) -> Any:
    """A nested group of options (a dataclass), present with its defaults."""
    return field(default_factory=cls, metadata={"doc": doc, "check": None, "observer": observer})


def positive(value) -> str | None:
    return None if value is None or value > 0 else "must be positive"


def non_negative(value) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def at_least(low) -> Check:
    return lambda value: None if value is None or value >= low else f"must be >= {low}"


def open_fraction(value) -> str | None:
    return None if value is None or 0 < value < 1 else "must lie in (0, 1)"


def unit_interval(value) -> str | None:
    return None if value is None or 0 <= value <= 1 else "must lie in [0, 1]"


def one_of(*choices) -> Check:
    return lambda value: None if value in choices else f"expected one of {', '.join(map(str, choices))}"


def path_segment(value) -> str | None:
    """A name that becomes one folder of a path (results_dir/<experiment>/<model.name>__...): never absolute,
    never a separator or a step up, so no config writes outside its results folder."""
    if value is None:
        return None
    text = str(value)
    if not text.strip() or text in (".", "..") or any(bad in text for bad in ("/", "\\", "..", "\0")):
        return "must be a plain name (one path segment: no '/', '\\' or '..', not empty)"
    return None


def section_type(hint) -> type | None:
    """The dataclass a field's type hint declares (`ShapeConfig` for `Optional[ShapeConfig]`), or None."""
    return next((c for c in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(c)), None)


def fields_of(obj) -> list[dataclasses.Field]:
    return list(dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else []


def is_observer(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("observer"))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def check_values(obj, prefix: str = "") -> list[str]:
    """Every declared constraint a typed config breaks, as `field: what it must be, got value`."""
    problems = []
    for f in fields_of(obj):
        value, path = getattr(obj, f.name), f"{prefix}{f.name}"
        check = f.metadata.get("check")
        message = check(value) if check is not None else None
        if message:
            problems.append(f"{path}: {message}, got {value!r}")
        if dataclasses.is_dataclass(value):
            problems += check_values(value, f"{path}.")
    return problems
