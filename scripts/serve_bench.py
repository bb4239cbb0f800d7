"""Serve an exported model and the original in vLLM (CPU) at the same KV cache memory, measure them, and fail when
the export is served wrongly.

Runs in the serve environment (stdlib + vllm + torch + the transformers vLLM pins; never this package): see
docs/SERVING.md.

    .venv-serve/bin/python scripts/serve_bench.py EXPORT --original ORIGINAL [--out runs/serve_bench] \
        [--kv-gib 1] [--contexts 2048,4096] [--gen 32] [--greedy 16] [--prefill-limit 4096,6144,8192] \
        [--prefill-limit-original 8192,16384]

Every engine runs in a child process of its own, one at a time (VLLM_CPU_KVCACHE_SPACE=--kv-gib):
1. the original, bf16: KV capacity (tokens, blocks, concurrency, as vLLM logs them), backend, speed per context;
2. the export, bf16, vLLM's default mode: the same, and its prompt log-probabilities against our model's
   (EXPORT/reference_logprobs.json, written by scripts/serve_prepare.py);
3. the export, bf16, eager mode (`enforce_eager=True`, where vLLM 0.32's C++ rotary op served `rope_type:
   default` wrongly, issue 54): the same log-probabilities;
4. the export, fp32, eager mode: log-probabilities and --greedy greedy tokens; 5. the same in stock transformers.
Checks (the exit status is 1 when one fails; the records are written first): default vs eager log-probs within
bf16 rounding (twice our own model's bf16-vs-fp32 difference: each mode may be that far from fp32); greedy tokens
equal between vLLM and transformers in fp32; the capacity ratio equal to the bytes formula; vLLM's rope table for
the export's config equal to its default rope's, bit for bit. --prefill-limit: one fresh engine per context
length (ascending, stopping at the first failure), its prefill time and the peak memory of its largest process;
a length whose MLA score matrix (heads x L^2 fp32, vLLM's CPU MLA prefill) would not fit in the memory available
now is skipped, not tried, since the machine may be shared. Writes OUT/serve_bench.json and OUT/serve_bench.md
(and OUT/prefill_limit.json).
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
        "memory_gib": round(meminfo("MemTotal") / 2**30, 1),
        "python": platform.python_version(),
    }


def meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes."""
    line = next(line for line in open("/proc/meminfo") if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and all its descendants now (0 for a process that just ended)."""
    try:
        rss = int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")).split()[1]) * 1024
        children = " ".join(Path(t, "children").read_text() for t in Path(f"/proc/{pid}/task").iterdir())
    except (OSError, StopIteration):
        return 0
    return rss + sum(tree_rss(int(c)) for c in children.split())


def kv_elements(config: dict) -> int:
    """Cached elements per token and layer: the latent + rope key (MLA) or 2 * n_kv * d_h."""
    if config.get("kv_lora_rank"):
        return config["kv_lora_rank"] + config["qk_rope_head_dim"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---- the children: one engine (or stock transformers) each -------------------------------------------------------
def serve_one(args) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t = time.time()
    llm = LLM(
        model=args.child,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        enable_prefix_caching=False,  # every timed prompt is prefilled, never read from an earlier one
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics) for prefill vs decode
    )
    cache = llm.llm_engine.vllm_config.cache_config
    out = {
        "model": args.child,
        "dtype": args.dtype,
        "eager": args.eager,
        "load_s": round(time.time() - t, 1),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "max_model_len": args.max_model_len,
        "capacity_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
    }
    if args.logprobs:
        prompts = json.loads((Path(args.child) / "reference_logprobs.json").read_text())["prompts"]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out["logprobs"] = [
            [r.prompt_logprobs[i][tok].logprob for i, tok in enumerate(p) if i] for p, r in zip(prompts, results)
        ]
    if args.greedy:
        prompts = json.loads((Path(args.child) / "reference_logprobs.json").read_text())["prompts"]
        params = SamplingParams(max_tokens=args.greedy, temperature=0.0, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out["greedy"] = [list(r.outputs[0].token_ids) for r in results]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if contexts:
        out["throughput"] = timings(llm, contexts, args)
    return out


def timings(llm, contexts: list[int], args) -> list[dict]:
    """One request per context (prompt of context - 1 - gen random tokens, then 1 + gen tokens), its prefill and
    decode split by the engine's own timestamps, until --time-budget seconds are spent."""
    import torch
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(1)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 65))}], warm, use_tqdm=False)  # first-call costs, untimed
    rows, spent = [], 0.0
    for ctx in contexts:
        if spent > args.time_budget:
            rows.append({"context": ctx, "skipped": f"the time budget ({args.time_budget:.0f} s) was spent"})
            continue
        ids = torch.randint(1, 257, (ctx - 1 - args.gen,), generator=g).tolist()
        params = SamplingParams(max_tokens=1 + args.gen, min_tokens=1 + args.gen, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        (result,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        row = {"context": ctx, "prompt_tokens": len(ids), "wall_s": round(time.perf_counter() - t, 3)}
        spent += row["wall_s"]
        m = result.metrics  # the engine core's own timestamps: prefill = scheduled -> first token
        if m is None or not m.first_token_ts:
            raise RuntimeError("vLLM returned no request timestamps (RequestOutput.metrics)")
        row["prefill_s"] = round(m.first_token_ts - m.scheduled_ts, 3)
        row["decode_s"] = round(m.last_token_ts - m.first_token_ts, 3)
        row["prefill_tokens_per_s"] = round(len(ids) / row["prefill_s"], 1)
        row["decode_tokens_per_s"] = round(args.gen / row["decode_s"], 2)
        row["load_average_1min"] = round(os.getloadavg()[0], 2)  # the machine may be shared: say how busy it was
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def transformers_one(args) -> dict:
    """Stock transformers on the exported folder (fp32): the same prompts' log-probs and greedy tokens."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.child, dtype=torch.float32).eval()
    prompts = json.loads((Path(args.child) / "reference_logprobs.json").read_text())["prompts"]
    out = {"model": args.child, "engine": f"transformers {transformers.__version__}", "class": type(model).__name__}
    out["logprobs"], out["greedy"] = [], []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            logp = torch.log_softmax(model(input_ids=x).logits.float(), dim=-1)[0, :-1]
            out["logprobs"].append(logp.gather(-1, x[0, 1:, None])[:, 0].tolist())
            ids = model.generate(x, max_new_tokens=args.greedy, min_new_tokens=args.greedy, do_sample=False)
            out["greedy"].append(ids[0, len(p) :].tolist())
    return out


def rope_check(export: Path) -> dict:
    """vLLM's rope for the export's config, built as its deepseek_v2.py builds it, against its default rope at the
    same theta: the class, its mscale, and whether the cos/sin tables are equal bit for bit."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = json.loads((export / "config.json").read_text())
    parameters = dict(config["rope_parameters"])
    if parameters["rope_type"] != "default":  # deepseek_v2.py: every non-default rope_type becomes DeepSeek's YaRN
        parameters["rope_type"] = (
            "deepseek_llama_scaling" if parameters.get("attention_factor") == 1.0 else "deepseek_yarn"
        )
    size, positions = config["qk_rope_head_dim"], config["max_position_embeddings"]
    with set_current_vllm_config(VllmConfig()):
        served = get_rope(size, max_position=positions, is_neox_style=False, rope_parameters=parameters)
        default = get_rope(
            size,
            max_position=positions,
            is_neox_style=False,
            rope_parameters={"rope_type": "default", "rope_theta": parameters["rope_theta"]},
        )
    return {
        "rope_parameters": config["rope_parameters"],
        "class": type(served).__name__,
        "has_its_own_cpu_kernel": "forward_cpu" in type(served).__dict__,
        "mscale": getattr(served, "mscale", 1.0),
        "cos_sin_equal_to_default": bool(torch.equal(served.cos_sin_cache, default.cos_sin_cache)),
    }


def prefill_one(args) -> dict:
    """A fresh engine, one prompt of --child-context tokens, one token out: did it prefill, and how long."""
    import torch
    from vllm import LLM, SamplingParams

    ctx = args.child_context
    llm = LLM(
        model=args.child,
        dtype="bfloat16",
        max_model_len=ctx + 1,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=False,  # the request's timestamps
    )
    ids = torch.randint(1, 257, (ctx,), generator=torch.Generator().manual_seed(2)).tolist()
    t = time.perf_counter()
    (result,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    m = result.metrics
    return {
        "context": ctx,
        "wall_s": round(time.perf_counter() - t, 1),
        "prefill_s": round(m.first_token_ts - m.scheduled_ts, 1),
    }


# ---- the parent: the engines one at a time, the checks, the record ------------------------------------------------
LOG_CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"
)
LOG_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
LOG_BACKEND = re.compile(r"(Using [^\n]*backend[^\n]*|[^\n]*attention backend[^\n]*)", re.IGNORECASE)


def run_child(model: Path, name: str, args, *flags: str) -> dict:
    """A child process (this script, --child) and its record; the log is kept as OUT/NAME.log. The peak memory:
    the largest sum of the resident sets of the child's process tree (it, the engine core, its worker), sampled
    every 0.5 s (pages the processes share are counted in each)."""
    # vLLM's engine gives up on a model step after 300 s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS); a 7B-shaped 4k prefill
    # on 2 busy cores took longer, and the engine died mid-measurement: an hour, unless the caller says otherwise
    env = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600"} | os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    result = Path(args.out) / f".{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", str(model), "--child-out", str(result), *flags]
    log_path = Path(args.out) / f"{name}.log"
    t = time.time()
    peak = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.5)
    log = log_path.read_text()
    ok = proc.returncode == 0 and result.exists()
    record = json.loads(result.read_text()) if ok else {"model": str(model)}
    result.unlink(missing_ok=True)
    record |= {"returncode": proc.returncode, "wall_s": round(time.time() - t, 1), "log": log_path.name}
    record["peak_rss_gib"] = round(peak / 2**30, 2)
    if not ok:
        record["error_tail"] = log[-3000:]
    found = LOG_CAPACITY.search(log)
    if found:
        record["logged_capacity_tokens"] = int(found.group(1).replace(",", ""))
        record["logged_max_concurrency"] = float(found.group(3))
    record["backend_lines"] = sorted({m.strip()[-200:] for m in LOG_BACKEND.findall(log) if "backend=gloo" not in m})
    allocation = LOG_ALLOCATION.search(log)
    if allocation:  # the worker's own words when a context did not fit in memory
        record["failed_allocation_bytes"] = int(allocation.group(1))
    print(name, json.dumps({k: v for k, v in record.items() if k not in ("error_tail", "logprobs")}), flush=True)
    return record


def engine_flags(args, *, dtype="bfloat16", eager=False, logprobs=False, greedy=0, contexts="") -> list[str]:
    flags = ["--dtype", dtype, "--max-model-len", str(args.max_model_len), "--contexts", contexts]
    flags += ["--gen", str(args.gen), "--time-budget", str(args.time_budget), "--greedy", str(greedy)]
    return flags + ["--eager"] * eager + ["--logprobs"] * logprobs


def prefill_limit(model: Path, name: str, lengths: list[int], args) -> list[dict]:
    """Ascending lengths, one fresh engine each, until one fails; lengths whose MLA score matrix would not fit in
    the memory available now are skipped (a shared machine: never push others' work into the OOM killer)."""
    config = json.loads((model / "config.json").read_text())
    rows = []
    for ctx in lengths:
        available = meminfo("MemAvailable")
        need = config["num_attention_heads"] * ctx * ctx * 4 if config.get("kv_lora_rank") else 0
        why = "its MLA prefill's score matrix (heads x L^2 fp32)"
        if need and rows and rows[-1].get("ok"):  # the last length's measured peak, grown as L^2
            need = max(need, rows[-1]["peak_rss_gib"] * 2**30 * (ctx / rows[-1]["context"]) ** 2)
            why = "the last length's peak memory x (L / its L)^2"
        if need > 0.8 * available:
            rows.append(
                {
                    "context": ctx,
                    "skipped": f"{why}, {need / 2**30:.1f} GiB, exceeds 0.8 x the memory available now "
                    f"({available / 2**30:.1f} GiB)",
                }
            )
            break
        record = run_child(model, f"prefill_{name}_{ctx}", args, "--prefill", "--child-context", str(ctx))
        row = {"context": ctx, "ok": record["returncode"] == 0, "peak_rss_gib": record["peak_rss_gib"]}
        row |= {k: record[k] for k in ("prefill_s", "wall_s", "failed_allocation_bytes") if k in record}
        row["memory_available_before_gib"] = round(available / 2**30, 1)
        if not row["ok"]:
            row["returncode"], row["log"] = record["returncode"], record["log"]
        rows.append(row)
        if not row["ok"]:
            break
    return rows


def check(report: dict) -> dict:
    """The checks that make the exit status: each with its numbers and pass/fail."""
    ref = report["reference"]
    ours_bf16 = [max_abs_diff(b, f) for b, f in zip(ref["logprobs_bf16"], ref["logprobs_fp32"])]
    tolerance = 2 * max(ours_bf16)
    default, eager = report["export"].get("logprobs"), report["export_eager"].get("logprobs")
    checks = {}
    if default and eager:
        d = [max_abs_diff(a, b) for a, b in zip(default, eager)]
        checks["default_vs_eager_logprobs"] = {
            "max_abs_d_per_prompt": d,
            "tolerance": tolerance,
            "why": "twice our model's own bf16 vs fp32 difference (each mode may be that far from fp32)",
            "pass": max(d) <= tolerance,
        }
    else:
        checks["default_vs_eager_logprobs"] = {"pass": False, "why": "an engine failed (its log)"}
    vllm32, hf32 = report["export_fp32"], report["transformers_fp32"]
    if vllm32.get("greedy") and hf32.get("greedy"):
        checks["greedy_fp32_vllm_vs_transformers"] = {
            "tokens_per_prompt": [len(g) for g in hf32["greedy"]],
            "equal": [a == b for a, b in zip(vllm32["greedy"], hf32["greedy"])],
            "logprobs_max_abs_d": [max_abs_diff(a, b) for a, b in zip(vllm32["logprobs"], hf32["logprobs"])],
            "pass": vllm32["greedy"] == hf32["greedy"],
        }
    else:
        checks["greedy_fp32_vllm_vs_transformers"] = {"pass": False, "why": "a run failed (its log)"}
    cap = report["capacity_ratio"]
    checks["capacity_is_the_formula"] = {**cap, "pass": cap["engine"] is not None and cap["engine"] == cap["formula"]}
    rope = report["rope"]
    checks["rope_table_equal_to_default"] = {"pass": rope["cos_sin_equal_to_default"] and rope["mscale"] == 1.0}
    return checks


def markdown(report: dict) -> str:
    exp, orig, m = report["export"], report["original"], report["machine"]
    lines = [
        "# vLLM (CPU) serving an MLA export against its original",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores (AMX: {m['amx']}), {m['memory_gib']} GiB; "
        f"vLLM {exp.get('vllm', '?')}, torch {exp.get('torch', '?')}; VLLM_CPU_KVCACHE_SPACE={report['kv_gib']} GiB, "
        f"max_model_len {report['max_model_len']}.",
        "",
        "| check | result |",
        "|---|---|",
    ]
    for name, c in report["checks"].items():
        shown = {k: v for k, v in c.items() if k != "pass"}
        lines.append(f"| {name} | **{'pass' if c['pass'] else 'FAIL'}** {json.dumps(shown)} |")
    lines += [
        "",
        "| model | cached elements / token / layer | KV capacity (tokens) | blocks | max concurrency | backend |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("original", orig), ("export", exp)):
        backend = "; ".join(r["backend_lines"][:2]) or "no MLA backend logged (CPU_ATTN)"
        lines.append(
            f"| {name} | {r['kv_elements_per_token_layer']} | {r.get('logged_capacity_tokens')}"
            f" | {r.get('num_blocks')} | {r.get('logged_max_concurrency')} | {backend} |"
        )
    ref = report["reference"]
    lines += [
        "",
        "Prompt log-probabilities, max |d| per prompt ("
        + ", ".join(str(len(p)) for p in ref["prompts"])
        + " tokens): served export (bf16) against our model; ours bf16 against ours fp32 (bf16's own rounding).",
        "",
        "| served | vs ours bf16 | vs ours fp32 |",
        "|---|---|---|",
    ]
    for name in ("export", "export_eager"):
        served = report[name].get("logprobs")
        if served:
            vs16 = [f"{max_abs_diff(s, b):.4f}" for s, b in zip(served, ref["logprobs_bf16"])]
            vs32 = [f"{max_abs_diff(s, f):.4f}" for s, f in zip(served, ref["logprobs_fp32"])]
            lines.append(f"| {name} | {' / '.join(vs16)} | {' / '.join(vs32)} |")
    ours = [f"{max_abs_diff(b, f):.4f}" for b, f in zip(ref["logprobs_bf16"], ref["logprobs_fp32"])]
    lines += [f"| (ours bf16) | | {' / '.join(ours)} |", ""]
    lines += ["| context | model | prefill s | prefill tok/s | decode tok/s | load avg |", "|---|---|---|---|---|---|"]
    for name, r in (("original", orig), ("export", exp)):
        for row in r.get("throughput", []):
            if "skipped" in row:
                lines.append(f"| {row['context']} | {name} | {row['skipped']} | | | |")
            else:
                lines.append(
                    f"| {row['context']} | {name} | {row['prefill_s']} | {row['prefill_tokens_per_s']}"
                    f" | {row['decode_tokens_per_s']} | {row['load_average_1min']} |"
                )
    for name in ("original", "export", "export_eager", "export_fp32", "transformers_fp32"):
        r = report[name]
        if r.get("returncode"):
            lines += ["", f"{name} failed (exit {r['returncode']}); the log's end:", "", "```", r["error_tail"], "```"]
    return "\n".join(lines) + "\n"


def prefill_markdown(limits: dict) -> str:
    lines = [
        "# vLLM (CPU) prefill limit: the longest prompt each model prefills",
        "",
        f"Command: `{limits['command']}`  ",
        f"Machine: {limits['machine']['cpu']}, {limits['machine']['cores']} cores, {limits['machine']['memory_gib']} "
        f"GiB (shared); VLLM_CPU_KVCACHE_SPACE={limits['kv_gib']} GiB, bf16, one fresh engine per length.",
        "",
        "| model | context | result | prefill s | peak RSS of the engine (GiB) | memory available before (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("original", "export"):
        for row in limits.get(name, []):
            if "skipped" in row:
                lines.append(f"| {name} | {row['context']} | not tried: {row['skipped']} | | | |")
                continue
            result = "ok" if row["ok"] else f"failed (exit {row.get('returncode')}, {row.get('log')})"
            if row.get("failed_allocation_bytes"):
                result += f": could not allocate {row['failed_allocation_bytes']:,} bytes"
            lines.append(
                f"| {name} | {row['context']} | {result} | {row.get('prefill_s', '')} | {row['peak_rss_gib']}"
                f" | {row['memory_available_before_gib']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", nargs="?")
    parser.add_argument("--original")
    parser.add_argument("--out", default="runs/serve_bench", help="where the records go (results/serve: on purpose)")
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--contexts", default="2048,4096", help="speed: one request per context length")
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--greedy", type=int, default=16, help="greedy tokens compared in fp32 (vLLM, transformers)")
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds of timed generation per model")
    parser.add_argument("--prefill-limit", help="context lengths to prefill the export at (ascending), e.g. 4096,8192")
    parser.add_argument("--prefill-limit-original", help="the same for the original")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transformers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logprobs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one = prefill_one if args.prefill else transformers_one if args.transformers else serve_one
        Path(args.child_out).write_text(json.dumps(one(args), indent=1))
        return 0

    out, export, original = Path(args.out), Path(args.export), Path(args.original)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    if args.prefill_limit or args.prefill_limit_original:
        limits = {"command": command, "machine": machine(), "kv_gib": args.kv_gib}
        for name, path, lengths in (
            ("original", original, args.prefill_limit_original),
            ("export", export, args.prefill_limit),
        ):
            if lengths:
                limits[name] = prefill_limit(path, name, [int(c) for c in lengths.split(",")], args)
        (out / "prefill_limit.json").write_text(json.dumps(limits, indent=1) + "\n")
        (out / "prefill_limit.md").write_text(prefill_markdown(limits))
        print(prefill_markdown(limits))
        return 0

    report = {"command": command, "machine": machine(), "kv_gib": args.kv_gib, "max_model_len": args.max_model_len}
    report["reference"] = json.loads((export / "reference_logprobs.json").read_text())
    report["rope"] = rope_check(export)
    report["original"] = run_child(original, "original", args, *engine_flags(args, contexts=args.contexts))
    report["export"] = run_child(export, "export", args, *engine_flags(args, logprobs=True, contexts=args.contexts))
    report["export_eager"] = run_child(export, "export_eager", args, *engine_flags(args, eager=True, logprobs=True))
    fp32 = engine_flags(args, dtype="float32", eager=True, logprobs=True, greedy=args.greedy)
    report["export_fp32"] = run_child(export, "export_fp32", args, *fp32)
    hf = ["--transformers", "--greedy", str(args.greedy)]
    report["transformers_fp32"] = run_child(export, "transformers_fp32", args, *hf)
    for name, path in (("original", original), ("export", export)):
        report[name]["kv_elements_per_token_layer"] = kv_elements(json.loads((path / "config.json").read_text()))
    exp, orig = report["export"], report["original"]
    engine = None
    if exp.get("logged_capacity_tokens") and orig.get("logged_capacity_tokens"):
        engine = round(exp["logged_capacity_tokens"] / orig["logged_capacity_tokens"], 3)
    formula = round(orig["kv_elements_per_token_layer"] / exp["kv_elements_per_token_layer"], 3)
    report["capacity_ratio"] = {"engine": engine, "formula": formula}
    report["export_record"] = json.loads((export / "export.json").read_text())
    report["checks"] = check(report)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve_bench.md").write_text(markdown(report))
    print(markdown(report))
    failed = [name for name, c in report["checks"].items() if not c["pass"]]
    if failed:
        print(f"serve_bench: FAILED: {', '.join(failed)} ({out / 'serve_bench.md'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM spawns its workers: the engine must be created under this guard
    raise SystemExit(main())
