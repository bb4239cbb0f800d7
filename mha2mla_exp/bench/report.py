"""Writing results: CSV files, the plots, and machine.json (what the numbers were measured on)."""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from .. import atomic


def write_csv(rows: list[dict], path: Path) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with atomic.atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "load_average_at_start": os.getloadavg(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "gpu_sms": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    return info


def write_machine(info: dict, path: Path) -> None:
    info = dict(info, load_average_at_end=os.getloadavg())
    atomic.write_text(path, json.dumps(info, indent=1) + "\n")


def plot(decode_rows: list[dict], attention_rows: list[dict], path: Path) -> None:
    """Left panels: decode-step latency vs context per shape and batch; last panel: attention-only
    speedups over MHA SDPA against the bytes-ratio bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in decode_rows if r.get("status") == "ok"]
    panels = sorted({(r["shape"], r["batch"]) for r in ok})
    attn = [r for r in attention_rows if r.get("status") == "ok"]
    n = len(panels) + (1 if attn else 0)
    cols = min(3, max(n, 1))
    rows_n = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    flat = axes.ravel()
    for ax, (shape, batch) in zip(flat, panels):
        for variant in dict.fromkeys(r["variant"] for r in ok):
            pts = sorted(
                (r["context"], r["step_s_median"] * 1e3, r["step_s_q1"] * 1e3, r["step_s_q3"] * 1e3)
                for r in ok
                if r["shape"] == shape and r["batch"] == batch and r["variant"] == variant
            )
            if pts:
                x, y, lo, hi = zip(*pts)
                ax.errorbar(
                    x,
                    y,
                    yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]],
                    marker="o",
                    capsize=3,
                    label=variant,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape}, batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode step (ms, median, IQR bars)")
        ax.legend(fontsize=7)
    if attn:
        ax = flat[len(panels)]
        labels = sorted({(r["batch"], r["context"]) for r in attn})
        variants = [v for v in dict.fromkeys(r["variant"] for r in attn) if v != "mha_sdpa"]
        width = 0.8 / max(1, len(variants))
        for i, variant in enumerate(variants):
            ys = [
                next(
                    (
                        r["speedup_vs_mha"]
                        for r in attn
                        if (r["batch"], r["context"]) == lab and r["variant"] == variant
                    ),
                    0.0,
                )
                for lab in labels
            ]
            ax.bar([j + i * width for j in range(len(labels))], ys, width, label=variant)
        ax.axhline(attn[0]["bound"], color="k", ls="--", label=f"bytes bound {attn[0]['bound']:.1f}x")
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(labels))], [f"b{b}/{s // 1024}k" for b, s in labels], fontsize=7
        )
        ax.set_ylabel("speedup over MHA SDPA")
        ax.set_title("attention only, Llama-2-7B layer")
        ax.legend(fontsize=7)
    for ax in flat[n:]:
        ax.axis("off")
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip("."))
    plt.close(fig)
