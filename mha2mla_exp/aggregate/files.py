"""Writing the aggregate's files so that an unchanged output leaves its file untouched.

A file whose bytes are already on disk is not rewritten (its mtime stays, `git status` stays clean, nothing is
rebuilt downstream); a changed one is written beside it and renamed over it, so a reader or an interrupted run
never sees half a table.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: what a plain open() would give a new file


def write_bytes(path: Path, data: bytes) -> Path:
    """`data` into `path` unless it holds them already; atomic (a temporary file renamed over it)."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide it from other users
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """`text` (UTF-8) into `path`, as `write_bytes`."""
    return write_bytes(path, text.encode("utf-8"))
