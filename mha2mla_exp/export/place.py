"""Where an export may write, and writing there so that a failure loses nothing (issue 57).

The export only ever replaces an earlier export: OUT is refused when it is SRC, holds SRC, lies inside SRC, is not
a folder, is a symlink, or is a non-empty folder without `export.json`; all of it checked before anything loads.
The new export is written into a temporary sibling folder and renamed into place; an earlier export is moved
aside first and removed only after that rename, so a failed export leaves the previous one as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..atomic import file_mode
from .plan import ExportError

RECORD = "export.json"


def check_out(src: str | Path, out: str | Path) -> None:
    """ExportError unless writing `out` can only replace an earlier export (never `src` nor anything else)."""
    src, out = Path(src), Path(out)
    if out.is_symlink():
        raise ExportError(f"OUT {out} is a symlink: name the folder itself")
    real_src, real_out = src.resolve(), out.resolve()
    if real_out == real_src:
        raise ExportError(f"OUT {out} is SRC: the export would replace the model it reads")
    if real_out in real_src.parents:
        raise ExportError(f"OUT {out} holds SRC {src}: replacing it would delete the model it reads")
    if real_src in real_out.parents:
        raise ExportError(f"OUT {out} lies inside SRC {src}: write the export beside the model, not into it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / RECORD).is_file():
        raise ExportError(
            f"OUT {out} is a non-empty folder without {RECORD}: the export replaces only an earlier export"
        )


@contextmanager
def staged(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder of `out` to write the export into; on success it becomes `out` (an earlier
    export there moved aside, then removed), on an exception it is removed and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    os.chmod(tmp, file_mode() | (file_mode() & 0o444) >> 2)  # a plain mkdir's mode under the umask, not 0700
    try:
        yield tmp
        old = None
        if out.exists():
            check_out(tmp, out)  # still an earlier export (nothing else appeared there meanwhile)
            old = out.with_name(f"{tmp.name[:-4]}.old")
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old)
