"""Tests only: a SIGKILL at a named write point (`MHA2MLA_FAULT=<point>`, or `<point>#N` for its N-th passage in
this process), so the fault-injection suite (tests/test_fault_injection.py) can cut a run where a crash, an OOM
kill or a power loss would. Unset, a point costs one environment lookup."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "MHA2MLA_FAULT"
_passages: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here, without cleanup, if `MHA2MLA_FAULT` names this point (and this passage of it)."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("#")
    if point != name:
        return
    _passages[name] = _passages.get(name, 0) + 1
    if _passages[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
