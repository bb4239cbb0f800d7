"""The paper's v1 numbers (package data) in the same terms as `records.canonical_runs`.

Only labels are normalized (model names, `r = d_h/16` -> a number, row kinds); no number is changed.
"""

from __future__ import annotations

from importlib import resources

import pandas as pd

from ..schema.commonsense_suite import paper_columns
from .records import LONGBENCH, PAPER_HEAD_DIM, UNQUANTIZED, method_of

# Table 2 names models by size only; Tables 1/3/5 by size and family.
_LONGBENCH_MODEL = {"7B": "7B Llama2", "1B7": "1B7 SmolLM", "360M": "360M SmolLM", "135M": "135M SmolLM"}


def _read_csv(name: str) -> pd.DataFrame:
    with resources.files("mha2mla_exp.reference").joinpath(name).open() as handle:
        return pd.read_csv(handle, dtype=str, keep_default_na=False)


def _number(text: str):
    return float(text) if text not in ("", None) else float("nan")


def _resolve_r(text: str, model: str):
    """'d_h/16' -> 4 for a d_h=64 model; '' -> missing; '8' -> 8."""
    if text in ("", None):
        return None
    if text.startswith("d_h/"):
        head_dim = PAPER_HEAD_DIM.get(model)
        return head_dim // int(text.split("/")[1]) if head_dim else None
    return int(text)


def paper_commonsense() -> pd.DataFrame:
    """Tables 1, 3 and 5 of the paper, one row per printed row, with a `table` number and `paper_order`."""
    raw = _read_csv("paper_v1_commonsense.csv")
    rows = []
    for order, rec in enumerate(raw.to_dict("records")):
        unconverted = rec["variant"] in ("original", "finetuned_full_attention")
        # Table 5's "full" row (all pairs keep RoPE, no SVD) is the fine-tuned unconverted model
        method = method_of(rec["variant"], None if unconverted else rec["rope"], rec["svd"], trained=True)
        full_model = method in ("original", "finetuned_full_attention")
        row = {
            "table": int(rec["table"]),
            "paper_order": order,
            "model": rec["model"],
            "method": method,
            "rope": "full" if full_model else rec["rope"],
            # Table 5 prints r=32 on its full-RoPE row: keep it for display, it is not part of the key
            "r": _resolve_r(rec["r"], rec["model"]),
            "svd": "none" if full_model else rec["svd"],
            "d_kv": None if full_model or rec["d_kv"] == "" else int(rec["d_kv"]),
            "kv_quant": UNQUANTIZED,
            "kv_dtype": "BF16",
            "kv_mem_change_pct": _number(rec["kv_mem_change_pct"]),
            "avg": _number(rec["avg"]),
        }
        for task in paper_columns():  # a column beyond the paper's: empty
            row[task] = _number(rec.get(task, ""))
        rows.append(row)
    return _typed(pd.DataFrame.from_records(rows))


def paper_longbench() -> pd.DataFrame:
    """Table 2 of the paper. Its d_kv rows are the Table 1 recipe (2-norm, r = d_h/16, joint SVD)."""
    raw = _read_csv("paper_v1_longbench.csv")
    rows = []
    for order, rec in enumerate(raw.to_dict("records")):
        model = _LONGBENCH_MODEL.get(rec["model"], rec["model"])
        original = rec["d_kv"] == "original"
        row = {
            "table": 2,
            "paper_order": order,
            "model": model,
            "context": rec["context"],
            "method": "original" if original else "partial_rope+svd",
            "rope": "full" if original else "2-norm",
            "r": None if original else _resolve_r("d_h/16", model),
            "svd": "none" if original else "joint",
            "d_kv": None if original else int(rec["d_kv"]),
            # the paper's caches are BF16, quantized or not: "BF16" in its CSV means unquantized
            "kv_quant": UNQUANTIZED if rec["precision"] == "BF16" else rec["precision"],
            "kv_dtype": "BF16",
            "kv_mem_change_pct": _number(rec["kv_mem_change_pct"]),
            "longbench.avg": _number(rec["avg"]),
        }
        for task in LONGBENCH:
            row[f"longbench.{task}"] = _number(rec[task])
        rows.append(row)
    return _typed(pd.DataFrame.from_records(rows))


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    for column in ("r", "d_kv"):
        frame[column] = pd.array(frame[column], dtype="Int64")
    return frame
