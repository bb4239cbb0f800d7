"""The data modules import one another in one direction: no module of mha2mla_exp/data reaches back to a module
that imports it (an import inside a function counts: it was how a circle between prepare and stream hid)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "mha2mla_exp" / "data"


def data_imports(path: Path) -> set[str]:
    """The sibling modules `path` imports anywhere in its body (`from .x import ...`, `from . import x`)."""
    siblings = {p.stem for p in DATA.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            found |= {name for name in names if name in siblings}
    return found


def test_the_data_modules_import_without_a_circle():
    graph = {p.stem: data_imports(p) for p in DATA.glob("*.py") if p.stem != "__init__"}
    assert graph["stream"] and "prepare" in graph  # the graph is read (a parse that finds nothing would pass)
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"the data modules import in a circle: {err.args[1]}") from None
    assert order.index("tokens") < order.index("stream") < order.index("prepare")
