"""Recovery recipes side by side at equal compute (the recovery study of issue 14).

One row per ok converted run of a recovery experiment (a `kinds.RecoveryStudy` entry): its recipe (objective,
trainable parameters, lr, the precision it trained in, layer-wise distillation first or not), the compute it spent
(wall seconds of distillation + fine-tune, probes excluded; tokens), its held-out perplexity along its probe
curve read at a common budget of seconds (the shortest run's: log-linear between probes), its final
held-out perplexity, and its commonsense Avg with a paired 95% interval against the paper's recipe (plain
cross-entropy on all parameters, no distillation). The unconverted model, where the experiment has it, is the
first row. The recipe with the lowest perplexity at the common budget is marked `best per second`; its Avg
difference says whether the commonsense suite resolves the choice.

`recovery_grid` reads the same runs as an ingredient grid (issue 23): KV saving x conversion x recovery data and
objective, each cell's Avg against the unconverted original on the same documents; `recovery_matrix` lays it out
as conversion x recovery, and `recovery_interactions` asks whether what one ingredient buys depends on the
conversion or the KV budget it is bought at.
"""

from __future__ import annotations

from itertools import combinations
from types import SimpleNamespace

import numpy as np
import pandas as pd

from .comparisons import _ALL, same_docs
from .records import recovery_recipe
from .tables import Row, contrast, delta, rows_of_ours

REFERENCE = "ce"  # the paper's recipe, every Avg is paired against it: cross-entropy, all parameters, no ILD,
# on the run's own corpus; per conversion where an experiment has several


ORIGINAL = "original (unconverted)"  # a reference row: the model every recipe recovers towards


def _is_reference(run: dict) -> bool:
    return (
        run.get("objective") == "ce"
        and run.get("trainable") == "all"
        and pd.isna(run.get("distill_token_passes"))
        and not isinstance(run.get("train_data"), str)
    )


def conversion_label(run: dict) -> str:
    """The conversion a recipe starts from, e.g. "rorope r=4, joint d_kv=16, score=rotation, init=bkv"."""
    if run.get("method") == "original":
        return ""
    options = run.get("options") if isinstance(run.get("options"), str) else ""
    if not pd.isna(run.get("kv_elements")):  # a KV-byte budget: its rope/latent split is the conversion
        shape = (
            f"{run['rope']}, {_int(run['kv_elements'])} elements = {run.get('rope_dims')} rope dims"
            f" + {run['svd']} latent"
        )
    else:
        shape = f"{run['rope']} r={_int(run.get('r'))}, {run['svd']} d_kv={_int(run.get('d_kv'))}"
    return ", ".join(x for x in (shape, options) if x)


def _int(value) -> str:
    return "?" if pd.isna(value) else str(int(value))


def ppl_at(curve: pd.DataFrame, seconds: float) -> float | None:
    """Held-out perplexity of a probe curve (`seconds`, `ppl` columns) at `seconds`: log-linear between probes,
    None beyond its last probe."""
    curve = curve.dropna().sort_values("seconds")
    if not len(curve) or seconds > curve["seconds"].iloc[-1] + 1e-6:
        return None
    return float(np.exp(np.interp(seconds, curve["seconds"], np.log(curve["ppl"]))))


def _ok_runs(runs: pd.DataFrame, experiment: str) -> pd.DataFrame:
    return runs[(runs["experiment"] == experiment) & (runs["status"] == "ok")] if len(runs) else runs


def scored_rows(runs: pd.DataFrame, experiment: str) -> list[Row]:
    """An experiment's ok runs as commonsense rows (per-document results read from disk: compute once, pass on)."""
    ok = _ok_runs(runs, experiment)
    return rows_of_ours(_ALL["commonsense"], ok) if len(ok) else []


def _original(rows: list[Row]) -> Row | None:
    """The unconverted, untrained model's scored row: what every recipe recovers towards."""
    return next((r for r in rows if r.runs[0]["method"] == "original"), None)


def recovery_table(
    runs: pd.DataFrame, probes: pd.DataFrame, experiment: str, rows: list[Row] | None = None
) -> pd.DataFrame:
    """`rows`: `scored_rows(runs, experiment)` where the caller has them already (the per-document read is slow)."""
    ok = _ok_runs(runs, experiment)
    ok = ok[ok["method"].isin(["original", "partial_rope+svd"])] if len(ok) else ok
    if not (ok["method"] == "partial_rope+svd").any():
        return pd.DataFrame()
    recipes = [ORIGINAL if r["method"] == "original" else recovery_recipe(r) for r in ok.to_dict("records")]
    ok = ok.assign(recipe=recipes, distill_seconds=ok["distill_s"].fillna(0).astype(float))
    curves = {}
    for run in ok.itertuples():
        probe = probes[probes["run_dir"] == run.run_dir] if len(probes) else probes
        curves[run.run_dir] = pd.DataFrame(
            {
                "seconds": run.distill_seconds + probe["elapsed_s"].astype(float),
                "ppl": probe["heldout_ppl_probe"].astype(float),
            }
        )
    ends = [c["seconds"].max() for c in curves.values() if len(c)]
    common = float(min(ends)) if ends else None
    rows = scored_rows(runs, experiment) if rows is None else rows
    scored = {r.runs[0]["run_dir"]: r for r in rows if r.runs[0]["run_dir"] in set(ok["run_dir"])}
    # a setting's seeds are one row: per-run numbers are their mean, the Avg is on their per-document mean
    by_dir = {run["run_dir"]: run for run in ok.to_dict("records")}
    seeds_of = {run_dir: [run] for run_dir, run in by_dir.items()}
    for row in scored.values():
        seeds_of |= {r["run_dir"]: [] for r in row.runs[1:]}  # written with the first seed
        seeds_of[row.runs[0]["run_dir"]] = [by_dir[r["run_dir"]] for r in row.runs]
    conversions = {run["run_dir"]: conversion_label(run) for run in ok.to_dict("records")}
    several = len({c for c in conversions.values() if c}) > 1
    references = {conversions[d]: r for d, r in scored.items() if _is_reference(r.runs[0])}
    original = _original(list(scored.values()))
    trains_elsewhere = ok["train_data"].notna().any() if "train_data" in ok else False
    at_common = f"ppl @ {common:.0f} s" if common else "ppl @ common s"
    records = []
    for run in ok.sort_values(["method", "recipe"]).to_dict("records"):  # the original first
        seeds = seeds_of[run["run_dir"]]
        if not seeds:
            continue
        row = scored.get(run["run_dir"])
        at_seconds = [ppl_at(curves[r["run_dir"]], common) for r in seeds] if common else []
        # the original is paired against the one reference recipe, when there is one conversion
        reference = (
            references.get(conversions[run["run_dir"]])
            if conversions[run["run_dir"]] or several
            else next(iter(references.values()), None)
        )
        interval = row.intervals.get("avg") if row else None
        diff = delta(row, reference).get("avg") if row and reference and row is not reference else None
        record = {"conversion": conversions[run["run_dir"]]} if several else {}
        record |= {
            "recipe": run["recipe"],
            "precision": run["precision"],
            "tokens": run["train_tokens"],
            "seeds": len(seeds),
            "ILD s": _mean(seeds, "distill_s"),
            "fine-tune s": _mean(seeds, "train_s"),
            "tok/s": _mean(seeds, "train_tokens_per_s"),
            at_common: float(np.mean(at_seconds)) if at_seconds and None not in at_seconds else None,
            "final ppl": _mean(seeds, "heldout_ppl"),
        }
        if trains_elsewhere:  # the held-out text of the corpus the recipes trained on (the teacher's)
            record["ppl on its recovery text"] = _mean(seeds, "train_data_heldout_ppl")
        record |= {
            "Avg": row.scores.get("avg") if row else None,
            "Avg 95% CI": f"[{interval.low:.1f}, {interval.high:.1f}]" if interval else "",
            f"Δ Avg vs {REFERENCE} [95% CI]": _interval_text(diff),
        }
        if original is not None:
            to_original = delta(row, original).get("avg") if row and row is not original else None
            record["Δ Avg vs original [95% CI]"] = _interval_text(to_original)
        records.append(record)
    table = pd.DataFrame.from_records(records)
    converted = table[table["recipe"] != ORIGINAL]
    if converted[at_common].notna().any():
        best = converted[at_common].astype(float).idxmin()
        table["choice"] = ["best per second" if i == best else "" for i in table.index]
    return table


def _mean(runs: list[dict], column: str) -> float | None:
    """A per-run number over a setting's seeds (those that have it)."""
    values = [run.get(column) for run in runs if not pd.isna(run.get(column))]
    return float(np.mean(values)) if values else None


def _interval_text(diff, unresolved: str = " not resolved") -> str:
    """A paired difference as "+1.4 [+0.1, +2.8]", `unresolved` appended when its interval holds 0."""
    if diff is None:
        return ""
    return f"{diff.estimate:+.1f} [{diff.low:+.1f}, {diff.high:+.1f}]" + ("" if diff.resolved else unresolved)


def recovery_grid(runs: pd.DataFrame, experiment: str, rows: list[Row] | None = None) -> pd.DataFrame:
    """The ingredient grid of a recovery experiment: every fine-tuned row against the unconverted original on the
    same documents, as (KV saving, conversion, recovery) -> Avg − original with its paired 95 % interval.
    `recovery` is the data and objective ("ce on teacher-samples"); `differs` names what else sets a row apart
    from its recovery's usual recipe in this experiment (the most common tokens, lr and trainable parameters of
    its objective, the most common recovery set of its text), so that a control (longer, attention only, ...) is
    not read as a grid cell."""
    rows = scored_rows(runs, experiment) if rows is None else rows
    original = _original(rows)
    tuned = [r for r in rows if r is not original and (r.runs[0].get("train_tokens") or 0) > 0]
    if original is None or not tuned:
        return pd.DataFrame()
    records = []
    for row in tuned:
        run = row.runs[0]
        diff = delta(row, original).get("avg") if same_docs(row, original) else None
        if diff is None:
            continue
        recovered_on = run["train_data"] if isinstance(run.get("train_data"), str) else run.get("data")
        records.append(
            {
                "kv saving %": float(run.get("kv_mem_change_pct") or 0.0),
                "conversion": conversion_label(run)
                if run["method"] == "partial_rope+svd"
                else "full attention (unconverted)",
                "recovery": f"{run['objective']} on {str(recovered_on).split(' (')[0]}",
                "recovery set": recovered_on,
                "own corpus": not isinstance(run.get("train_data"), str),
                "objective": run["objective"],
                "tokens": int(run["train_tokens"]),
                "lr": run.get("lr"),
                "trainable": run.get("trainable"),
                "precision": run.get("precision"),
                "seeds": len(row.runs),
                "avg": row.scores.get("avg"),
                "delta": diff.estimate,
                "low": diff.low,
                "high": diff.high,
                "resolved": diff.resolved,
                "run_dir": run["run_dir"],
            }
        )
    grid = pd.DataFrame.from_records(records)
    # the budget of an objective (kd pays the teacher's forward: fewer tokens) and the set of a recovery's text
    usual = pd.DataFrame(
        {
            column: grid.groupby(by)[column].transform(lambda s: s.mode(dropna=False).iloc[0])
            for column, by in (
                ("tokens", "objective"),
                ("lr", "objective"),
                ("trainable", "objective"),
                ("recovery set", "recovery"),
            )
        }
    )
    grid["differs"] = [
        _differs(row, expected) for row, expected in zip(grid.to_dict("records"), usual.to_dict("records"))
    ]
    grid = grid.sort_values(["kv saving %", "conversion", "recovery"], ascending=[False, True, True])
    return grid.reset_index(drop=True)


def recovery_matrix(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid as a study's matrix: a row per (KV saving, conversion), a column per recovery (data x objective),
    each cell its Avg − original [paired 95 %] at the recovery's usual recipe, over the per-document mean of its
    seeds where it has several (their count named); controls (`differs`) stay in the grid. An empty cell is a
    combination not run. Twins of a cell in other training precisions share it."""
    usual = grid[grid["differs"] == ""]
    if not len(usual):
        return pd.DataFrame()

    def cell(runs: pd.DataFrame) -> str:
        def notes(r: dict) -> str:
            named = ([r["precision"]] if len(runs) > 1 else []) + ([f"{r['seeds']} seeds"] if r["seeds"] > 1 else [])
            return f" ({', '.join(named)})" if named else ""

        def interval(r: dict) -> str:
            return _interval_text(
                SimpleNamespace(estimate=r["delta"], low=r["low"], high=r["high"], resolved=r["resolved"]), " n.r."
            )

        return " / ".join(interval(r) + notes(r) for r in runs.to_dict("records"))

    matrix = usual.groupby(["kv saving %", "conversion", "recovery"]).apply(cell).unstack("recovery").fillna("")
    return matrix.sort_index(level=["kv saving %", "conversion"], ascending=[False, True]).reset_index()


def recovery_interactions(
    runs: pd.DataFrame, experiment: str, grid: pd.DataFrame, rows: list[Row] | None = None
) -> pd.DataFrame:
    """Does what an ingredient buys depend on where it is bought? For each contrast between two recoveries that
    differ in one ingredient (an objective against ce on the same text; a text against the run's own corpus under
    the same objective) and each two compressing rows of the matrix that ran both: the contrast at each row and
    their difference, (a - b) - (c - d) on the same documents with its paired bootstrap 95 % interval.
    Only the recoveries' usual recipes; where a cell has twins in two training precisions, the one in its row's
    most common precision. Every pair of rows is listed, so at 95 % about one in twenty intervals excludes 0 by
    chance alone. `rows`: `scored_rows(runs, experiment)` where the caller has them already."""
    usual = grid[(grid["differs"] == "") & (grid["kv saving %"] < 0)] if len(grid) else grid
    if not len(usual):
        return pd.DataFrame()
    scored = {row.runs[0]["run_dir"]: row for row in (scored_rows(runs, experiment) if rows is None else rows)}
    cells = {}  # (kv saving %, conversion) -> recovery -> grid record
    for (saving, conversion), group in usual.groupby(["kv saving %", "conversion"], sort=False):
        common = group["precision"].mode(dropna=False).iloc[0]
        preferred = group.assign(_other=group["precision"] != common).sort_values("_other")
        cells[(saving, conversion)] = {
            r["recovery"]: r for r in preferred.drop_duplicates("recovery").to_dict("records")
        }
    records = []
    for name, recovery, baseline in _contrasts(usual):
        having = sorted(
            (
                key
                for key, row in cells.items()
                if recovery in row
                and baseline in row
                and all(scored[row[r]["run_dir"]].values is not None for r in (recovery, baseline))
            ),
            key=lambda key: (-key[0], key[1]),
        )
        pair = {
            key: (scored[cells[key][recovery]["run_dir"]], scored[cells[key][baseline]["run_dir"]]) for key in having
        }
        at = {key: contrast([one], [zero])["avg"] for key, (one, zero) in pair.items()}  # once per row, not per pair
        for a, b in combinations(having, 2):
            (a1, a0), (b1, b0) = pair[a], pair[b]
            interaction = contrast([a1, b0], [a0, b1])["avg"]
            precisions = {cells[key][r]["precision"] for key in (a, b) for r in (recovery, baseline)}
            records.append(
                {
                    "contrast": name,
                    "kv saving % (a)": a[0],
                    "conversion (a)": a[1],
                    "at a": _interval_text(at[a], " n.r."),
                    "kv saving % (b)": b[0],
                    "conversion (b)": b[1],
                    "at b": _interval_text(at[b], " n.r."),
                    "a − b [95% CI]": _interval_text(interaction, " n.r."),
                    "estimate": interaction.estimate,
                    "low": interaction.low,
                    "high": interaction.high,
                    "resolved": interaction.resolved,
                    "training precisions": " / ".join(sorted(map(str, precisions))),
                }
            )
    return pd.DataFrame.from_records(records)


def _contrasts(usual: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(name, recovery, baseline) pairs that differ in one ingredient: each objective against ce on the same text,
    each text against the run's own corpus under the same objective."""
    recoveries = usual.drop_duplicates("recovery").set_index("recovery")
    text = {r: r.split(" on ", 1)[1] for r in recoveries.index}
    out = []
    for recovery, row in recoveries.iterrows():
        for baseline, other in recoveries.iterrows():
            same_text, same_objective = text[recovery] == text[baseline], row["objective"] == other["objective"]
            if same_text and other["objective"] == REFERENCE and row["objective"] != REFERENCE:
                out.append((f"objective: {recovery} − {baseline}", recovery, baseline))
            elif same_objective and other["own corpus"] and not row["own corpus"]:
                out.append((f"text: {recovery} − {baseline}", recovery, baseline))
    return sorted(out)


def _differs(row: dict, usual: dict) -> str:
    def other(column) -> bool:  # two missing values (a record without the key) are the same
        return not (row[column] == usual[column] or (pd.isna(row[column]) and pd.isna(usual[column])))

    notes = [f"{row['tokens']:,} tokens"] if other("tokens") else []
    notes += [f"lr {row['lr']:g}"] if other("lr") else []
    notes += [f"{row['trainable']} only"] if other("trainable") else []
    notes += [str(row["recovery set"])] if other("recovery set") else []
    return ", ".join(notes)
