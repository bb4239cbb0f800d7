"""The machine a number was made on: device, processor model and its bf16-relevant flags, threads, load.

Every timing this project records sits next to this block (timings scale with the processor, its bf16
instructions and the threads torch uses), so it lives below every layer that measures something.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_info(device: torch.device, processes: int = 1) -> dict:
    """The machine a number was made on: device, processor model and its bf16-relevant flags, threads, load."""
    info = {
        "device": device.type,
        "processes": processes,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),  # timings scale with it (OMP_NUM_THREADS)
        "allocator": allocator(),
    }
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    else:
        info["name"] = f"{os.cpu_count()}-core {info['cpu']['model']}"
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)  # a shared machine slows every timing
    except OSError:
        pass
    return info


_BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def cpu_model() -> dict:
    """The CPU's model name and which bf16-relevant instruction sets it has (from /proc/cpuinfo, as lscpu)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags and model:
                break
    except OSError:
        pass
    return {"model": model, "bf16_flags": [f for f in _BF16_FLAGS if f in flags]}


def allocator() -> str:
    """The malloc this process runs on: `tcmalloc` or `jemalloc` when one is loaded (LD_PRELOAD), else `glibc`.
    On CPU it matters: glibc maps and unmaps every tensor above 32 MB afresh, and each new page faults and is
    zeroed again (results/bench/cpu_train/: tcmalloc trains 2-core EPYC fp32 steps about a quarter faster)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"
