"""Conversions without fine-tuning, side by side at equal KV bytes per token (held-out perplexity).

One table per experiment listed in `ZERO_SHOT_EXPERIMENTS`: its un-fine-tuned rows, grouped by the KV memory
they keep, each with its perplexity as a multiple of the original model's on the same held-out rows. These
runs are single-seed and carry no interval: a conversion is deterministic given its calibration rows, and the
perplexity is one number over a fixed set of held-out tokens.
"""

from __future__ import annotations

import pandas as pd

ZERO_SHOT_EXPERIMENTS = ("rorope_zero_shot", "budget_zero_shot")


def zero_shot_table(runs: pd.DataFrame, experiment: str) -> pd.DataFrame:
    rows = runs[(runs["experiment"] == experiment) & (runs["status"] == "ok")
                & runs["train_tokens"].fillna(0).eq(0)].copy()
    if not len(rows):
        return pd.DataFrame()
    original = rows.loc[rows["method"] == "original", "heldout_ppl"]
    reference = float(original.iloc[0]) if len(original) else None
    budget = rows["kv_elements"].notna() if "kv_elements" in rows else pd.Series(False, index=rows.index)
    rows["svd_label"] = [
        "—" if m == "original" else "no SVD" if m == "partial_rope"
        else f"{s}, {int(kv)} per token: latent = {int(kv)} − rope dims" if b else f"{s} d_kv={int(d)}"
        for m, s, d, kv, b in zip(rows["method"], rows["svd"], rows["d_kv"].fillna(0),
                                  rows.get("kv_elements", pd.Series(0, index=rows.index)).fillna(0), budget)]
    table = pd.DataFrame({
        "KV memory": rows["kv_mem_change_pct"].map(lambda x: f"{x:+.2f} %"),
        "RoPE": [("original" if m == "original" else f"{rope}, rope dims {dims}" if b else f"{rope} r={int(r)}")
                 for m, rope, r, dims, b in zip(rows["method"], rows["rope"], rows["r"].fillna(0),
                                                rows.get("rope_dims", pd.Series("", index=rows.index)), budget)],
        "SVD": rows["svd_label"],
        "options": rows["options"].fillna(""),
        "held-out ppl": rows["heldout_ppl"].round(1),
        "× original": (rows["heldout_ppl"] / reference).round(2) if reference else None,
        "_kv": rows["kv_mem_change_pct"].fillna(0), "_converted": rows["method"] != "original",
        "_r": rows["r"].fillna(0),
    })
    # the original first; then per KV memory, per r, best first
    order = ["_kv", "_converted", "_r", "SVD", "held-out ppl"]
    return table.sort_values(order, ascending=[False, True, True, True, True]) \
        .drop(columns=["_kv", "_converted", "_r"]).reset_index(drop=True)
