"""The aggregate's files, written with the one atomic writer (mha2mla_exp/atomic.py) so that an unchanged output
leaves its file untouched: its mtime stays, `git status` stays clean, nothing downstream is rebuilt."""

from __future__ import annotations

from pathlib import Path

from .. import atomic


def write_bytes(path: Path, data: bytes) -> Path:
    """`data` into `path` unless it holds them already. No fsync: every output is rebuilt from the run records."""
    return atomic.write_bytes(path, data, fsync=False, skip_unchanged=True)


def write_text(path: Path, text: str) -> Path:
    """`text` (UTF-8) into `path`, as `write_bytes`."""
    return write_bytes(path, text.encode("utf-8"))
