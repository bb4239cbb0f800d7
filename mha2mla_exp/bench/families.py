"""The family matrix: for every supported family, what the conversion keeps exactly and what its cache costs.

    python -m mha2mla_exp.bench.families [--out results/families]

On tiny random models of each family (bench/family_models.py, float32): the largest logit change of full RoPE
with a full-rank joint latent against the original, of a full-rank latent against partial RoPE alone, and of
absorbed against expanded attention (prefill, then decoding); which RoPE strategies convert and which are refused
(with the reason); the extra cached elements of the key norm. At real size, from each family's model config in
conf/model/: the bytes per token of the original cache, of MLA at -81.25 % (r = d_h/16, d_kv = d_h/4, the paper's
setting for d_h = 64 and 128) and of the key-norm scalars, in bf16; and the bytes one sequence's cache holds at
1k, 8k and 32k tokens, a sliding-window layer holding at most its window (`cache_elements_per_sequence`).
Writes matrix.json and matrix.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from ..aggregate.files import write_bytes
from ..machine import machine_info
from ..mla import (
    ROPE_STRATEGIES,
    MLASpec,
    ModelShape,
    attention_windows,
    cache_elements_per_sequence,
    convert_to_mla,
    kv_elements_per_token,
    max_d_kv,
)
from ..mla.families import FAMILIES as FAMILY_TABLE
from .family_models import FAMILIES, tiny_family_lm

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
BF16 = 2
LENGTHS = (1024, 8192, 32768)  # tokens per sequence of the bytes table
# The config.json facts that set a model's sliding windows, which its shape block leaves out (from the config.json
# copies each conf/model file cites): the family, whose transformers config lays the sliding and full layers out,
# and the window. A config not named here has full attention on every layer.
WINDOWED = {
    "gemma2_2b": ("gemma2", 4096),  # every other layer
    "gemma3_1b": ("gemma3_text", 512),  # five sliding layers to one global
    "mistral_7b": ("mistral", 4096),  # every layer (v0.1)
    "phi3_mini": ("phi3", 2047),  # every layer
}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def tiny_row(family: str, rows: torch.Tensor) -> dict:
    """What one family's tiny model shows (float32)."""
    model = tiny_family_lm(family)
    shape = ModelShape.from_config(model.config)
    original = model(rows).logits
    full = convert_to_mla(model, rope="full", svd="joint", d_kv=max_d_kv(shape, shape.head_dim // 2, "joint"))
    partial = convert_to_mla(model, rope="high", r=2, svd="none")(rows).logits
    joint = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=max_d_kv(shape, 2, "joint"))(rows).logits
    low = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=6)
    expanded = low(rows).logits
    cache, steps = low.new_cache(), []
    low.set_absorb(True)
    steps.append(low(rows[:, :16], cache=cache, use_cache=True).logits)
    for t in range(16, rows.shape[1]):
        steps.append(low(rows[:, t : t + 1], cache=cache, use_cache=True).logits)
    absorbed = torch.cat(steps, dim=1)
    converted, refused = [], {}
    for name in ROPE_STRATEGIES:
        r = None if name in ("full", "none") else 2
        try:
            convert_to_mla(model, rope=name, r=r, svd="joint", d_kv=8 if name == "full" else 6, calibration=[rows])
            converted.append(name)
        except ValueError as err:
            refused[name] = str(err)
    spec = MLASpec.create(shape, rope="high", r=2, svd="joint", d_kv=6)
    return {
        "family": family,
        "key_norm": shape.key_norm,
        "full_rank_vs_original": _diff(full(rows).logits, original),
        "full_rank_latent_vs_partial_rope": _diff(joint, partial),
        "absorbed_decode_vs_expanded": _diff(absorbed, expanded),
        "cache_bytes_equal_formula": cache.nbytes()
        == rows.shape[0]
        * cache_elements_per_sequence(shape, attention_windows(model.config), rows.shape[1], spec)["total"]
        * 4,
        "strategies_converted": converted,
        "strategies_refused": refused,
        "key_norm_elements_per_token_and_layer": shape.key_norm_scales,
    }


def real_size_rows() -> list[dict]:
    """Bytes (bf16) of each family's model config in conf/model/: per token with every layer's cache counted in
    full (original, MLA at -81.25 %, the key-norm scalars within it), and per sequence at `LENGTHS` tokens with
    each sliding layer holding its window (original and MLA)."""
    out = []
    for path in sorted(CONF.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        facts = cfg.get("shape") or {}
        if cfg.get("source") != "hub" or "num_kv_heads" not in facts:
            continue
        shape = ModelShape.from_facts(facts)
        spec = MLASpec.create(shape, rope="high", r=shape.head_dim // 16, svd="joint", d_kv=shape.head_dim // 4)
        layers = shape.num_layers
        original = 2 * shape.num_kv_heads * shape.head_dim * layers * BF16
        mla = kv_elements_per_token(shape, spec) * layers * BF16
        scalars = shape.key_norm_scales * layers * BF16
        windows = window_layout(path.stem, layers)
        context = facts.get("context_length")
        per_sequence = {
            n: {
                "original": BF16 * cache_elements_per_sequence(shape, windows, n)["total"],
                "mla": BF16 * cache_elements_per_sequence(shape, windows, n, spec)["total"],
            }
            for n in LENGTHS
            if context is None or n <= context
        }
        out.append(
            {
                "config": path.stem,
                "id": cfg.get("id"),
                "key_norm": shape.key_norm,
                "original_bytes_per_token": original,
                "mla_bytes_per_token": mla,
                "key_norm_bytes_per_token": scalars,
                "kv_saving_pct": round(100 * (1 - mla / original), 2),
                "key_norm_share_of_mla_pct": round(100 * scalars / mla, 2),
                "sliding_layers": sum(w is not None for w in windows),
                "window": next((w for w in windows if w is not None), None),
                "bytes_per_sequence": per_sequence,
            }
        )
    return out


def window_layout(config: str, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention) of a conf/model config, as its family lays them out."""
    if config not in WINDOWED:
        return [None] * layers
    from transformers import AutoConfig

    family, window = WINDOWED[config]
    return attention_windows(AutoConfig.for_model(family, num_hidden_layers=layers, sliding_window=window))


def markdown(tiny: list[dict], real: list[dict], machine: dict) -> str:
    lines = [
        "# Family matrix (`python -m mha2mla_exp.bench.families`)",
        "",
        f"Machine: {machine['name']}, torch {machine['torch']}. "
        "Tiny random models of each family (2 layers, 4 query / 2 KV heads, d_h 16, float32, random non-zero "
        "biases and norm gains), 2 x 24 tokens; max |dlogit|.",
        "",
        "| family | QK-norm | full RoPE + full-rank latent vs original | full-rank latent vs partial RoPE "
        "| absorbed decode vs expanded | cache bytes = formula | strategies converted | refused "
        "| extra cached elements / token / layer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in tiny:
        refused = ", ".join(row["strategies_refused"]) or "none"
        converted, tried = (
            len(row["strategies_converted"]),
            len(row["strategies_converted"]) + len(row["strategies_refused"]),
        )
        lines.append(
            f"| {row['family']} | {row['key_norm'] or '-'} | {row['full_rank_vs_original']:.1e} "
            f"| {row['full_rank_latent_vs_partial_rope']:.1e} | {row['absorbed_decode_vs_expanded']:.1e} "
            f"| {'yes' if row['cache_bytes_equal_formula'] else 'NO'} "
            f"| {converted} of {tried} "
            f"| {refused} | {row['key_norm_elements_per_token_and_layer']} |"
        )
    reasons = sorted({why for row in tiny for why in row["strategies_refused"].values()})
    lines += [f"\nRefused, in the converter's words: {why}" for why in reasons]
    lines += [
        "",
        "At real size (conf/model/, bf16 cache, MLA at -81.25 %: r = d_h/16, d_kv = d_h/4, per KV head), per "
        "token with every layer's cache counted in full:",
        "",
        "| config | hub id | QK-norm | original B/token | MLA B/token | KV saving | key-norm scalars B/token "
        "| scalars' share of the MLA cache |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in real:
        lines.append(
            f"| {row['config']} | {row['id']} | {row['key_norm'] or '-'} | {row['original_bytes_per_token']:,} "
            f"| {row['mla_bytes_per_token']:,} | -{row['kv_saving_pct']} % | {row['key_norm_bytes_per_token']:,} "
            f"| {row['key_norm_share_of_mla_pct']} % |"
        )
    lengths = " | ".join(f"{n // 1024}k: original / MLA / saving" for n in LENGTHS)
    lines += [
        "",
        "Per sequence, each sliding-window layer holding at most its window (window - 1 tokens between calls, as "
        "transformers' cache keeps them; the MLA cache keeps the same span, mla/cache.py), in MB "
        "(- : beyond the model's context):",
        "",
        f"| config | sliding layers | window | {lengths} |",
        "|---|---|---|" + "---|" * len(LENGTHS),
    ]
    for row in real:
        cells = []
        for n in LENGTHS:
            held = row["bytes_per_sequence"].get(n)
            if held is None:
                cells.append("-")
                continue
            saving = 100 * (1 - held["mla"] / held["original"])
            cells.append(f"{held['original'] / 1e6:,.1f} / {held['mla'] / 1e6:,.1f} / -{saving:.2f} %")
        lines.append(f"| {row['config']} | {row['sliding_layers']} | {row['window'] or '-'} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/families"))
    args = parser.parse_args(argv)
    rows = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    tiny = []
    for family in FAMILIES:
        print(f"converting tiny {family} ...", flush=True)
        tiny.append(tiny_row(family, rows))
    assert set(FAMILIES) <= set(FAMILY_TABLE)
    real = real_size_rows()
    machine = machine_info(torch.device("cpu"))
    record = {"command": "python -m mha2mla_exp.bench.families", "machine": machine, "tiny": tiny, "real": real}
    write_bytes(args.out / "matrix.json", (json.dumps(record, indent=2) + "\n").encode())
    table = markdown(tiny, real, machine)
    write_bytes(args.out / "matrix.md", table.encode())
    print(table)


if __name__ == "__main__":
    main()
