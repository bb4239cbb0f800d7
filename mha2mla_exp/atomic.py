"""Every file the project writes goes through here: written beside its target, then renamed over it.

A reader (the aggregate, a resuming run, a colleague) never sees half a file, a crash leaves the previous version,
and a new file gets the mode the user's umask gives (0644 under 022; `mkstemp`'s own 0600 would hide results
from the rest of a team on a shared cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: what a plain open() would give a new file


def file_mode() -> int:
    """The mode a plain `open()` gives a new file under this process's umask."""
    return 0o666 & ~_UMASK


@contextlib.contextmanager
def atomic_path(path: Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it is renamed over `path`.

    For writers that need a path rather than bytes (`torch.save`, `safetensors`, `numpy.savez`). On an
    exception the temporary file is removed and `path` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(temporary)
    try:
        yield temporary
        os.chmod(temporary, file_mode())
        if fsync:
            with open(temporary, "rb") as written:
                os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_folder(path: Path, *, may_replace: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it becomes `path`, on an exception it is removed and
    `path` is left as it was.

    A folder already at `path` is moved aside, the new one renamed into place, and only then the old one removed
    (a rename cannot replace a folder). `may_replace(temporary, path)` is asked first and raises to refuse.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(temporary, file_mode() | (file_mode() & 0o444) >> 2)  # a plain mkdir's mode under the umask, not 0700
    old = None
    try:
        yield temporary
        if path.exists():
            if may_replace is not None:
                may_replace(temporary, path)
            old = path.with_name(f"{temporary.name[:-4]}.old")
            os.rename(path, old)
        try:
            os.rename(temporary, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            raise
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_bytes(path: Path, data: bytes, *, fsync: bool = True, skip_unchanged: bool = False) -> Path:
    """`data` into `path` atomically. `skip_unchanged`: leave a file that already holds `data` untouched
    (its mtime stays, so `git status` and downstream rebuilds stay quiet)."""
    path = Path(path)
    if skip_unchanged and path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return path
    with atomic_path(path, fsync=fsync) as temporary:
        temporary.write_bytes(data)
    return path


def write_text(path: Path, text: str, **kwargs) -> Path:
    """`text` (UTF-8) into `path`, as `write_bytes`."""
    return write_bytes(path, text.encode("utf-8"), **kwargs)


def write_json(path: Path, data, *, indent: int | None = 2, default=None, **kwargs) -> Path:
    """`data` as JSON into `path`, as `write_bytes`."""
    return write_text(path, json.dumps(data, indent=indent, default=default) + "\n", **kwargs)
