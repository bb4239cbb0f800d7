"""Serve an exported model and the original in vLLM (CPU) at the same KV cache memory, and measure them.

Runs in the serve environment (stdlib + vllm + torch only; never this package): see docs/SERVING.md.

    .venv-serve/bin/python scripts/serve_bench.py EXPORT --original ORIGINAL [--out results/serve] \
        [--kv-gib 1] [--contexts 2048,4096,8192,16384] [--gen 32] [--time-budget 600]

For each model, in a child process of its own (a fresh engine, VLLM_CPU_KVCACHE_SPACE=--kv-gib): the engine's
KV cache capacity (tokens, blocks, maximum concurrency at max_model_len, as vLLM reports and logs them) and the
attention backend it picked (from its log); throughput per context: one request of 1 + --gen tokens, its prefill
and its decode split by the engine's own timestamps, until a model's measurements pass --time-budget seconds.
For the export also the prompt log-probabilities against our model's (EXPORT/reference_logprobs.json, written by
scripts/serve_prepare.py). Writes OUT/serve_bench.json and OUT/serve_bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path


def machine() -> dict:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "amx": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "python": platform.python_version(),
    }


def kv_elements(config: dict) -> int:
    """Cached elements per token and layer: the latent + rope key (MLA) or 2 * n_kv * d_h."""
    if config.get("kv_lora_rank"):
        return config["kv_lora_rank"] + config["qk_rope_head_dim"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim


# ---- the child: one model, one engine ------------------------------------------------------------------------------
def serve_one(model: str, max_model_len: int, contexts: list[int], gen: int, budget: float, with_logprobs: bool):
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t = time.time()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=max_model_len,
        enable_prefix_caching=False,  # every timed prompt is prefilled, never read from an earlier one
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics) for prefill vs decode
    )
    cache = llm.llm_engine.vllm_config.cache_config
    out = {
        "model": model,
        "load_s": round(time.time() - t, 1),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "max_model_len": max_model_len,
    }
    out["capacity_tokens"] = (cache.num_gpu_blocks or 0) * cache.block_size
    g = torch.Generator().manual_seed(1)
    if with_logprobs:
        ref = json.loads((Path(model) / "reference_logprobs.json").read_text())
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        results = llm.generate([{"prompt_token_ids": p} for p in ref["prompts"]], params, use_tqdm=False)
        rows = []
        for prompt, r, bf16, fp32 in zip(ref["prompts"], results, ref["logprobs_bf16"], ref["logprobs_fp32"]):
            served = [r.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i]
            rows.append(
                {
                    "tokens": len(prompt),
                    "max_abs_d_vs_ours_bf16": max(abs(a - b) for a, b in zip(served, bf16)),
                    "max_abs_d_vs_ours_fp32": max(abs(a - b) for a, b in zip(served, fp32)),
                    "ours_bf16_vs_fp32": max(abs(a - b) for a, b in zip(bf16, fp32)),
                    "mean_logprob_served": sum(served) / len(served),
                    "mean_logprob_ours_fp32": sum(fp32) / len(fp32),
                }
            )
        out["logprobs"] = rows
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 65))}], warm, use_tqdm=False)  # first-call costs, untimed
    timings, spent = [], 0.0
    for ctx in contexts:
        if spent > budget:
            timings.append({"context": ctx, "skipped": f"the time budget ({budget:.0f} s) was spent"})
            continue
        ids = torch.randint(1, 257, (ctx - 1 - gen,), generator=g).tolist()
        params = SamplingParams(max_tokens=1 + gen, min_tokens=1 + gen, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        try:
            (result,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        except Exception as e:  # an engine that dies (e.g. out of memory) ends the sweep; the cause is in its log
            timings.append({"context": ctx, "failed": f"{type(e).__name__}: {str(e)[:300]}"})
            break
        row = {"context": ctx, "prompt_tokens": len(ids), "wall_s": round(time.perf_counter() - t, 3)}
        spent += row["wall_s"]
        m = result.metrics  # the engine core's own timestamps: prefill = scheduled -> first token
        if m is None or not m.first_token_ts:
            raise RuntimeError("vLLM returned no request timestamps (RequestOutput.metrics)")
        row["prefill_s"] = round(m.first_token_ts - m.scheduled_ts, 3)
        row["decode_s"] = round(m.last_token_ts - m.first_token_ts, 3)
        row["prefill_tokens_per_s"] = round(len(ids) / row["prefill_s"], 1)
        row["decode_tokens_per_s"] = round(gen / row["decode_s"], 2)
        row["load_average_1min"] = round(os.getloadavg()[0], 2)  # the machine may be shared: say how busy it was
        timings.append(row)
        print(json.dumps(row), flush=True)
    out["throughput"] = timings
    return out


# ---- the parent: both models, the record ---------------------------------------------------------------------------
LOG_CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"
)
LOG_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
LOG_BACKEND = re.compile(r"(Using [^\n]*backend[^\n]*|[^\n]*attention backend[^\n]*)", re.IGNORECASE)


def run_child(model: Path, args, with_logprobs: bool) -> dict:
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    result = Path(args.out) / f".{model.name}.json"
    cmd = [sys.executable, __file__, "--child", str(model), "--child-out", str(result)]
    cmd += ["--max-model-len", str(args.max_model_len), "--contexts", args.contexts, "--gen", str(args.gen)]
    cmd += ["--time-budget", str(args.time_budget)] + (["--logprobs"] if with_logprobs else [])
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (Path(args.out) / f"{model.name}.log").write_text(log)
    record = json.loads(result.read_text()) if proc.returncode == 0 and result.exists() else {"model": str(model)}
    record["returncode"], record["wall_s"] = proc.returncode, round(time.time() - t, 1)
    if proc.returncode:
        record["error_tail"] = log[-3000:]
    found = LOG_CAPACITY.search(log)
    if found:
        record["logged_capacity_tokens"] = int(found.group(1).replace(",", ""))
        record["logged_max_concurrency"] = float(found.group(3))
    record["backend_lines"] = sorted({m.strip()[-200:] for m in LOG_BACKEND.findall(log) if "backend=gloo" not in m})
    if not any("Using" in line for line in record["backend_lines"]):  # vLLM logs only its MLA backend choices
        record["backend_lines"].append("no backend logged (non-MLA models: CPU_ATTN, platforms/cpu.py)")
    allocation = LOG_ALLOCATION.search(log)
    if allocation:  # the worker's own words when a context did not fit in memory
        record["failed_allocation_bytes"] = int(allocation.group(1))
    record["kv_elements_per_token_layer"] = kv_elements(json.loads((model / "config.json").read_text()))
    return record


def markdown(report: dict) -> str:
    exp, orig = report["export"], report["original"]
    lines = [
        "# vLLM (CPU) serving an MLA export against its original",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores (AMX: {report['machine']['amx']}); "
        f"vLLM {exp.get('vllm', '?')}, torch {exp.get('torch', '?')}; VLLM_CPU_KVCACHE_SPACE={report['kv_gib']} GiB, "
        f"max_model_len {report['max_model_len']}, bf16.",
        "",
    ]
    lines += [
        f"{n}: rows from an earlier run, `{r['command']}`"
        for n, r in (("original", orig), ("export", exp))
        if "command" in r
    ]
    lines += [
        "",
        "| model | cached elements / token / layer | KV capacity (tokens) | blocks | max concurrency | backend |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("original", orig), ("export", exp)):
        lines.append(
            f"| {name} | {r['kv_elements_per_token_layer']} | {r.get('logged_capacity_tokens')}"
            f" | {r.get('num_blocks')} | {r.get('logged_max_concurrency')} | {'; '.join(r['backend_lines'][:2])} |"
        )
    cap = report["capacity_ratio"]
    lines += ["", f"Capacity ratio export/original: {cap['engine']} (bytes formula: {cap['formula']}).", ""]
    if exp.get("logprobs"):
        lines += [
            "| prompt tokens | max abs dlogprob vs ours (bf16) | vs ours (fp32) | ours bf16 vs fp32 |",
            "|---|---|---|---|",
        ]
        for row in exp["logprobs"]:
            lines.append(
                f"| {row['tokens']} | {row['max_abs_d_vs_ours_bf16']:.4f} | {row['max_abs_d_vs_ours_fp32']:.4f}"
                f" | {row['ours_bf16_vs_fp32']:.4f} |"
            )
        lines.append("")
    lines += ["| context | model | prefill s | prefill tok/s | decode tok/s |", "|---|---|---|---|---|"]
    for name, r in (("original", orig), ("export", exp)):
        for row in r.get("throughput", []):
            if "skipped" in row or "failed" in row:
                why = row.get("skipped") or f"failed: {row['failed'][:120]}"
                lines.append(f"| {row['context']} | {name} | {why} | | |")
            else:
                lines.append(
                    f"| {row['context']} | {name} | {row['prefill_s']} | {row['prefill_tokens_per_s']}"
                    f" | {row['decode_tokens_per_s']} |"
                )
    for name, r in (("original", orig), ("export", exp)):
        if r.get("failed_allocation_bytes"):
            lines += ["", f"{name}: the worker failed to allocate {r['failed_allocation_bytes']:,} bytes (its log)."]
        if r.get("returncode"):
            lines += ["", f"{name} failed (exit {r['returncode']}); the log's end:", "", "```", r["error_tail"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", nargs="?")
    parser.add_argument("--original")
    parser.add_argument("--out", default="results/serve")
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--contexts", default="2048,4096,8192,16384")
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds of timed generation per model")
    parser.add_argument("--only", choices=("export", "original"), help="serve one of the two (the other: skipped)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--logprobs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.child:
        result = serve_one(args.child, args.max_model_len, contexts, args.gen, args.time_budget, args.logprobs)
        Path(args.child_out).write_text(json.dumps(result, indent=1))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "kv_gib": args.kv_gib,
        "max_model_len": args.max_model_len,
    }
    earlier = json.loads((out / "serve_bench.json").read_text()) if (out / "serve_bench.json").exists() else {}
    for name, path, logprobs in (("original", args.original, False), ("export", args.export, True)):
        if args.only and args.only != name:  # the other model's record from the earlier run, with its command
            report[name] = earlier[name] | {"command": earlier.get("command")}
            continue
        report[name] = run_child(Path(path), args, logprobs)
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "error_tail"}), flush=True)
    exp, orig = report["export"], report["original"]
    engine = None
    if exp.get("logged_capacity_tokens") and orig.get("logged_capacity_tokens"):
        engine = round(exp["logged_capacity_tokens"] / orig["logged_capacity_tokens"], 3)
    formula = None
    if exp.get("kv_elements_per_token_layer") and orig.get("kv_elements_per_token_layer"):
        formula = round(orig["kv_elements_per_token_layer"] / exp["kv_elements_per_token_layer"], 3)
    report["capacity_ratio"] = {"engine": engine, "formula": formula}
    report["export_record"] = json.loads((Path(args.export) / "export.json").read_text())
    (out / "serve_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve_bench.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the engine must be created under this guard
    raise SystemExit(main())
