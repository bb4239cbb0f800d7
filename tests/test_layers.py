"""The package's layers import as docs/ARCHITECTURE.md orders them: each only what is listed before it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mha2mla_exp"
# docs/ARCHITECTURE.md's order; the leaves first (any layer may use them), then the numbered layers
ORDER = [
    "atomic", "registry", "machine", "faults",  # leaves
    "schema", "confutil",  # 1
    "mla",  # 2
    "assets", "models", "data",  # 3
    "train", "evaluation", "export",  # 4
    "aggregate",  # 5
    "runner", "__main__",  # 6
    "bench",  # 7
]  # fmt: skip


def imported_units(source: str, parts: tuple[str, ...]) -> set[str]:
    """The package's units a module imports (absolute or relative, anywhere in the file); `parts`: the module's
    path inside the package, without .py."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if node.module and node.module.startswith("mha2mla_exp."):
                found.add(node.module.split(".")[1])
            continue
        base = parts[: len(parts) - node.level]  # the package the relative import starts from
        target = (*base, *(node.module.split(".") if node.module else ()))
        found.update([target[0]] if target else [alias.name for alias in node.names])
    return found


def test_every_module_imports_only_layers_listed_before_its_own():
    units = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or any(p.glob("*.py"))} - {"__init__"}
    assert units <= set(ORDER), f"units missing from ORDER (and docs/ARCHITECTURE.md): {sorted(units - set(ORDER))}"
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        own = parts[0]
        if own == "__init__":
            continue
        for unit in imported_units(path.read_text(), parts) - {own}:
            if unit in ORDER and ORDER.index(unit) > ORDER.index(own):
                wrong.append(f"{path.relative_to(PACKAGE)} imports {unit}")
    assert not wrong, wrong


def test_the_checker_sees_relative_imports_at_any_depth():
    source = (
        "from ...runner import run\nfrom ..spec import MLASpec\nfrom .. import cache\n"
        "def f():\n    from mha2mla_exp.train import plan\n"
    )
    assert imported_units(source, ("mla", "rope", "probe")) == {"runner", "mla", "train"}
    assert imported_units("from .. import atomic, schema\n", ("data", "probe")) == {"atomic", "schema"}
