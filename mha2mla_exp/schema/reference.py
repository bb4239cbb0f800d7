"""Every option of the schema as a Markdown reference (docs/CONFIG.md is this function's output, checked by a
test, so the reference cannot drift from the code)."""

from __future__ import annotations

import dataclasses
import typing

from .fields import default_of, is_observer, section_type
from .identity import SCHEMA_VERSION
from .sections import RunConfig

HEADER = f"""# Config reference (schema version {SCHEMA_VERSION})

Every option a run takes, declared once in `mha2mla_exp/schema/sections.py`: its type, default and meaning. Hydra
composes `conf/` onto these types, so an unknown key or a wrong type fails at composition, and a value outside its
constraint fails before anything loads. A run's identity is the schema version plus every field that changes numbers
and differs from its default; *observer* fields (marked) never enter it. Regenerate: `python -m mha2mla_exp.schema
> docs/CONFIG.md`.
"""


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def options_reference() -> str:
    lines = [HEADER]
    pending = [("", RunConfig)]
    while pending:
        prefix, cls = pending.pop(0)
        hints = typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            path, section = f"{prefix}{f.name}", section_type(hints[f.name])
            if section is not None:
                pending.append((f"{path}.", section))
                continue
            default = default_of(f)
            shown = "required" if default is dataclasses.MISSING else f"`{default!r}`".replace("|", "\\|")
            doc = f.metadata.get("doc", "").replace("|", "\\|") + (" *(observer)*" if is_observer(f) else "")
            rows.append(f"| `{path}` | {_type_name(hints[f.name])} | {shown} | {doc} |")
        if rows:
            title = prefix.rstrip(".") or "run"
            lines += [f"\n## {title}\n", "| option | type | default | meaning |", "|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"
