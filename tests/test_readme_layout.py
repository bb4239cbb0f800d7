"""The README's Layout names every package of mha2mla_exp (and the repository's top-level folders), so a reader
finds each one; a new package without a line there fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_entries() -> set[str]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout") :].split("\n## ", 1)[0]
    return {m.group(1).rstrip("/") for m in re.finditer(r"^    (\S+)", block, re.M)}


def test_the_layout_names_every_package_and_top_level_folder():
    packages = {f"mha2mla_exp/{p.parent.name}" for p in (ROOT / "mha2mla_exp").glob("*/__init__.py")}
    folders = {"conf", "docs", "hydra_plugins", "results", "scripts", "sweeps", "tests"}
    listed = layout_entries()
    assert "mha2mla_exp/schema" in packages and len(packages) >= 10  # the tree is read
    assert not (packages | folders) - listed, f"not in README's Layout: {sorted((packages | folders) - listed)}"
    assert not {e for e in listed if not (ROOT / e).exists()}, "the Layout names a path that does not exist"
