"""Timing with warm-up, device synchronisation and robust statistics (median, quartiles, min/max)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_L2_FLUSH = {}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flush_l2(device: torch.device) -> None:
    # H200's L2 is 60 MB: without this a small cache would be read from L2 and look too fast
    buf = _L2_FLUSH.get(device)
    if buf is None:
        buf = _L2_FLUSH[device] = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    buf.zero_()


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    repeats: int = 5,
    after: Callable[[], object] | None = None,
) -> dict:
    """Seconds per call of `fn`: {'median', 'q1', 'q3', 'min', 'max', 'n'}.

    CUDA: each call timed by events with the L2 flushed before it; CPU: wall clock. `after` runs
    untimed after every call (e.g. to trim the token a decode step appended to the cache).
    """
    for _ in range(warmup):
        fn()
        if after:
            after()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            _flush_l2(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        if after:
            after()
    return summarize(samples)


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    if len(s) >= 2:
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
    else:
        q1 = q3 = s[0]
    return {"median": statistics.median(s), "q1": q1, "q3": q3, "min": s[0], "max": s[-1], "n": len(s)}
