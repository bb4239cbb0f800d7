"""Evaluate one model outside the runner and write the result as JSON + Markdown.

    python -m mha2mla_exp.evaluation --model smollm2_135m --suite commonsense --limit 500 --mmlu-limit 10 \
        --out results/eval/smollm2-135m_commonsense
    python -m mha2mla_exp.evaluation --model smollm2_135m --eval long_context --convert rope=none,svd=none \
        --out results/eval/passkey_nope

--model names conf/model/<name>.yaml (or give a path); --eval names conf/eval/<name>.yaml; --suite keeps
one suite of it; --set section.key=value overrides any eval key (YAML values). Held-out perplexity
needs the runner's data and is skipped here.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"
SUITES = ("commonsense", "long_context", "longbench")


def _conf(group: str, name: str) -> dict:
    path = Path(name) if name.endswith(".yaml") else CONF / group / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"no {group} config {name!r} ({path})")
    return yaml.safe_load(path.read_text())


def _kv_quant(text: str | None):
    if not text:
        return None
    backend, nbits = text.rstrip("0123456789"), text[len(text.rstrip("0123456789")):]
    if not nbits:
        raise SystemExit(f"--kv-quant {text!r}: expected e.g. hqq4, quanto2")
    return {"backend": backend, "nbits": int(nbits), "residual_length": 128, "q_group_size": 64}


def build_eval_cfg(args) -> dict:
    cfg = _conf("eval", args.eval)
    if args.suite:
        for s in SUITES:
            cfg.setdefault(s, {})["enabled"] = s == args.suite
    cfg["perplexity"] = {"enabled": False}
    if args.limit is not None or args.mmlu_limit is not None:
        section = args.suite or "commonsense"
        if args.limit is not None:
            cfg[section]["limit"] = args.limit
        if args.mmlu_limit is not None:
            cfg["commonsense"]["mmlu_limit"] = args.mmlu_limit
    for item in args.set or []:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if not field:
            raise SystemExit(f"--set {item!r}: expected section.key=value")
        cfg.setdefault(section, {})[field] = yaml.safe_load(value)
    return cfg


def _pp(x):
    return "" if x is None else f"{100 * x:.1f}"


def markdown(result: dict) -> str:
    ev, lines = result["eval"], [f"# {result['title']}", "", f"Command: `{result['command']}`", ""]
    lines += [f"Model: {result['model']['name']} ({result['model']['variant']}), "
              f"{result['model']['params']:,} parameters; window {ev['meta']['window']}; "
              f"KV quantization: {ev['meta']['kv_quant'] or 'none'}; lm-eval {ev['meta']['lm_eval_version']}; "
              f"{result['seconds']:.0f} s on {result['machine']}.", ""]
    if "commonsense" in ev:
        cs, meta = ev["commonsense"], ev["meta"]["commonsense"]
        cols = ["mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande", "avg"]
        lines += ["## Commonsense (0-shot, acc_norm; Winogrande acc; percentage points)", "",
                  f"Source: {meta['source']}. Docs per task: {meta['limit'] or 'all'} ({meta['sample']} sample, "
                  f"seed {meta['seed']}); MMLU {meta['mmlu_limit'] or 'all'} per subject "
                  f"({meta['n_docs'].get('mmlu')} docs over {meta['mmlu_subjects']} subjects).", "",
                  "| row | MMLU | ARC | PIQA | HS | OBQA | WG | Avg | ARC-E | ARC-C |", "|---|" + "---:|" * 9,
                  f"| ours | " + " | ".join(_pp(cs.get(c)) for c in cols) + f" | {_pp(cs.get('arc_easy'))} | "
                  f"{_pp(cs.get('arc_challenge'))} |"]
        lines.append("| ± binomial s.e. | " + " | ".join(_pp(x) for x in _stderrs(cs, meta["n_docs"], cols)) + " | | |")
        for label, row in _reference_rows():
            lines.append(f"| {label} | " + " | ".join(row.get(c, "") for c in cols) + " | | |")
        lines += ["", "Docs evaluated: " + ", ".join(f"{k} {v}/{meta['n_total'][k]}" for k, v in meta["n_docs"].items()), ""]
    if "long_context" in ev:
        lc, meta = ev["long_context"], ev["meta"]["long_context"]
        lines += ["## Passkey retrieval (accuracy, percentage points)", "",
                  f"Depths {meta['depths']}, {meta['samples_per_depth']} docs per depth, seed {meta['seed']}, "
                  f"haystack: {meta['texts']}.", "", "| length | all | " + " | ".join(f"depth {d}" for d in meta["depths"])
                  + " |", "|---|---:|" + "---:|" * len(meta["depths"])]
        for key, by_depth in meta["by_depth"].items():
            lines.append(f"| {key} | {_pp(lc[key])} | " + " | ".join(_pp(v) for v in by_depth.values()) + " |")
        lines += [f"| avg | {_pp(lc.get('avg'))} |", ""]
        ppl = {k: v for k, v in ev["perplexity"].items() if k.startswith("longdoc")}
        if ppl:
            lines += ["Long-document token perplexity: " + ", ".join(f"{k} {v:.2f}" for k, v in ppl.items()), ""]
    if "longbench" in ev:
        lb = {k: v for k, v in ev["longbench"].items() if k != "limit"}
        lines += ["## LongBench (percentage points)", "", "| " + " | ".join(lb) + " |", "|" + "---:|" * len(lb),
                  "| " + " | ".join(_pp(v) for v in lb.values()) + " |", ""]
    kv = ev.get("kv_cache") or {}
    if "bytes_per_token_measured" in kv:
        lines += ["## KV cache during generation", "",
                  f"{kv['cache']}: {kv['bytes_per_token_measured']:.0f} bytes/token measured vs "
                  f"{kv['bytes_per_token_mha']} for the original full cache ({kv['dtype']}): ratio "
                  f"{kv['ratio_measured']:.4f} measured, {kv['ratio_nominal']:.4f} nominal"
                  + (f" ({kv['ratio_nominal_paper']:.4f} nominal against a BF16 cache, the paper's convention)"
                     if kv.get("ratio_nominal_paper") not in (None, kv["ratio_nominal"]) else "") + ".", ""]
    return "\n".join(lines)


def _stderrs(cs: dict, n: dict, cols) -> list:
    """Binomial standard errors of the sampled scores (ARC and Avg propagated as the means they are)."""
    se = {c: math.sqrt(cs[c] * (1 - cs[c]) / n[c]) for c in n if c in cs}
    if "arc_easy" in se and "arc_challenge" in se:
        se["arc"] = 0.5 * math.hypot(se["arc_easy"], se["arc_challenge"])
    from .commonsense import AVG_COLUMNS

    if all(c in se for c in AVG_COLUMNS):
        se["avg"] = math.sqrt(sum(se[c] ** 2 for c in AVG_COLUMNS)) / len(AVG_COLUMNS)
    return [se.get(c) for c in cols]


def _reference_rows():
    """The paper's original 135M SmolLM row (v1 Table 1), and the published SmolLM2-135M figures."""
    path = Path(__file__).resolve().parents[1] / "reference" / "paper_v1_commonsense.csv"
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["table"] == "1" and r["model"] == "135M SmolLM" and r["variant"] == "original":
                rows.append(("paper v1: SmolLM-135M original (lighteval)",
                             {c: r[c] for c in ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande", "avg")}))
    rows.append(("published SmolLM2-135M (approx.)", {"arc": "~44", "piqa": "~68", "hellaswag": "~42"}))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mha2mla_exp.evaluation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="conf/model/<name>.yaml or a path to such a file")
    p.add_argument("--render", action="store_true", help="only re-render <out>/result.md from <out>/result.json")
    p.add_argument("--eval", default="default", help="conf/eval/<name>.yaml or a path (default: default)")
    p.add_argument("--suite", choices=SUITES, help="run only this suite of the eval config")
    p.add_argument("--limit", type=int, help="docs per task of --suite (default commonsense)")
    p.add_argument("--mmlu-limit", type=int, help="docs per MMLU subject")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override an eval key")
    p.add_argument("--convert", help="evaluate convert_to_mla(model, ...) instead, e.g. rope=none,svd=none")
    p.add_argument("--kv-quant", help="quantized KV cache for generation tasks: hqq4, hqq2, quanto4, quanto2")
    p.add_argument("--window", type=int, help="evaluation window (default: the model config's finetune_length)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", required=True, help="output folder for result.json and result.md")
    args = p.parse_args(argv)
    if args.render:  # re-write result.md from an existing result.json
        result = json.loads((Path(args.out) / "result.json").read_text())
        (Path(args.out) / "result.md").write_text(markdown(result) + "\n")
        return 0

    import torch

    from ..models import load_model
    from .run import parse_eval_config, run_evaluation

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.model:
        p.error("--model is required")
    eval_cfg = build_eval_cfg(args)
    parse_eval_config(eval_cfg)  # fail before loading anything
    model_cfg = _conf("model", args.model)
    started = time.perf_counter()
    model, tokenizer = load_model(model_cfg, dtype=args.dtype)
    variant = "original"
    if args.convert:
        from ..mla import convert_to_mla

        kwargs = {k: (int(v) if v.isdigit() else v) for k, _, v in (kv.partition("=") for kv in args.convert.split(","))}
        model, variant = convert_to_mla(model, **kwargs).eval(), f"mla({args.convert}), not fine-tuned"
    window = args.window or model_cfg.get("finetune_length")
    ev = run_evaluation(model, tokenizer, eval_cfg, kv_quant=_kv_quant(args.kv_quant), window=window)
    result = {
        "title": f"{model_cfg.get('name', args.model)} {variant}: {args.suite or args.eval}",
        "command": "python -m mha2mla_exp.evaluation " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "model": {"name": model_cfg.get("name"), "variant": variant,
                  "params": sum(p.numel() for p in model.parameters()), "dtype": args.dtype},
        "eval_config": eval_cfg, "eval": ev, "seconds": time.perf_counter() - started,
        "machine": f"{platform.machine()} {os.cpu_count()}-core CPU, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "result.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
