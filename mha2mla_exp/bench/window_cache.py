"""`python -m mha2mla_exp.bench.window_cache`: one sequence's KV cache at 1k, 8k and 32k tokens, for a real model
with sliding-window layers (default: the offline Gemma-3 270M) and for its conversions: every layer converted,
the global layers only, the sliding layers only (`svd.convert_layers`), at each latent width.

Per row the formula (`mla.cache_elements_per_sequence`) and the bytes the model's own cache holds, measured:
the real model prefills `--prefill` tokens of held-out text into `model.new_cache()` (the original: transformers'
DynamicCache from its config), then the rest of the length is appended through the same cache objects' `update`
with each layer's own per-token shapes (zeros: what a cache keeps does not depend on the values). Bytes in fp32,
the dtype the model runs in here. Writes cache_bytes.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import yaml
from transformers import DynamicCache

from ..atomic import write_json, write_text
from ..confutil import CONF_DIR, typed_section
from ..machine import machine_info
from ..mla import ModelShape, attention_windows, cache_elements_per_sequence, cache_nbytes, convert_to_mla
from ..mla.spec import MLASpec

log = logging.getLogger("mha2mla_exp.bench.window_cache")
LENGTHS = (1024, 8192, 32768)
OPTIONS = ("all", "global", "sliding")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.window_cache", description=__doc__)
    p.add_argument("--model", default="gemma3_270m", help="a conf/model/ file with sliding-window layers")
    p.add_argument("--r", type=int, default=16, help="rope pairs per KV head (the paper's d_h/16)")
    p.add_argument("--d-kv", default="32,64,128", help="latent widths (Gemma-3 270M: -87.5, -81.25, -68.75 %%)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--prefill", type=int, default=1024, help="tokens the real model prefills (the rest appended)")
    p.add_argument("--out", type=Path, default=Path("results/gemma3"))
    return p.parse_args(argv)


@torch.no_grad()
def measured_bytes(model, cache, ids: torch.Tensor, lengths: list[int], chunk: int = 1024) -> dict[int, int]:
    """Bytes `cache` holds after the model prefills `ids`, then after appending up to each length."""
    model(input_ids=ids, cache=cache, use_cache=True)
    held, out = ids.shape[1], {}
    shapes = [(layer.keys.shape, layer.values.shape, layer.keys.dtype) for layer in cache.layers]
    for length in sorted(lengths):
        while held < length:
            step = min(chunk, length - held)
            for index, (k, v, dtype) in enumerate(shapes):
                cache.update(
                    torch.zeros(*k[:2], step, k[3], dtype=dtype), torch.zeros(*v[:2], step, v[3], dtype=dtype), index
                )
            held += step
        out[length] = cache_nbytes(cache)
    return out


def main(argv=None) -> int:
    from ..data import prepare_data
    from ..models import load_model
    from ..schema.sections import DataConfig, ModelConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    widths = [int(x) for x in args.d_kv.split(",")]
    model_cfg = typed_section(
        ModelConfig, yaml.safe_load((CONF_DIR / "model" / f"{args.model}.yaml").read_text()), "model"
    )
    model, tokenizer = load_model(model_cfg, device="cpu")
    data = prepare_data(
        typed_section(DataConfig, yaml.safe_load((CONF_DIR / "data" / "sotu.yaml").read_text()), "data"), tokenizer
    )
    ids = torch.cat(list(data.held_out))[: args.prefill][None]
    shape, windows = ModelShape.from_config(model.config), attention_windows(model.config)
    if all(w is None for w in windows):
        raise SystemExit(f"{args.model} has no sliding-window layer: nothing to compare")
    fp32 = 4
    rows = []

    def row(name: str, spec: MLASpec | None, measured: dict[int, int]) -> None:
        formula = {t: fp32 * cache_elements_per_sequence(shape, windows, t, spec)["total"] for t in lengths}
        rows.append({"cache": name, "formula_bytes": formula, "measured_bytes": measured})
        log.info("%s: %s", name, {t: (formula[t], measured[t]) for t in lengths})

    row("original", None, measured_bytes(model, DynamicCache(config=model.config), ids, lengths))
    for d_kv in widths:
        for option in OPTIONS:
            mla = convert_to_mla(model, rope="high", r=args.r, svd="joint", d_kv=d_kv, convert_layers=option)
            spec = MLASpec.create(shape, rope="high", r=args.r, svd="joint", d_kv=d_kv, convert_layers=option)
            row(
                f"MLA r={args.r} d_kv={d_kv}, convert {option}",
                spec,
                measured_bytes(mla, mla.new_cache(), ids, lengths),
            )
            del mla
    record = {
        "model": model_cfg.name,
        "windows": windows,
        "lengths": lengths,
        "dtype": "float32",
        "prefilled_tokens": int(ids.shape[1]),
        "rows": rows,
        "machine": machine_info(torch.device("cpu")),
        "command": "python -m mha2mla_exp.bench.window_cache " + " ".join(argv or []),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "cache_bytes.json", record)
    write_text(args.out / "cache_bytes.md", render(record))
    print(render(record))
    return 0 if all(r["formula_bytes"] == r["measured_bytes"] for r in rows) else 1


def render(record: dict) -> str:
    lengths = record["lengths"]
    original = record["rows"][0]["measured_bytes"]
    head = " | ".join(f"{t:,} tokens" for t in lengths)
    lines = [
        f"# One sequence's KV cache: {record['model']}, original vs conversions, fp32",
        "",
        f"Written by `{record['command'].strip()}`. Measured: the bytes the model's own cache holds after the real "
        f"model prefills {record['prefilled_tokens']:,} held-out SOTU tokens, the rest appended through the same "
        "cache objects; formula: `mla.cache_elements_per_sequence`. Percentages: of the original's measured cache, "
        f"its {sum(w is not None for w in record['windows'])} sliding layers holding their window.",
        "",
        f"| cache | {head} | measured = formula |",
        "|---|" + "---|" * len(lengths) + "---|",
    ]
    for r in record["rows"]:
        cells = [
            f"{r['measured_bytes'][t] / 2**20:,.2f} MiB ({100 * r['measured_bytes'][t] / original[t]:.1f} %)"
            for t in lengths
        ]
        same = "yes" if r["formula_bytes"] == r["measured_bytes"] else "**no**"
        lines.append(f"| {r['cache']} | " + " | ".join(cells) + f" | {same} |")
    machine = record["machine"]
    lines += ["", f"Machine: {machine['name']}; torch {machine['torch']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
