"""The training-precision benchmark on this CPU: how fast each mode trains, and whether it recovers as well as fp32.

    python -m mha2mla_exp.bench.train_precision throughput --out results/bench/cpu_train   # on an idle machine
    python -m mha2mla_exp +experiment=cpu_precision results_dir=results/runs              # recovery at equal tokens
    python -m mha2mla_exp.bench.train_precision summary results/runs/cpu_precision --out results/bench/cpu_train

`throughput` times the fine-tune recipe's optimizer steps (8 x 256 tokens, the CPU default) on the real
SmolLM2-135M converted at d_kv=16 (the recovery study's shapes), for every precision mode, eager and compiled,
after warm-up steps (compilation included in those); `summary` reads the cpu_precision run records (the same
conversion and rows in every mode, evaluated in fp32) and writes README.md, summary.csv, curves.png and
machine.json (the CPU's model name, its bf16 flags, the matmul probe that `train.precision=auto` uses).
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

from ..machine import cpu_model
from ..train.precision import MODES, cpu_bf16_speedup, precision_for

RECIPE = {"pretrain_share_pct": None, "seq_len": 256, "micro_batch_size": 4, "grad_accum": 2, "lr": 1e-4,
          "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "clip": 1.0, "warmup_steps": 1,
          "decay_fraction": 0.0, "freeze_non_attention": False, "checkpoint_every": 0, "log_every": 1,
          "divergence_factor": 100.0, "eval_every": 0}


def study_model():
    """SmolLM2-135M converted with the recovery study's shapes (d_kv=16, r=4); no calibration needed for speed."""
    from ..mla import convert_to_mla
    from ..models import load_model

    base, _ = load_model(OmegaConf.load(Path(__file__).parents[2] / "conf/model/smollm2_135m.yaml"), device="cpu",
                         dtype="float32")
    return convert_to_mla(base, rope="high", r=4, svd="joint", d_kv=16)


def measure_throughput(model, warmup: int, steps: int, modes: list[str], compile_options: list[bool],
                       recipe: dict | None = None) -> pd.DataFrame:
    """Seconds per optimizer step of the fine-tune recipe for each mode, after `warmup` untimed steps."""
    from ..data.rows import FiniteRows
    from ..train import finetune

    recipe = RECIPE | (recipe or {})
    rows = FiniteRows(torch.randint(0, model.config.vocab_size, (512, recipe["seq_len"]),
                                    generator=torch.Generator().manual_seed(0)), seed=0)
    per_step = recipe["seq_len"] * recipe["micro_batch_size"] * recipe["grad_accum"]
    out = []
    for compiled in compile_options:
        for mode in modes:
            curve = []
            cfg = OmegaConf.create(recipe | {"tokens": per_step * (warmup + steps), "compile": compiled})
            with tempfile.TemporaryDirectory() as tmp:
                finetune(copy.deepcopy(model), rows, cfg, Path(tmp), precision=precision_for(mode, "cpu"), seed=0,
                         on_log=curve.append)
            times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(curve, curve[1:])][warmup - 1:]
            seconds = sum(times) / len(times)
            out.append({"mode": mode + (" + compile" if compiled else ""), "seconds_per_step": round(seconds, 3),
                        "tokens_per_s": round(per_step / seconds, 1), "first_step_s": curve[0]["elapsed_s"],
                        "timed_steps": len(times), "load_avg_1m": round(os.getloadavg()[0], 2)})
            print(out[-1], flush=True)
    table = pd.DataFrame(out)
    fp32 = table.loc[table["mode"] == "fp32", "tokens_per_s"]
    table["speedup_vs_fp32"] = (table["tokens_per_s"] / fp32.iloc[0]).round(2) if len(fp32) else float("nan")
    return table


def load_runs(runs_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for path in sorted(Path(runs_dir).glob("*/results.json")):
        record = json.loads(path.read_text())
        if record.get("status") != "ok" or not record.get("train"):
            continue
        train = record["train"]
        mode = train["precision"]["mode"]
        rows.append({"mode": mode, "seed": _seed(path), "tokens": train["tokens"],
                     "heldout_ppl_fp32": record["eval"]["perplexity"]["heldout"],
                     "final_probe_ppl": list((train.get("heldout_ppl_probe") or {}).values())[-1],
                     "probe_dtype": train.get("probe_dtype"), "final_loss": train["final_loss"],
                     "tokens_per_s_shared": train["tokens_per_s"], "load_avg_5m": train.get("load_avg_5m")})
        for line in (path.parent / "metrics.jsonl").read_text().splitlines():
            step = json.loads(line)
            if "heldout_ppl_probe" in step:
                curves.append({"mode": f"{mode} s{_seed(path)}", "tokens": step["tokens"],
                               "ppl": step["heldout_ppl_probe"]})
    return pd.DataFrame(rows).sort_values(["mode", "seed"]).reset_index(drop=True), pd.DataFrame(curves)


def _seed(results_json: Path) -> int:
    import yaml

    return int(yaml.safe_load((results_json.parent / "config.yaml").read_text())["seed"])


def plot(curves: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, curve in curves.groupby("mode"):
        ax.plot(curve["tokens"], curve["ppl"], marker="o", ms=3, label=mode,
                linestyle="--" if mode.endswith("s1") else "-")
    ax.set(xlabel="fine-tune tokens", ylabel="held-out perplexity (probe, 32 x 512 rows)", yscale="log",
           title="Recovery by training precision (SmolLM2-135M, d_kv=16)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_readme(out: Path) -> None:
    machine = json.loads((out / "machine.json").read_text())
    lines = ["# Training precision on this CPU", "",
             f"Machine: {machine['cpu']['model']}, {os.cpu_count()} cores, bf16-relevant flags "
             f"{machine['cpu']['bf16_flags']}. The start-up probe `train.precision=auto` uses: a 2048x576x1536 matmul "
             f"runs {machine['matmul_bf16_over_fp32']}x faster in bf16 than in fp32 ({machine['matmul_probe']}).", ""]
    if (out / "throughput.csv").exists():
        table = pd.read_csv(out / "throughput.csv")
        lines += ["## Tokens per second", "",
                  "`python -m mha2mla_exp.bench.train_precision throughput --out " + str(out) + "`: optimizer steps of "
                  "8 x 256 tokens on SmolLM2-135M converted at d_kv=16, after warm-up (compilation is in the "
                  "warm-up); `load_avg_1m` above the 2 cores means other work shared them.", "",
                  table.to_markdown(index=False, floatfmt=".3g"), ""]
    if (out / "summary.csv").exists():
        table = pd.read_csv(out / "summary.csv")
        lines += ["## Recovery at equal tokens", "",
                  "`python -m mha2mla_exp +experiment=cpu_precision results_dir=results/runs`: the same conversion "
                  "(2-norm r=4, joint SVD d_kv=16, activation-aware init) and the same rows in every mode; "
                  "`heldout_ppl_fp32` is the final model evaluated in fp32 on 32 x 512 held-out rows, "
                  "`final_probe_ppl` the same rows in the weights' own dtype (`probe_dtype`). These runs shared the "
                  "machine: their tokens/s are not the ones above. Only the folder's own run directories are read (records "
                  "made with an earlier split of the low-rank factors sit in a subfolder).", "",
                  table.to_markdown(index=False, floatfmt=".4g"), "", "![recovery curves](curves.png)", ""]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.train_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--out", type=Path, default=Path("results/bench/cpu_train"))
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--modes", default=",".join(m for m in MODES if m != "auto"))
    t.add_argument("--compile", default="false,true", help="eager and/or compiled: false,true")
    s = sub.add_parser("summary")
    s.add_argument("runs_dir", type=Path)
    s.add_argument("--out", type=Path, default=Path("results/bench/cpu_train"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "throughput" or not (args.out / "machine.json").exists():
        # the machine beside its throughput numbers (a summary of shared-machine runs keeps the idle probe)
        speedup, detail = cpu_bf16_speedup(576, 1536)
        (args.out / "machine.json").write_text(json.dumps(
            {"cpu": cpu_model(), "matmul_bf16_over_fp32": round(speedup, 2), "matmul_probe": detail,
             "torch": torch.__version__, "threads": torch.get_num_threads()}, indent=2))
    if args.command == "throughput":
        compile_options = [c.strip().lower() == "true" for c in args.compile.split(",")]
        measure_throughput(study_model(), args.warmup, args.steps, args.modes.split(","), compile_options).to_csv(
            args.out / "throughput.csv", index=False)
    else:
        table, curves = load_runs(args.runs_dir)
        if table.empty:
            parser.error(f"no finished cpu_precision runs under {args.runs_dir}")
        table.to_csv(args.out / "summary.csv", index=False)
        curves.to_csv(args.out / "curves.csv", index=False)
        plot(curves, args.out / "curves.png")
    write_readme(args.out)
    print((args.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
