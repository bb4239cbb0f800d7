"""Where the export writes (mha2mla_exp/export/place.py, issue 57): it only ever replaces an earlier export, refuses
every other OUT before loading anything (the source folder byte-identical afterwards), and a failed export leaves
the previous one as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_export import converted

from mha2mla_exp.export import ExportError, export
from mha2mla_exp.export import run as export_run


def hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path -> sha256)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run-like folder: the converted model under model/ with a record and a curve beside it."""
    run = tmp_path_factory.mktemp("run")
    converted("gqa", r=2, d_kv=12).save_pretrained(run / "model")
    (run / "trained.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


@pytest.mark.parametrize(
    "out,match",
    [
        (lambda run: run / "model", "is SRC"),
        (lambda run: run, "holds SRC"),  # issue 57's reproduction: OUT = the run folder, SRC its model/
        (lambda run: run.parent, "holds SRC"),
        (lambda run: run / "model" / "export", "inside SRC"),
        (lambda run: run / "notes", "non-empty folder without export.json"),
        (lambda run: run / "trained.json", "is a file"),
    ],
)
def test_refused_out_leaves_the_source_byte_identical(source, monkeypatch, out, match):
    (source / "notes").mkdir(exist_ok=True)
    (source / "notes" / "keep.txt").write_text("mine\n")
    before = hashes(source)

    def loaded(*args, **kwargs):  # the check comes before anything is read
        raise AssertionError("the export loaded something before refusing OUT")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", loaded)
    with pytest.raises(ExportError, match=match):
        export(source / "model", out(source))
    assert hashes(source) == before


def test_symlinked_out_is_refused(source, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ExportError, match="symlink"):
        export(source / "model", tmp_path / "link")


def test_a_failed_export_leaves_the_previous_one_intact(source, tmp_path, monkeypatch):
    out = tmp_path / "export"
    export(source / "model", out)
    previous = hashes(out)
    assert "export.json" in previous and "model.safetensors" in previous

    def broken(*args, **kwargs):
        raise RuntimeError("killed during the verification")

    monkeypatch.setattr(export_run, "_logit_change", broken)
    with pytest.raises(RuntimeError, match="killed"):
        export(source / "model", out)
    assert hashes(out) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary sibling left behind
    monkeypatch.undo()
    # a good export replaces the earlier one, and nothing else is left beside it
    (out / "stale.txt").write_text("from the earlier export\n")
    export(source / "model", out)
    assert not (out / "stale.txt").exists() and (out / "export.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_empty_or_new_out_is_written(source, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        export(source / "model", out)
        assert (out / "export.json").is_file() and (out / "config.json").is_file()
