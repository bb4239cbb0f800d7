"""Where an export may write, and writing there so that a failure loses nothing (issue 57).

The export only ever replaces an earlier export: OUT is refused when it is SRC, holds SRC, lies inside SRC, is not
a folder, is a symlink, or is a non-empty folder without `export.json`; all of it checked before anything loads.
The new export is written into a temporary sibling folder and renamed into place; an earlier export is moved
aside first and removed only after that rename, so a failed export leaves the previous one as it was.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_folder
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


def staged(out: str | Path):
    """A temporary sibling folder of `out` to write the export into (`atomic.atomic_folder`): on success it becomes
    `out`, an earlier export there replaced only if it still is one; on an exception `out` is left as it was."""
    return atomic_folder(Path(out), may_replace=check_out)
