"""The training-precision benchmark on this CPU: how fast each mode trains, and whether it recovers as well as fp32.

    python -m mha2mla_exp.bench.train_precision throughput --out results/bench/cpu_train   # on an idle machine
    python -m mha2mla_exp.bench.train_precision throughput --modes fp32 --compile false --variants plain,fast
    python -m mha2mla_exp +experiment=cpu_precision results_dir=results/runs              # recovery at equal tokens
    python -m mha2mla_exp.bench.train_precision summary results/runs/cpu_precision --out results/bench/cpu_train

`throughput` times the fine-tune recipe's optimizer steps (8 x 256 tokens, the CPU default) on the real
SmolLM2-135M converted at d_kv=16 (the recovery study's shapes), for every precision mode, eager and compiled,
and step variant (`VARIANTS`: the plain step, the fast paths), after warm-up steps (compilation included in
those); `summary` reads run records (the same conversion and rows in every mode, evaluated in fp32) into a
table and curves. Every table is keyed by the machine (`machine_label`); machine.json holds each machine's bf16
probe (what `train.precision=auto` decides by), and a run on a new machine adds its rows beside the others.
Where one step's time goes: bench/train_profile.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from .. import atomic
from ..confutil import typed_section
from ..machine import allocator, cpu_model
from ..schema.sections import ModelConfig, TrainConfig
from ..train.precision import MODES, cpu_bf16_speedup, precision_for

RECIPE = {
    "pretrain_share_pct": None,
    "seq_len": 256,
    "micro_batch_size": 4,
    "grad_accum": 2,
    "lr": 1e-4,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.01,
    "clip": 1.0,
    "warmup_steps": 1,
    "decay_fraction": 0.0,
    "freeze_non_attention": False,
    "checkpoint_every": 0,
    "log_every": 1,
    "divergence_factor": 100.0,
    "eval_every": 0,
}
# how a step is computed (train.fused_loss, train.optimizer_impl): the plain path, each fast path alone, both
VARIANTS = {
    "plain": {"fused_loss": False, "optimizer_impl": "loop"},
    "fused-loss": {"fused_loss": True, "optimizer_impl": "loop"},
    "fused-adamw": {"fused_loss": False, "optimizer_impl": "fused"},
    "fast": {"fused_loss": True, "optimizer_impl": "fused"},
}


def machine_label() -> str:
    """The machine a row of numbers was made on, as the tables key it: cores, CPU model, bf16-relevant flags."""
    cpu = cpu_model()
    return f"{os.cpu_count()}-core {cpu['model']} ({', '.join(cpu['bf16_flags']) or 'no avx512/amx'})"


def merge_rows(path: Path, new: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Write `new` into the csv at `path`: every old row whose `keys` appear in `new` goes (a re-measurement,
    a new top-operators list, replaces the old one whole), other machines' and settings' rows stay."""
    if path.exists():
        old = pd.read_csv(path)
        stale = old.set_index(keys).index.isin(new.set_index(keys).index)
        merged = pd.concat([old[~stale], new], ignore_index=True)
    else:
        merged = new
    with atomic.atomic_path(path) as tmp:
        merged.to_csv(tmp, index=False)
    return merged


def study_model():
    """SmolLM2-135M converted with the recovery study's shapes (d_kv=16, r=4); no calibration needed for speed."""
    from ..mla import convert_to_mla
    from ..models import load_model

    model_cfg = OmegaConf.load(Path(__file__).parents[2] / "conf/model/smollm2_135m.yaml")
    base, _ = load_model(typed_section(ModelConfig, model_cfg, "model"), device="cpu", dtype="float32")
    return convert_to_mla(base, rope="high", r=4, svd="joint", d_kv=16)


def measure_throughput(
    model,
    warmup: int,
    steps: int,
    modes: list[str],
    compile_options: list[bool],
    recipe: dict | None = None,
    variants: tuple[str, ...] = ("plain",),
) -> pd.DataFrame:
    """Seconds per optimizer step of the fine-tune recipe for each mode and step variant, after `warmup` untimed
    steps; speedups are against plain fp32 eager where it was measured."""
    from ..data.rows import FiniteRows
    from ..train import finetune

    recipe = RECIPE | (recipe or {})
    rows = FiniteRows(
        torch.randint(0, model.config.vocab_size, (512, recipe["seq_len"]), generator=torch.Generator().manual_seed(0)),
        seed=0,
    )
    per_step = recipe["seq_len"] * recipe["micro_batch_size"] * recipe["grad_accum"]
    out = []
    for variant, compiled, mode in ((v, c, m) for v in variants for c in compile_options for m in modes):
        curve = []
        train = typed_section(
            TrainConfig, recipe | VARIANTS[variant] | {"tokens": per_step * (warmup + steps), "compile": compiled}
        )
        with tempfile.TemporaryDirectory() as tmp:
            finetune(
                copy.deepcopy(model),
                rows,
                train,
                Path(tmp),
                precision=precision_for(mode, "cpu"),
                seed=0,
                on_log=curve.append,
            )
        times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(curve, curve[1:])][warmup - 1 :]
        seconds = sum(times) / len(times)
        out.append(
            {
                "mode": mode + (" + compile" if compiled else ""),
                "variant": variant,
                "seconds_per_step": round(seconds, 3),
                "tokens_per_s": round(per_step / seconds, 1),
                "first_step_s": curve[0]["elapsed_s"],
                "timed_steps": len(times),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(out[-1], flush=True)
    table = pd.DataFrame(out)
    fp32 = table.loc[(table["mode"] == "fp32") & (table["variant"] == "plain"), "tokens_per_s"]
    table["speedup_vs_fp32"] = (table["tokens_per_s"] / fp32.iloc[0]).round(2) if len(fp32) else float("nan")
    return table


def record_machine(out: Path) -> None:
    """This machine's bf16 probe in machine.json, beside the other machines' (their numbers stay keyed to them)."""
    path = out / "machine.json"
    machines = json.loads(path.read_text()) if path.exists() else {}
    if machine_label() not in machines:
        speedup, detail = cpu_bf16_speedup(576, 1536)
        machines[machine_label()] = {
            "cpu": cpu_model(),
            "matmul_bf16_over_fp32": round(speedup, 2),
            "matmul_probe": detail,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        atomic.write_text(path, json.dumps(machines, indent=2))


def load_runs(runs_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for path in sorted(Path(runs_dir).glob("*/results.json")):
        record = json.loads(path.read_text())
        if record.get("status") != "ok" or not record.get("train"):
            continue
        train = record["train"]
        mode = train["precision"]["mode"]
        variant = (
            "fast"
            if train.get("loss_path") == "chunked" and train.get("optimizer_impl") == "fused"
            else "plain"
            if train.get("loss_path", "logits") == "logits" and train.get("optimizer_impl", "loop") == "loop"
            else f"{train.get('loss_path')} + {train.get('optimizer_impl')}"
        )
        rows.append(
            {
                "mode": mode,
                "variant": variant,
                "seed": _seed(path),
                "tokens": train["tokens"],
                "heldout_ppl_fp32": record["eval"]["perplexity"]["heldout"],
                "final_probe_ppl": list((train.get("heldout_ppl_probe") or {}).values())[-1],
                "probe_dtype": train.get("probe_dtype"),
                "final_loss": train["final_loss"],
                "tokens_per_s_shared": train["tokens_per_s"],
                "load_avg_5m": train.get("load_avg_5m"),
            }
        )
        for line in (path.parent / "metrics.jsonl").read_text().splitlines():
            step = json.loads(line)
            if "heldout_ppl_probe" in step:
                curves.append(
                    {
                        "mode": f"{mode} {variant} s{_seed(path)}",
                        "tokens": step["tokens"],
                        "ppl": step["heldout_ppl_probe"],
                    }
                )
    return pd.DataFrame(rows).sort_values(["mode", "variant", "seed"]).reset_index(drop=True), pd.DataFrame(curves)


def _seed(results_json: Path) -> int:
    import yaml

    return int(yaml.safe_load((results_json.parent / "config.yaml").read_text())["seed"])


def plot(curves: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, curve in curves.groupby("mode"):
        ax.plot(
            curve["tokens"], curve["ppl"], marker="o", ms=3, label=mode, linestyle="--" if mode.endswith("s1") else "-"
        )
    ax.set(
        xlabel="fine-tune tokens",
        ylabel="held-out perplexity (probe, 32 x 512 rows)",
        yscale="log",
        title=f"{title} (SmolLM2-135M, d_kv=16)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip("."))


def write_readme(out: Path) -> None:
    machines = json.loads((out / "machine.json").read_text())
    lines = [
        "# The fine-tune step on CPUs: precision modes, fast paths, where the time goes",
        "",
        "Every number sits beside its machine. `matmul bf16/fp32` is the start-up probe that "
        "`train.precision=auto` decides by (a 2048x576x1536 matmul, or a 32-row screen where bf16 is hopeless). "
        "What the numbers say: results/REPORT.md, sections 11 (precision) and 14 (the step's profile).",
        "",
        "| machine | matmul bf16/fp32 | probe | torch | threads |",
        "|:--|--:|:--|:--|--:|",
    ]
    lines += [
        f"| {name} | {m['matmul_bf16_over_fp32']} | {m['matmul_probe']} | {m['torch']} | {m['threads']} |"
        for name, m in machines.items()
    ]
    lines.append("")
    if (out / "throughput.csv").exists():
        table = pd.read_csv(out / "throughput.csv")
        lines += [
            "## Tokens per second",
            "",
            "`python -m mha2mla_exp.bench.train_precision throughput --out " + str(out) + "`: optimizer steps of "
            "8 x 256 tokens on SmolLM2-135M converted at d_kv=16, after warm-up (compilation is in the "
            "warm-up); `load_avg_1m` above the cores means other work shared them. `variant`: `plain` is the "
            "full logits and torch's one-parameter-at-a-time AdamW, `fast` the chunked loss "
            "(`train.fused_loss`) and fused AdamW (`train.optimizer_impl=fused`), the others one of the two. "
            "`speedup_vs_fp32` is against plain fp32 eager on the same machine.",
            "",
        ]
        lines += _by_machine(table)
    if (out / "profile.csv").exists():
        profile, ops = pd.read_csv(out / "profile.csv"), pd.read_csv(out / "profile_ops.csv")
        lines += [
            "## Where one step's time goes",
            "",
            "`python -m mha2mla_exp.bench.train_profile --out " + str(out) + " [--modes ...] [--variants ...]`: "
            "torch.profiler over one optimizer step after a warm-up one; operators' self time by kind "
            "(`matmul`: mm/addmm/bmm; `attention`: SDPA's kernels; `loss`: log-softmax, NLL and their "
            "backward; `memory`: copies, fills, clones, casts, the embedding's dense gradient; `other`: the "
            "rest) and by the recipe's phase. In the `fast` variant the loss's gradient matmuls run in the "
            "forward phase (train/loss_head.py).",
            "",
        ]
        lines += _by_machine(profile)
        keys = ["machine", "allocator", "mode", "variant"]
        for (machine, malloc, mode, variant), top in ops.groupby(keys, sort=False):
            lines += [
                f"Top operators, {machine}, {malloc}, {mode} {variant}:",
                "",
                top.drop(columns=keys).to_markdown(index=False, floatfmt=".3g"),
                "",
            ]
    for name, title, how in RECOVERY_TABLES:
        if (out / f"{name}.csv").exists():
            table = pd.read_csv(out / f"{name}.csv")
            lines += [
                f"## {title}",
                "",
                how,
                "",
                table.to_markdown(index=False, floatfmt=".4g"),
                "",
                f"![recovery curves]({name}_curves.png)",
                "",
            ]
    atomic.write_text(out / "README.md", "\n".join(lines))


def _by_machine(table: pd.DataFrame) -> list[str]:
    """A markdown table per machine, under its name."""
    lines = []
    for machine, rows in table.groupby("machine", sort=False):
        lines += [f"### {machine}", "", rows.drop(columns="machine").to_markdown(index=False, floatfmt=".3g"), ""]
    return lines


RECOVERY_TABLES = (
    (
        "summary",
        "Recovery at equal tokens, by precision mode",
        "`python -m mha2mla_exp +experiment=cpu_precision results_dir=results/runs`, then `python -m "
        "mha2mla_exp.bench.train_precision summary results/runs/cpu_precision`: the same conversion (2-norm r=4, joint "
        "SVD d_kv=16, activation-aware init) and the same rows in every mode; `heldout_ppl_fp32` is the final model "
        "evaluated in fp32 on 32 x 512 held-out rows, `final_probe_ppl` the same rows in the weights' own dtype "
        "(`probe_dtype`). These runs shared the machine: their tokens/s are not the ones above. Only the folder's own "
        "run directories are read (records made with an earlier split of the low-rank factors sit in a subfolder).",
    ),
    (
        "fast_paths",
        "Recovery at equal tokens, plain step against the fast paths",
        "`sweeps/cpu_fast_paths.sh`: the cpu_precision conversion and rows in fp32, two seeds, once with the plain "
        "step and once with the fast paths (each variant in a results folder of its own: the fast paths are not part "
        "of a run's identity); `python -m mha2mla_exp.bench.train_precision summary <folder> --as fast_paths`.",
    ),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha2mla_exp.bench.train_precision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--out", type=Path, default=Path("results/bench/cpu_train"))
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--modes", default=",".join(m for m in MODES if m != "auto"))
    t.add_argument("--compile", default="false,true", help="eager and/or compiled: false,true")
    t.add_argument("--variants", default="plain", help=f"step variants, of {', '.join(VARIANTS)}")
    s = sub.add_parser("summary")
    s.add_argument("runs_dirs", type=Path, nargs="+", help="folders of run directories (each <dir>/*/results.json)")
    s.add_argument("--out", type=Path, default=Path("results/bench/cpu_train"))
    s.add_argument("--as", dest="name", default="summary", choices=[name for name, _, _ in RECOVERY_TABLES])
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record_machine(args.out)
    if args.command == "throughput":
        compile_options = [c.strip().lower() == "true" for c in args.compile.split(",")]
        table = measure_throughput(
            study_model(),
            args.warmup,
            args.steps,
            args.modes.split(","),
            compile_options,
            variants=tuple(args.variants.split(",")),
        )
        table = table.assign(machine=machine_label(), allocator=allocator())
        merge_rows(
            args.out / "throughput.csv",
            table[["machine", "allocator", *table.columns[:-2]]],
            ["machine", "allocator", "mode", "variant"],
        )
    else:
        loaded = [load_runs(folder) for folder in args.runs_dirs]
        table = pd.concat([t for t, _ in loaded], ignore_index=True)
        curves = pd.concat([c for _, c in loaded], ignore_index=True)
        if table.empty:
            parser.error(f"no finished fine-tune runs under {', '.join(map(str, args.runs_dirs))}")
        for frame, suffix in ((table, ".csv"), (curves, "_curves.csv")):
            with atomic.atomic_path(args.out / f"{args.name}{suffix}") as tmp:
                frame.to_csv(tmp, index=False)
        title = dict((name, title) for name, title, _ in RECOVERY_TABLES)[args.name]
        plot(curves, args.out / f"{args.name}_curves.png", title.removeprefix("Recovery at equal tokens, "))
    write_readme(args.out)
    print((args.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
