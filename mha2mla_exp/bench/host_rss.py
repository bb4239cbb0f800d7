"""Peak host memory of a 2-process FSDP fine-tune on CPU against the plan's host estimate (issue 53).

    python -m mha2mla_exp.bench.host_rss [--out results/bench/host_rss] [--processes 2]

Launches `torchrun --nproc_per_node N -m mha2mla_exp` on a random Llama whose weights dominate a process's memory
(~47M parameters, the model of tests/test_fsdp_memory.py) with `train.strategy=fsdp`: load, convert, shard, train
with a checkpoint, gather the trained model, save it. Each process notes its peak RSS before loading and after
training (train/recipe.py `MHA2MLA_PEAK_RSS_DIR`); the whole launch's largest process peak, the final save
included, is the children's ru_maxrss. The estimate is the one the plan prints (`validate`, train/memory.py
`estimate_host_memory` with device_type cpu: what a GPU holds is on the host here). Writes host_rss.json and
host_rss.md with the machine. A benchmark, not a test: its numbers depend on the machine's allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import atomic

ROOT = Path(__file__).resolve().parents[2]
MODEL = [
    "model=tiny_random",
    "model.shape.num_layers=12",
    "model.shape.hidden_size=512",
    "model.shape.num_heads=8",
    "model.shape.num_kv_heads=4",
    "model.shape.head_dim=64",
    "model.intermediate_size=2048",
    "rope=2-norm",
    "rope.r=2",
    "svd.d_kv=8",
]
# a tiny run: a few fp32 steps on a slice of the offline corpus, no evaluation but the held-out perplexity (also
# what the tests launch, tests/launches.py)
TINY_RUN = [
    "train=smoke",
    "train.precision=fp32",
    "train.checkpoint_every=2",
    "eval=none",
    "logger=none",
    "data.max_documents=24",
    "calibration.num_sequences=4",
    "calibration.seq_len=32",
    "calibration.batch_size=2",
    "kv_measure_tokens=64",
]
RUN = [*TINY_RUN, "train.tokens=1536", "train.micro_batch_size=4", "train.grad_accum=1", "train.strategy=fsdp"]
GB = 1e9


def estimate(processes: int) -> dict:
    """The plan's host estimate for this launch (validate on this machine, WORLD_SIZE = processes)."""
    from hydra import compose, initialize_config_dir

    from ..confutil import CONF_DIR
    from ..runner import run_config, validate

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(processes)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            # gpu_memory_gb asks for the memory plan; a CPU run is not refused by it
            cfg = compose(config_name="config", overrides=[*MODEL, *RUN, "train.gpu_memory_gb=1000"])
        plan = validate(run_config(cfg))
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous
    host = plan.training.host_memory
    return {
        "describe": host.describe(),
        "parameters": plan.training.memory.parameters,
        "runtime_bytes": host.runtime_bytes,
        "main_parts": host.main,
        "other_parts": host.other,
        "main_gb": host.main_gb,
        "other_gb": host.other_gb,
    }


def measure(processes: int, work: Path) -> dict:
    """Peak RSS of each process (before loading, after training) and of the launch's largest process."""
    from ..train.recipe import PEAK_RSS_DIR_ENV

    rss = work / "rss"
    rss.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "mha2mla_exp",
        *MODEL,
        *RUN,
        f"results_dir={work / 'runs'}",
    ]
    # glibc's dynamic mmap threshold keeps freed buffers of up to 32 MB in its heap: a fixed one measures what was held
    env = dict(
        os.environ,
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="131072",
        **{PEAK_RSS_DIR_ENV: str(rss)},
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    ranks = {p.stem: json.loads(p.read_text()) for p in sorted(rss.glob("rank*.json"))}
    return {
        "command": " ".join(cmd[1:]),
        "seconds": round(seconds, 1),
        "ranks": ranks,
        "largest_process_peak_bytes": largest if largest > before * 1024 else None,
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from ..machine import machine_info

    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.host_rss", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "host_rss")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    planned = estimate(args.processes)
    with tempfile.TemporaryDirectory(prefix="mha2mla_host_rss_") as work:
        measured = measure(args.processes, Path(work))
    main_rank, other_rank = measured["ranks"]["rank0"], measured["ranks"].get("rank1", {})
    rows = {
        "main": (main_rank["after_training"], planned["main_gb"] * GB),
        "other": (other_rank.get("after_training"), planned["other_gb"] * GB),
    }
    parts = {"main": planned["main_parts"], "other": planned["other_parts"]}
    before = {"main": main_rank["before_load"], "other": other_rank.get("before_load")}
    comparison = {
        name: {
            "measured_peak_bytes": peak,
            "estimate_bytes": est,
            "measured_over_estimate": round(peak / est, 3) if peak else None,
            # what the run added above the runtime, against the estimate's parts (no runtime, no slack)
            "measured_growth_bytes": peak - before[name] if peak else None,
            "estimated_parts_bytes": sum(parts[name].values()),
        }
        for name, (peak, est) in rows.items()
    }
    record = {
        "machine": machine_info(torch.device("cpu"), args.processes),
        "processes": args.processes,
        "estimate": planned,
        "measured": measured,
        "comparison": comparison,
        "command": f"python -m mha2mla_exp.bench.host_rss --processes {args.processes}",
    }
    atomic.write_json(args.out / "host_rss.json", record, default=str)
    lines = [
        f"# Host memory of a {args.processes}-process FSDP fine-tune on CPU against its estimate",
        "",
        f"`{record['command']}` ({measured['seconds']} s), {planned['parameters'] / 1e6:.1f}M parameters.",
        "",
        f"Estimate (the plan's line): {planned['describe']}",
        "",
        "| process | measured peak RSS (GB) | estimate (GB) | measured / estimate | growth above the runtime (GB) "
        "| the estimate's parts (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in comparison.items():
        peak = row["measured_peak_bytes"]
        lines.append(
            f"| {name} | {peak / GB:.3f} | {row['estimate_bytes'] / GB:.3f} | {row['measured_over_estimate']} | "
            f"{row['measured_growth_bytes'] / GB:.3f} | {row['estimated_parts_bytes'] / GB:.3f} |"
            if peak
            else f"| {name} | - | {row['estimate_bytes'] / GB:.3f} | - | - | {row['estimated_parts_bytes'] / GB:.3f} |"
        )
    largest = measured["largest_process_peak_bytes"]
    lines += [
        "",
        f"Largest process over the whole launch (the final save included, children's ru_maxrss): {largest / GB:.3f} GB."
        if largest
        else "",
        "Runtime before loading (each rank's peak before any weight): "
        + ", ".join(f"{r} {v['before_load'] / GB:.3f} GB" for r, v in measured["ranks"].items())
        + f"; the estimate assumes {planned['runtime_bytes'] / GB:.1f} GB.",
        "",
        f"Machine: {json.dumps(record['machine'], default=str)}",
        "",
    ]
    atomic.write_text(args.out / "host_rss.md", "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
