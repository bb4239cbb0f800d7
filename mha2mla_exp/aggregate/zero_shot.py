"""Conversions without fine-tuning, side by side at equal KV bytes per token (held-out perplexity).

One table per zero-shot experiment (a `kinds.ZeroShot` entry): its un-fine-tuned rows, grouped by the KV memory
they keep, each with its perplexity as a multiple of the original model's on the same held-out rows. These
runs are single-seed and carry no interval: a conversion is deterministic given its calibration rows, and the
perplexity is one number over a fixed set of held-out tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .perplexity_pairs import held_out_rows, per_document_ratios, ratio_interval, resampling_unit


def zero_shot_table(runs: pd.DataFrame, experiment: str) -> pd.DataFrame:
    rows = runs[
        (runs["experiment"] == experiment) & (runs["status"] == "ok") & runs["train_tokens"].fillna(0).eq(0)
    ].copy()
    if not len(rows):
        return pd.DataFrame()
    original = rows.loc[rows["method"] == "original", "heldout_ppl"]
    reference = float(original.iloc[0]) if len(original) else None
    budget = rows["kv_elements"].notna() if "kv_elements" in rows else pd.Series(False, index=rows.index)
    rows["svd_label"] = [
        "—"
        if m == "original"
        else "no SVD"
        if m == "partial_rope"
        else f"{s}, {int(kv)} per token: latent = {int(kv)} − rope dims"
        if b
        else f"{s} d_kv={int(d)}"
        for m, s, d, kv, b in zip(
            rows["method"],
            rows["svd"],
            rows["d_kv"].fillna(0),
            rows.get("kv_elements", pd.Series(0, index=rows.index)).fillna(0),
            budget,
        )
    ]
    table = pd.DataFrame(
        {
            "KV memory": rows["kv_mem_change_pct"].map(lambda x: f"{x:+.2f} %"),
            "RoPE": [
                ("original" if m == "original" else f"{rope}, rope dims {dims}" if b else f"{rope} r={int(r)}")
                for m, rope, r, dims, b in zip(
                    rows["method"],
                    rows["rope"],
                    rows["r"].fillna(0),
                    rows.get("rope_dims", pd.Series("", index=rows.index)),
                    budget,
                )
            ],
            "SVD": rows["svd_label"],
            "options": rows["options"].fillna(""),
            "held-out ppl": rows["heldout_ppl"].round(1),
            "× original": (rows["heldout_ppl"] / reference).round(2) if reference else None,
            "_kv": rows["kv_mem_change_pct"].fillna(0),
            "_converted": rows["method"] != "original",
            "_r": rows["r"].fillna(0),
        }
    )
    # the original first; then per KV memory, per r, best first
    order = ["_kv", "_converted", "_r", "SVD", "held-out ppl"]
    return (
        table.sort_values(order, ascending=[False, True, True, True, True])
        .drop(columns=["_kv", "_converted", "_r"])
        .reset_index(drop=True)
    )


def reference_conversions(folder: Path) -> pd.DataFrame:
    """Another project's converter measured on our rows: TransMLA's (scripts/transmla_reference.py writes one
    JSON per split into results/transmla/). Empty when the folder holds none."""
    records = []
    for path in sorted(Path(folder).glob("*.json")) if Path(folder).is_dir() else []:
        r = json.loads(path.read_text())
        if r.get("status") != "ok":
            continue
        options = r.get("options", {})
        records.append(
            {
                "KV elements": int(r["total"]),
                "converter": "TransMLA (its own code)",
                "rope dims": str(r["qk_mqa_dim"]),
                "latent": str(r["kv_lora_rank"]),
                "held-out ppl": r["heldout_ppl"],
                "_original_cache": int(r["original_cache"]),
                "options": f"freqfold {options.get('freqfold_chosen', options.get('freqfold'))}, "
                f"commit {r['transmla']['commit'][:8]}",
                "_rows": held_out_rows(
                    r.get("heldout_row_nll"),
                    r.get("heldout_row_tokens"),
                    r.get("heldout_row_document"),
                    r.get("heldout_row_index"),
                ),
            }
        )
    return pd.DataFrame.from_records(records)


def budget_comparison(runs: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Ours against the reference converter at equal cached elements per token and layer: every un-fine-tuned
    conversion in `runs` (the caller picks the experiments) with a joint latent (a fixed r/d_kv or a KV budget) at
    a total the reference measured. Our elements per token and layer are the measured cache ratio times the
    original's cache. Where both sides kept per-row NLLs of the same held-out rows, "ours / reference" is the
    perplexity ratio with its paired bootstrap 95 % interval (documents resampled when the rows' documents are
    known), and resolved only when the interval excludes 1 and every document agrees in direction."""
    if not len(reference):
        return pd.DataFrame()
    full = int(reference["_original_cache"].iloc[0])
    by_elements = {int(e): row for e, row in zip(reference["KV elements"], reference.to_dict("records"))}
    ok = runs[(runs["status"] == "ok") & runs["train_tokens"].fillna(0).eq(0) & (runs["method"] == "partial_rope+svd")]
    records = []
    for run in ok.to_dict("records"):
        elements = int(round(full * (1 + run["kv_mem_change_pct"] / 100)))
        if elements not in set(reference["KV elements"]):
            continue
        if isinstance(run.get("kv_split"), str):  # a budget: the split is the layers' (or the fixed one)
            converter, rope_dims = f"ours: {run['rope']}, split {run['kv_split']}", run["rope_dims"]
            latent = f"{elements} − rope dims"
            if "allocation=measured" in (run.get("options") or ""):  # per layer: widths differ, the total kept
                latent += f" on average ({run['latent_dims']} per layer)"
        else:  # r pairs per KV head and d_kv per KV head: n_kv = elements / (2r + d_kv)
            n_kv = elements // (2 * int(run["r"]) + int(run["d_kv"]))
            converter, rope_dims = f"ours: {run['rope']} r={int(run['r'])}", str(2 * n_kv * int(run["r"]))
            latent = str(n_kv * int(run["d_kv"]))
        ref = by_elements[elements]
        ours_rows = held_out_rows(
            run.get("heldout_row_nll"),
            run.get("heldout_row_tokens"),
            run.get("heldout_row_document"),
            run.get("heldout_row_index"),
        )
        ref_rows = ref["_rows"]
        vs, per_document, unit, verdict = "", "", "", "no interval (no per-row NLL kept)"
        if ours_rows is not None and ref_rows is not None and not ref_rows.same_rows(ours_rows):
            verdict = "not comparable: other held-out rows"  # its ppl is on rows the reference never scored
        elif ours_rows is not None and ref_rows is not None:
            ratio, low, high = ratio_interval(ref_rows, ours_rows)
            by_document = per_document_ratios(ref_rows, ours_rows)
            vs, unit = f"{ratio:.3f} [{low:.3f}, {high:.3f}]", resampling_unit(ref_rows)
            per_document = " / ".join(f"{x:.3f}" for x in by_document)
            one_way = all(x < 1 for x in by_document) or all(x > 1 for x in by_document)
            verdict = "ours lower" if high < 1 and one_way else "ours higher" if low > 1 and one_way else "not resolved"
        records.append(
            {
                "KV elements": elements,
                "converter": converter,
                "rope dims": rope_dims,
                "latent": latent,
                "held-out ppl": run["heldout_ppl"],
                "options": run.get("options") or "",
                "ours / TransMLA [95 %]": vs,
                "per document": per_document,
                "resampled": unit,
                "verdict": verdict,
            }
        )
    table = pd.concat(
        [reference.drop(columns=["_original_cache", "_rows"]), pd.DataFrame.from_records(records)], ignore_index=True
    )
    table["held-out ppl"] = table["held-out ppl"].astype(float).round(1)
    return table.sort_values(["KV elements", "held-out ppl"]).reset_index(drop=True).fillna("")
