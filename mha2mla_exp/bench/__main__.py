"""`python -m mha2mla_exp.bench`: MHA vs MLA (expanded, absorbed, absorbed+Triton) at several model
shapes: measured KV bytes per token, decode-step latency over batch x context, peak memory, capacity;
and the attention-only microbenchmark. Writes CSVs, bench.png and machine.json under --out."""

from __future__ import annotations

import argparse
import gc
import logging
import re
import sys
from pathlib import Path

import psutil
import torch

from ..mla import kernels
from . import attention, decode, report, shapes

log = logging.getLogger("mha2mla_exp.bench")
GiB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench", description=__doc__)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument(
        "--shapes",
        help=f"comma list of {', '.join([*shapes.SHAPES, *shapes.REAL_MODELS])} "
        "(default: smollm-135m on CPU, all but tiny on GPU)",
    )
    p.add_argument("--batches", type=ints, help="default 1,16 (CPU) / 1,16,64 (GPU)")
    p.add_argument("--contexts", type=ints, help="default 1024,4096 (CPU) / 1024,4096,16384 (GPU)")
    p.add_argument("--out", type=Path, help="default results/bench/<machine tag>")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16")
    p.add_argument(
        "--mem-budget-gib",
        type=float,
        help="memory the caches and weights may use (default 90%% of the GPU; on CPU 40%% of free RAM)",
    )
    p.add_argument("--warmup", type=int, help="untimed steps first (default 1 CPU / 3 GPU)")
    p.add_argument("--repeats", type=int, help="timed steps (default 5 CPU / 20 GPU)")
    p.add_argument("--attention-batches", type=ints, help="microbenchmark batches (default: --batches)")
    p.add_argument("--attention-contexts", type=ints, help="microbenchmark contexts (default: --contexts)")
    p.add_argument("--attention-budget-gib", type=float, help="the microbenchmark's budget (default: --mem-budget-gib)")
    p.add_argument("--no-attention", action="store_true", help="skip the attention-only microbenchmark")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own choice)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def machine_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    match = re.search(r"\b([a-z]+\d+[a-z]*)\b", name.replace("nvidia", ""))
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def resolve(args) -> argparse.Namespace:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = torch.device("cuda" if cuda else "cpu")
    if args.dtype == "auto":
        args.dtype = torch.bfloat16 if cuda else torch.float32
    else:
        args.dtype = getattr(torch, args.dtype)
    gpu_default = ["smollm-135m", "smollm-1.7b", "llama2-7b", shapes.REAL]
    args.shapes = args.shapes.split(",") if args.shapes else (gpu_default if cuda else ["smollm-135m"])
    for name in args.shapes:
        if name not in shapes.SHAPES and name not in shapes.REAL_MODELS:
            known = ", ".join([*shapes.SHAPES, *shapes.REAL_MODELS])
            raise SystemExit(f"unknown shape {name!r}; choose from {known}")
    args.batches = args.batches or ([1, 16, 64] if cuda else [1, 16])
    args.contexts = args.contexts or ([1024, 4096, 16384] if cuda else [1024, 4096])
    args.attention_batches = args.attention_batches or args.batches
    args.attention_contexts = args.attention_contexts or args.contexts
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.repeats = args.repeats or (20 if cuda else 5)
    if args.mem_budget_gib:
        args.budget = int(args.mem_budget_gib * GiB)
    elif cuda:
        args.budget = int(0.9 * torch.cuda.get_device_properties(args.device).total_memory)
    else:
        args.budget = int(0.4 * psutil.virtual_memory().available)
    args.attention_budget = int(args.attention_budget_gib * GiB) if args.attention_budget_gib else args.budget
    args.out = args.out or Path("results/bench") / machine_tag(args.device)
    return args


def variants_for(model, device) -> list[decode.Variant]:
    if not isinstance(model, shapes.MLAForCausalLM):
        return [decode.Variant("mha", model)]
    out = [decode.Variant("mla", model, absorb=False), decode.Variant("mla_absorbed", model, absorb=True)]
    if device.type == "cuda" and kernels.triton_available():
        out.append(decode.Variant("mla_absorbed_triton", model, absorb=True, backend="auto"))
    return out


def bench_model(shape_name: str, model, args, decode_rows: list, capacity_rows: list) -> None:
    """Every variant of one model over the batch x context grid."""
    weights = shapes.param_bytes(model)
    for variant in variants_for(model, args.device):
        per_token = decode.measured_kv_bytes_per_token(variant, args.device)
        cap = decode.capacity_tokens(weights, per_token, args.budget)
        capacity_rows.append(
            {
                "shape": shape_name,
                "variant": variant.name,
                "dtype": str(args.dtype).removeprefix("torch."),
                "kv_bytes_per_token": per_token,
                "weights_bytes": weights,
                "budget_bytes": args.budget,
                "capacity_tokens": cap,
                **{f"max_batch_at_{c}": cap // c for c in args.contexts},
            }
        )
        for batch in args.batches:
            for context in args.contexts:
                row = {
                    "shape": shape_name,
                    "variant": variant.name,
                    "dtype": str(args.dtype).removeprefix("torch."),
                    "batch": batch,
                    "context": context,
                    "kv_bytes_per_token": per_token,
                    "weights_bytes": weights,
                }
                if not decode.fits(weights, per_token, batch, context, args.budget):
                    need = weights + 2.1 * per_token * batch * context
                    decode_rows.append(row | {"status": f"skipped: needs {need / GiB:.1f} GiB > budget"})
                    continue
                log.info("%s %s batch %d context %d", shape_name, variant.name, batch, context)
                row |= decode.time_decode(
                    variant, batch, context, args.device, args.dtype, warmup=args.warmup, repeats=args.repeats
                )
                row["status"] = "ok"
                if variant.backend == "auto" and row["triton_steps"] == 0:
                    row["status"] = "kernel not used: modeling.py does not call absorbed_decode"
                row["tokens_per_s"] = batch / row["step_s_median"]
                if row["peak_mem_bytes"] is None:
                    row["peak_mem_bytes"] = weights + row["cache_bytes"]
                if args.device.type == "cpu":
                    row["rss_bytes"] = psutil.Process().memory_info().rss
                decode_rows.append(row)
                print(
                    f"{shape_name:13s} {variant.name:20s} b{batch:<3d} ctx {context:6d}: "
                    f"{row['step_s_median'] * 1e3:9.2f} ms (IQR {row['step_s_q1'] * 1e3:.2f}-"
                    f"{row['step_s_q3'] * 1e3:.2f})  {row['tokens_per_s']:9.1f} tok/s",
                    flush=True,
                )
    kernels.set_backend("auto")


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = resolve(parse_args(argv))
    if args.threads:  # on a shared CPU one thread per process avoids OpenMP threads stalling each other
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    info = report.machine_info(args.device) | {
        "command": "python -m mha2mla_exp.bench " + " ".join(argv or sys.argv[1:]),
        "dtype": str(args.dtype),
        "budget_bytes": args.budget,
    }
    torch.manual_seed(0)
    # the attention microbenchmark first (the GPU target, and quick), each result written as soon as
    # it exists, so that a run cut short by a timeout still leaves what it measured
    attention_rows: list[dict] = []
    if not args.no_attention:
        attention_rows = attention.run_attention(
            args.attention_batches,
            args.attention_contexts,
            args.device,
            args.dtype,
            warmup=args.warmup,
            repeats=args.repeats,
            budget=args.attention_budget,
        )
        report.write_csv(attention_rows, args.out / "attention.csv")
        print(
            "attention only, Llama-2-7B layer (d_kv=16, r=8): speedup over MHA SDPA vs bound "
            f"{attention.bound(128, 8, 16):.1f}x"
        )
        for row in attention_rows:
            if row.get("status") == "ok":
                print(
                    f"  b{row['batch']:<3d} ctx {row['context']:6d} {row['variant']:34s} "
                    f"{row['s_median'] * 1e3:9.3f} ms  {row['gb_per_s']:8.1f} GB/s  "
                    f"{row['speedup_vs_mha']:5.2f}x = {100 * row['fraction_of_bound']:5.1f}% of bound",
                    flush=True,
                )

    decode_rows: list[dict] = []
    capacity_rows: list[dict] = []
    for name in args.shapes:
        if name in shapes.REAL_MODELS:
            try:
                mha, mla = shapes.build_real(name, args.device, args.dtype)
            except Exception as exc:  # no asset, no network, no models.py: record it and go on
                log.warning("skipping %s: %s", name, exc)
                decode_rows.append({"shape": name, "status": f"skipped: {type(exc).__name__}: {exc}"[:300]})
                continue
            bench_model(name, mha, args, decode_rows, capacity_rows)
            del mha
            free()
            bench_model(name, mla.to(args.device), args, decode_rows, capacity_rows)
            del mla
            free()
        else:  # one model resident at a time, so that the GPU's peak memory is that model's
            model = shapes.build_mha(name, args.device, args.dtype)
            bench_model(name, model, args, decode_rows, capacity_rows)
            del model
            free()
            model = shapes.build_mla(name, args.device, args.dtype)
            bench_model(name, model, args, decode_rows, capacity_rows)
            del model
            free()
        report.write_csv(decode_rows, args.out / "decode.csv")
        report.write_csv(capacity_rows, args.out / "capacity.csv")

    if not args.no_plot:
        report.plot(decode_rows, attention_rows, args.out / "bench.png")
    report.write_machine(info, args.out / "machine.json")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
