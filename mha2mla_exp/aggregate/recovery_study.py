"""Recovery recipes side by side at equal compute (the recovery study of issue 14).

One row per ok converted run of an experiment in `RECOVERY_EXPERIMENTS`: its recipe (objective, trainable
parameters, lr, the precision it trained in, layer-wise distillation first or not), the compute it spent
(wall seconds of distillation + fine-tune, probes excluded; tokens), its held-out perplexity along its probe
curve read at a common budget of seconds (the shortest run's: log-linear between probes), its final
held-out perplexity, and its commonsense Avg with a paired 95% interval against the paper's recipe (plain
cross-entropy on all parameters, no distillation). The unconverted model, where the experiment has it, is the
first row. The recipe with the lowest perplexity at the common budget is marked `best per second`; its Avg
difference says whether the commonsense suite resolves the choice.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .comparisons import _ALL
from .records import recovery_recipe
from .tables import delta, rows_of_ours

RECOVERY_EXPERIMENTS = ("recovery_study",)
REFERENCE = "ce"   # the paper's recipe, every Avg is paired against it: cross-entropy, all parameters, no ILD


ORIGINAL = "original (unconverted)"   # a reference row: the model every recipe recovers towards


def _is_reference(run: dict) -> bool:
    return run.get("objective") == "ce" and run.get("trainable") == "all" and pd.isna(run.get("distill_token_passes"))


def ppl_at(curve: pd.DataFrame, seconds: float) -> float | None:
    """Held-out perplexity of a probe curve (`seconds`, `ppl` columns) at `seconds`: log-linear between probes,
    None beyond its last probe."""
    curve = curve.dropna().sort_values("seconds")
    if not len(curve) or seconds > curve["seconds"].iloc[-1] + 1e-6:
        return None
    return float(np.exp(np.interp(seconds, curve["seconds"], np.log(curve["ppl"]))))


def recovery_table(runs: pd.DataFrame, probes: pd.DataFrame, experiment: str) -> pd.DataFrame:
    ok = runs[(runs["experiment"] == experiment) & (runs["status"] == "ok")
              & runs["method"].isin(["original", "partial_rope+svd"])] if len(runs) else runs
    if not (ok["method"] == "partial_rope+svd").any():
        return pd.DataFrame()
    recipes = [ORIGINAL if r["method"] == "original" else recovery_recipe(r) for r in ok.to_dict("records")]
    ok = ok.assign(recipe=recipes, distill_seconds=ok["distill_s"].fillna(0).astype(float))
    curves = {}
    for run in ok.itertuples():
        probe = probes[probes["run_dir"] == run.run_dir] if len(probes) else probes
        curves[run.run_dir] = pd.DataFrame({"seconds": run.distill_seconds + probe["elapsed_s"].astype(float),
                                            "ppl": probe["heldout_ppl_probe"].astype(float)})
    ends = [c["seconds"].max() for c in curves.values() if len(c)]
    common = float(min(ends)) if ends else None
    scored = {r.runs[0]["run_dir"]: r for r in rows_of_ours(_ALL["commonsense"], ok)}
    reference = next((r for r in scored.values() if _is_reference(r.runs[0])), None)
    at_common = f"ppl @ {common:.0f} s" if common else "ppl @ common s"
    records = []
    for run in ok.sort_values(["method", "recipe"]).to_dict("records"):   # the original first
        row = scored.get(run["run_dir"])
        interval = row.intervals.get("avg") if row else None
        diff = delta(row, reference).get("avg") if row and reference and row is not reference else None
        records.append({
            "recipe": run["recipe"], "precision": run["precision"], "tokens": run["train_tokens"],
            "ILD s": run["distill_s"], "fine-tune s": run["train_s"], "tok/s": run["train_tokens_per_s"],
            at_common: ppl_at(curves[run["run_dir"]], common) if common else None,
            "final ppl": run["heldout_ppl"], "Avg": row.scores.get("avg") if row else None,
            "Avg 95% CI": f"[{interval.low:.1f}, {interval.high:.1f}]" if interval else "",
            f"Δ Avg vs {REFERENCE} [95% CI]": f"{diff.estimate:+.1f} [{diff.low:+.1f}, {diff.high:+.1f}]"
            + ("" if diff.resolved else " not resolved") if diff else "",
        })
    table = pd.DataFrame.from_records(records)
    converted = table[table["recipe"] != ORIGINAL]
    if converted[at_common].notna().any():
        best = converted[at_common].astype(float).idxmin()
        table["choice"] = ["best per second" if i == best else "" for i in table.index]
    return table
