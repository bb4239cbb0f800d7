"""`python -m mha2mla_exp.bench.train_precision RUNS_DIR OUT_DIR`: the training-precision benchmark on this CPU.

Reads the run records of `+experiment=cpu_precision` (fp32 and each bf16 mode, eager and compiled, the same
conversion and tokens) and writes OUT_DIR/README.md (tokens/s, speed-up over fp32, held-out perplexity at equal
tokens, evaluated in fp32 for every mode), summary.csv, curves.png (the in-run probe curves against tokens and
against seconds) and machine.json (the CPU's model name and bf16 flags, and the matmul probe that `auto` uses).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from ..runner.record import cpu_model
from ..train.precision import cpu_bf16_speedup


def load_runs(runs_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for path in sorted(Path(runs_dir).glob("*/results.json")):
        record = json.loads(path.read_text())
        if record.get("status") != "ok" or not record.get("train"):
            continue
        train = record["train"]
        name = train["precision"]["mode"] + (" + compile" if train.get("compiled") else "")
        rows.append({"mode": name, "tokens": train["tokens"], "seconds": train["seconds"],
                     "tokens_per_s": train["tokens_per_s"], "final_loss": train["final_loss"],
                     "heldout_ppl": record["eval"]["perplexity"]["heldout"], "eval_dtype": record.get("eval_dtype"),
                     "load_avg_5m": train.get("load_avg_5m"), "run": path.parent.name})
        for line in (path.parent / "metrics.jsonl").read_text().splitlines():
            step = json.loads(line)
            if "heldout_ppl_probe" in step:
                curves.append({"mode": name, "tokens": step["tokens"], "seconds": step["elapsed_s"],
                               "ppl": step["heldout_ppl_probe"]})
    table = pd.DataFrame(rows)
    if len(table):
        fp32 = table.loc[table["mode"] == "fp32", "tokens_per_s"]
        table["speedup_vs_fp32"] = table["tokens_per_s"] / fp32.iloc[0] if len(fp32) else float("nan")
        table = table.sort_values("tokens_per_s", ascending=False).reset_index(drop=True)
    return table, pd.DataFrame(curves)


def plot(curves: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for mode, curve in curves.groupby("mode"):
        for ax, x in zip(axes, ("tokens", "seconds")):
            ax.plot(curve[x], curve["ppl"], marker="o", ms=3, label=mode)
    for ax, x in zip(axes, ("fine-tune tokens", "training seconds (probes excluded)")):
        ax.set_xlabel(x)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out perplexity (probe, 32 x 512 rows)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Recovery by training precision, SmolLM2-135M d_kv=16, same rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.train_precision", description=__doc__)
    parser.add_argument("runs_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    table, curves = load_runs(args.runs_dir)
    if table.empty:
        parser.error(f"no finished cpu_precision runs under {args.runs_dir}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    speedup, detail = cpu_bf16_speedup(576, 1536)
    machine = {"cpu": cpu_model(), "matmul_bf16_over_fp32": round(speedup, 2), "matmul_probe": detail}
    (args.out_dir / "machine.json").write_text(json.dumps(machine, indent=2))
    table.to_csv(args.out_dir / "summary.csv", index=False)
    curves.to_csv(args.out_dir / "curves.csv", index=False)
    plot(curves, args.out_dir / "curves.png")
    columns = ["mode", "tokens", "seconds", "tokens_per_s", "speedup_vs_fp32", "heldout_ppl", "final_loss",
               "load_avg_5m"]
    lines = [
        "# Training precision on this CPU",
        "",
        f"Machine: {machine['cpu']['model']}, bf16-relevant flags {machine['cpu']['bf16_flags']}; a "
        f"2048x576x1536 matmul runs {speedup:.2f}x faster in bf16 than fp32 ({detail}).",
        "",
        f"Runs: `python -m mha2mla_exp +experiment=cpu_precision results_dir=results/runs` ({len(table)} runs, "
        f"records in `{args.runs_dir}`); this page: `python -m mha2mla_exp.bench.train_precision {args.runs_dir} "
        f"{args.out_dir}`. Every run converts SmolLM2-135M the same way (2-norm r=4, joint SVD d_kv=16 from "
        "activation-aware init) and fine-tunes the same rows; held-out perplexity is evaluated in fp32 for all, "
        "on 32 x 512 held-out rows. `load_avg_5m` is the machine's load when the run ended (2 cores: above 2, "
        "other work shared them and the timings are pessimistic).",
        "",
        table[columns].to_markdown(index=False, floatfmt=".3g"),
        "",
        "![recovery curves](curves.png)",
    ]
    (args.out_dir / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
