"""`python -m mha2mla_exp.bench.eval_speed`: commonsense evaluation throughput (docs/s) of one model by
inference dtype and lm-eval batch size, on a fixed doc sample, and how often each setting changes the
model's per-document answers against the first (reference) setting.

Writes eval_speed.json (settings, seconds, docs/s, answer agreement, the machine: CPU model name and
flags, threads, load average before and after every setting: the machine may be shared) and
eval_speed.md under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import atomic
from ..evaluation.commonsense import evaluate_commonsense
from ..evaluation.lm import EvalLM
from ..models import DTYPES, load_model
from ..schema.commonsense_suite import suite
from ..schema.sections import CommonsenseConfig, ModelConfig


def lscpu() -> dict:
    """CPU model name and flags (Linux lscpu), or what platform knows elsewhere."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"model_name": platform.processor() or platform.machine(), "flags": None}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return {
        "model_name": fields.get("Model name"),
        "flags": fields.get("Flags"),
        "cpus": fields.get("CPU(s)"),
        "bf16_instructions": [f for f in ("avx512_bf16", "amx_bf16") if f in (fields.get("Flags") or "").split()],
    }


def scored_answer(row: dict) -> int:
    """The choice the column's metric scores: argmax of length-normalised ll for acc_norm columns."""
    metric = suite()[row["column"]].metric
    return row["pred_norm"] if metric == "acc_norm" else row["pred"]


def agreement(reference: list[dict], rows: list[dict]) -> dict:
    """Share of docs whose scored answer is the same in both runs (same docs, any order)."""
    ref = {(r["task"], r["doc_id"]): scored_answer(r) for r in reference}
    other = {(r["task"], r["doc_id"]): scored_answer(r) for r in rows}
    if ref.keys() != other.keys():
        raise ValueError("agreement: the two runs evaluated different docs")
    same = sum(ref[k] == other[k] for k in ref)
    return {"docs": len(ref), "same_answer": same, "share": same / len(ref)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.eval_speed", description=__doc__)
    p.add_argument(
        "--settings",
        default="float32:16,bfloat16:1,bfloat16:8,bfloat16:16,bfloat16:32,bfloat16:64",
        help="dtype:batch_size list; the first is the reference (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=60, help="docs per task (default %(default)s)")
    p.add_argument("--mmlu-limit", type=int, default=1, help="docs per MMLU subject (default %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="offline asset name (default %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("results/bench/cpu_eval"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = []
    for item in args.settings.split(","):
        dtype, _, batch = item.partition(":")
        if dtype not in DTYPES or not batch.isdigit():
            raise SystemExit(f"--settings {item!r}: expected dtype:batch_size with dtype in {sorted(DTYPES)}")
        settings.append((dtype, int(batch)))
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load_model(ModelConfig(name=args.model, source="asset", id=args.model, dtype="float32"))
    cfg = CommonsenseConfig(limit=args.limit, mmlu_limit=args.mmlu_limit)
    results, reference = [], None
    for dtype, batch in settings:
        model = copy.deepcopy(base).to(DTYPES[dtype])
        load_before = os.getloadavg()
        started, cpu_started = time.perf_counter(), time.process_time()
        scores, meta, rows = evaluate_commonsense(EvalLM(model, tokenizer, batch_size=batch), cfg)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        reference = reference or rows
        # CPU seconds (all threads of this process) are less sensitive than wall seconds to other jobs' load
        result = {
            "dtype": dtype,
            "batch_size": batch,
            "seconds": round(seconds, 2),
            "docs": len(rows),
            "docs_per_s": round(len(rows) / seconds, 3),
            "cpu_seconds": round(cpu_seconds, 2),
            "docs_per_cpu_s": round(len(rows) / cpu_seconds, 3),
            "avg": scores["avg"],
            "agreement_with_reference": agreement(reference, rows),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        }
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if not k.startswith("load")}), flush=True)
        del model
    machine = {
        "cpu": lscpu(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record = {
        "command": "python -m mha2mla_exp.bench.eval_speed " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "docs_per_task": args.limit,
        "mmlu_per_subject": args.mmlu_limit,
        "reference": f"{settings[0][0]}, batch {settings[0][1]}",
        "machine": machine,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(args.out / "eval_speed.json", json.dumps(record, indent=1) + "\n")
    atomic.write_text(args.out / "eval_speed.md", markdown(record))
    return 0


def markdown(record: dict) -> str:
    ref = record["results"][0]
    lines = [
        f"# Commonsense evaluation speed: {record['model']}",
        "",
        f"`{record['command']}`",
        "",
        f"{record['results'][0]['docs']} docs ({record['docs_per_task']} per task, {record['mmlu_per_subject']} "
        f"per MMLU subject); CPU {record['machine']['cpu']['model_name']}, torch {record['machine']['torch']}, "
        f"{record['machine']['torch_threads']} threads; bf16 instructions: "
        f"{', '.join(record['machine']['cpu']['bf16_instructions']) or 'none'}. Answers compared with the "
        f"reference ({record['reference']}) on the scored choice of every doc.",
        "",
        "| dtype | batch | seconds | docs/s | speed-up | docs per CPU-s | speed-up (CPU) | same answers | Avg "
        "| load avg (1 min) before → after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["results"]:
        a = r["agreement_with_reference"]
        cpu = (
            f"{r['docs_per_cpu_s']:.2f} | {r['docs_per_cpu_s'] / ref['docs_per_cpu_s']:.1f}x"
            if "docs_per_cpu_s" in r and "docs_per_cpu_s" in ref
            else " | "
        )
        lines.append(
            f"| {r['dtype']} | {r['batch_size']} | {r['seconds']:.0f} | {r['docs_per_s']:.2f} | "
            f"{r['docs_per_s'] / ref['docs_per_s']:.1f}x | {cpu} | {a['same_answer']}/{a['docs']} "
            f"({100 * a['share']:.1f} %) | {100 * r['avg']:.2f} | "
            f"{r['load_average_before'][0]:.1f} → {r['load_average_after'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
