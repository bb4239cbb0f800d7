"""Training precision: which dtype the weights are stored in, which the matmuls run in, which the optimizer updates.

Modes (`train.precision`):
- `fp32`: everything fp32.
- `bf16-autocast`: fp32 master weights and optimizer state, bf16 compute under torch.autocast (the paper's
  recipe on GPU; accelerate's `mixed_precision="bf16"`).
- `bf16-master`: bf16 weights (no per-op casts: the fastest bf16 path on CPU), an fp32 master copy of every
  trained weight and fp32 optimizer state; updates are made on the master and rounded into the weights.
- `bf16-pure`: bf16 weights AND bf16 optimizer updates, no master copy. Only for comparison: small updates
  vanish in bf16 rounding, a worse recipe than the paper's. Never chosen by `auto`.
- `auto`: `bf16-autocast` on CUDA; on CPU a startup probe times a bf16 and an fp32 matmul at the model's
  shape and picks `bf16-autocast` when bf16 is at least `CPU_BF16_MIN_SPEEDUP` times faster, else `fp32`
  (CPUs differ: AMX or avx512_bf16 make bf16 several times faster, older ones make it slower). The record
  states the mode chosen and why. Not `bf16-master`, although it is 5 % faster on CPU: with whitened low-rank
  factors (unit rows in `down`) it recovered worse than fp32 and bf16-autocast on both data orders measured
  (results/REPORT.md, section 11; the bf16 residual stream and bf16-rounded small weights).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

MODES = ("auto", "fp32", "bf16-autocast", "bf16-master", "bf16-pure")
CPU_BF16_MIN_SPEEDUP = 1.5


@dataclass(frozen=True)
class Precision:
    mode: str  # one of MODES but 'auto'
    param_dtype: torch.dtype  # what the model's weights are stored in while training
    compute_dtype: torch.dtype
    optimizer_dtype: torch.dtype  # the master weights' dtype: what the optimizer's update and state live in
    reason: str = ""

    @property
    def autocast(self) -> bool:
        return self.mode == "bf16-autocast"

    @property
    def separate_master_copy(self) -> bool:
        """True where the weights are stored below the optimizer's precision (bf16-master), so the fp32 master
        weights are a copy of their own; under fp32 and bf16-autocast the fp32 weights are the master weights."""
        return self.param_dtype != self.optimizer_dtype

    def to_record(self) -> dict:
        return {
            "mode": self.mode,
            "param_dtype": _name(self.param_dtype),
            "compute_dtype": _name(self.compute_dtype),
            "optimizer_dtype": _name(self.optimizer_dtype),
            "reason": self.reason,
        }


def precision_for(
    mode: str, device_type: str, *, hidden_size: int = 576, intermediate_size: int = 1536, bf16_pays=None
) -> Precision:
    """The `Precision` of `mode` on `device_type` ('cuda' | 'cpu'); `auto` is resolved here, on CPU by
    `bf16_pays(hidden, intermediate)` (default: `cpu_bf16_pays`; the runner passes one that measures on the main
    process and hands its verdict to the others, so that every process trains in the same precision)."""
    if mode not in MODES:
        raise ValueError(f"train.precision: unknown {mode!r}; expected one of {', '.join(MODES)}")
    reason = "set in the config"
    if mode == "auto":
        if device_type == "cuda":
            mode, reason = "bf16-autocast", "auto on CUDA: fp32 master weights, bf16 autocast (the paper's recipe)"
        else:
            fast, why = (bf16_pays or cpu_bf16_pays)(hidden_size, intermediate_size)
            mode, reason = ("bf16-autocast" if fast else "fp32"), f"auto on CPU: {why}"
    bf16, fp32 = torch.bfloat16, torch.float32
    return {
        "fp32": Precision("fp32", fp32, fp32, fp32, reason),
        "bf16-autocast": Precision("bf16-autocast", fp32, bf16, fp32, reason),
        "bf16-master": Precision("bf16-master", bf16, bf16, fp32, reason),
        "bf16-pure": Precision("bf16-pure", bf16, bf16, bf16, reason),
    }[mode]


def cpu_bf16_pays(hidden_size: int, intermediate_size: int) -> tuple[bool, str]:
    """Whether bf16 matmuls at the model's shape run at least CPU_BF16_MIN_SPEEDUP times fp32's speed on this
    CPU, and the measurement that says so (what `train.precision=auto` and `eval.dtype=fastest` decide by)."""
    speedup, detail = cpu_bf16_speedup(hidden_size, intermediate_size)
    fast = speedup >= CPU_BF16_MIN_SPEEDUP
    return (
        fast,
        f"bf16 matmul {speedup:.2f}x fp32 ({detail}); {'>=' if fast else '<'} {CPU_BF16_MIN_SPEEDUP}x threshold",
    )


SCREEN_ROWS = 32  # a first bf16/fp32 timing this small, so that a CPU without a bf16 kernel is told in seconds
SCREEN_VERDICT = 0.25  # bf16 at most this fraction of fp32's speed there: no full probe, bf16 is not worth it


def matmul_seconds(dtype: torch.dtype, rows: int, hidden_size: int, intermediate_size: int, repeats: int = 5) -> float:
    """The best of `repeats` timings of a `rows x hidden @ hidden x intermediate` matmul in `dtype`."""
    a = torch.randn(rows, hidden_size, dtype=dtype)
    b = torch.randn(hidden_size, intermediate_size, dtype=dtype)
    a @ b  # warm-up (kernel selection, page faults)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return min(times)


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(hidden_size: int, intermediate_size: int, rows: int = 2048) -> tuple[float, str]:
    """bf16 over fp32 throughput of a `rows x hidden @ hidden x intermediate` matmul on this CPU (best of 5).
    A screen at SCREEN_ROWS rows comes first: where bf16 runs at under SCREEN_VERDICT of fp32's speed there, that
    is the answer, instead of a full probe that can take an hour (an AVX2-only AMD EPYC, no avx512_bf16, runs
    bf16 matmuls 50-140x slower than fp32: 85 s against 0.6 s for 256 x 4096 x 11008 on one thread)."""

    def best_seconds(dtype, n: int, repeats: int = 5) -> float:  # the shapes are this probe's
        return matmul_seconds(dtype, n, hidden_size, intermediate_size, repeats)

    screen = best_seconds(torch.float32, SCREEN_ROWS, 1) / best_seconds(torch.bfloat16, SCREEN_ROWS, 1)
    if screen < SCREEN_VERDICT:
        return screen, (
            f"screened at {SCREEN_ROWS}x{hidden_size}x{intermediate_size}: bf16 {1 / screen:.0f}x slower "
            f"than fp32, {torch.get_num_threads()} threads"
        )
    fp32, bf16 = best_seconds(torch.float32, rows), best_seconds(torch.bfloat16, rows)
    flops = 2 * rows * hidden_size * intermediate_size
    detail = (
        f"{rows}x{hidden_size}x{intermediate_size}: {flops / bf16 / 1e9:.0f} vs {flops / fp32 / 1e9:.0f} GFLOP/s, "
        f"{torch.get_num_threads()} threads"
    )
    return fp32 / bf16, detail


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
