"""Folder locks: one per run folder (held for the whole run) and one per kept model (held while it is made,
reused or pruned), so two processes never write one folder at once.

The lock is the operating system's (`filelock`: `flock`, released by the kernel when its process dies, SIGKILL
included, so a dead run's lock is taken over by the next launch at once; where a file system has no `flock`,
filelock's marker fallback records pid and host and breaks a dead owner's marker). Beside it, `.lock.holder`
says who holds it (pid, host, since, SLURM job) for the message a second launch prints. A SLURM job requeued
onto another node may find its own earlier incarnation's lock still held by a network file system's lease: it
waits for the lease to lapse instead of reporting itself busy.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from pathlib import Path

from filelock import FileLock, Timeout

from ..atomic import write_json

log = logging.getLogger(__name__)

LOCK = ".lock"
HOLDER = ".lock.holder"


class FolderBusy(Exception):
    """Another live process holds the folder's lock."""

    def __init__(self, folder: Path, holder: dict | None):
        self.folder, self.holder = Path(folder), holder or {}
        super().__init__(f"already running: {describe_holder(self.holder)}: {self.folder}")


def describe_holder(holder: dict) -> str:
    if not holder:
        return "pid ?, host ?, since ? (its holder note is not written yet)"
    slurm = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')}, host {holder.get('host')}, since {holder.get('since')}{slurm}"


def _this_process() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


class FolderLock:
    """The lock of one folder. `with lock:` waits for it; `acquire(wait=False)` raises FolderBusy instead."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._lock = FileLock(str(self.folder / LOCK))

    @property
    def holder_path(self) -> Path:
        return self.folder / HOLDER

    def holder(self) -> dict | None:
        """Who holds (or last held) the lock, as its holder wrote it; None when unreadable."""
        try:
            return json.loads(self.holder_path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self, *, wait: bool = True) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            holder = self.holder()
            if not wait and not _own_earlier_incarnation(holder):
                raise FolderBusy(self.folder, holder) from None
            log.warning("waiting for %s (held by %s)", self.folder, describe_holder(holder or {}))
            self._lock.acquire()
        write_json(self.holder_path, _this_process())

    def try_acquire(self) -> bool:
        try:
            self.acquire(wait=False)
        except FolderBusy:
            return False
        return True

    def release(self) -> None:
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()

    def __enter__(self) -> FolderLock:
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _own_earlier_incarnation(holder: dict | None) -> bool:
    """The holder is this SLURM job before its requeue (dead: SLURM requeues a job once it has ended)."""
    here = _this_process()
    return bool(
        holder
        and here["slurm_job"]
        and holder.get("slurm_job") == here["slurm_job"]
        and int(holder.get("slurm_restart") or 0) < here["slurm_restart"]
    )
