"""From run directories (and optionally a W&B project) to the tables, plots and runs.csv on disk."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from . import comparisons, plots
from .records import COMMONSENSE, COMMONSENSE_PARTS, canonical_runs, load_runs, training_curves, variant_label
from .render import dtype_view, main_view, pairwise_views, perplexity_pairs_view, task_views, write_table, write_views
from .tables import TABLES, build_tables
from .perplexity_pairs import perplexity_pairs
from .recovery_study import (RECOVERY_EXPERIMENTS, recovery_grid, recovery_interactions, recovery_matrix,
                             recovery_table, scored_rows)
from .zero_shot import ZERO_SHOT_EXPERIMENTS, budget_comparison, reference_conversions, zero_shot_table


def results_root() -> Path:
    """Where runs live: $MHA2MLA_RESULTS (the runner's setting) or ./results."""
    return Path(os.environ.get("MHA2MLA_RESULTS", "results"))


@dataclass
class Aggregate:
    records: pd.DataFrame            # one row per run, every results.json/config.yaml field flattened
    runs: pd.DataFrame               # one row per run, in the tables' terms (scores in points)
    tables: dict[str, pd.DataFrame]  # "table1", "table2", "table3", "table5"
    curves: pd.DataFrame             # training loss per logged step, per run
    probes: pd.DataFrame             # in-training held-out perplexity probes (train.eval_every), per run

    @property
    def n_ok(self) -> int:
        return int((self.runs["status"] == "ok").sum()) if len(self.runs) else 0

    def figures(self, models: list[str] | None = None) -> dict[str, Figure]:
        """The plots; `models` restricts the per-model ones to those paper model names."""
        return {
            "kv_memory_vs_avg": plots.kv_memory_vs_avg(self.tables["table1"], models),
            "strategy_comparison": plots.strategy_comparison(self.tables["table3"], models),
            "loss_curves": plots.loss_curves(self.curves),
            "long_context_vs_length": plots.long_context_vs_length(self.runs),
            "recovery_curves": plots.recovery_curves(self.runs, self.probes),
        } | {f"{experiment}_curves": plots.recovery_curves(self.runs, self.probes, experiment)
             for experiment in RECOVERY_EXPERIMENTS}


def build_aggregate(run_dirs: Iterable[str | Path] | None = None, wandb_project: str | None = None,
                    wandb_api=None) -> Aggregate:
    """Read every run record under `run_dirs` (default: <results root>/runs), plus a W&B project's runs
    when given, and build the tables. With no runs the tables hold the paper's numbers only."""
    paths = list(run_dirs) if run_dirs else [results_root() / "runs"]
    frames = [load_runs(paths)]
    if wandb_project:
        from .wandb_source import load_wandb_runs  # W&B only when asked for

        frames.append(load_wandb_runs(wandb_project, api=wandb_api))
    frames = [f for f in frames if len(f)]
    records = pd.concat(frames, ignore_index=True) if frames else load_runs([])
    runs = canonical_runs(records)
    if len(runs):
        runs.insert(0, "label", runs.apply(variant_label, axis=1))
    else:
        runs.insert(0, "label", pd.Series(dtype=object))
    return Aggregate(records=records, runs=runs, tables=build_tables(runs), curves=training_curves(runs),
                     probes=training_curves(runs, "heldout_ppl_probe"))


# table name -> (experiment, suite): every pair of the experiment's rows gets a table (REPORT.md cites them);
# a recovery experiment's own table already takes its name
PAIRWISE_EXPERIMENTS = {"headline": ("headline", "commonsense"), "recovery": ("recovery", "commonsense"),
                        "cpu10x_table1": ("cpu10x_table1", "commonsense"),
                        "passkey_nope": ("passkey_nope", "long_context"),
                        "teacher_recovery_pairs": ("teacher_recovery", "commonsense")}
# experiment -> its goal in Avg points against the original (issue 23): a line on its plots
RECOVERY_GOALS = {"teacher_recovery": -2.0}
# pairwise table -> (the row every other is plotted against, the goal line in points)
DELTA_PLOTS = {"teacher_recovery_pairs": ("original", RECOVERY_GOALS["teacher_recovery"])}
# table name -> experiments read together: every pair of their rows that differs in one factor, by perplexity
PERPLEXITY_PAIRS = {"cpu10x_perplexity": ("cpu10x_table3", "cpu10x_table5", "cpu10x_seed1", "cpu10x_table1")}
TASK_COLUMNS = {name: list(spec.paper_tasks) for name, spec in TABLES.items() if spec.suite == "commonsense"}


def _our_tasks(table) -> list[str]:
    """The per-task score columns of a long-context table (passkey@L)."""
    return [c for c in table.columns if c.startswith("passkey@") and "_" not in c]


PERPLEXITY_COLUMNS = ("experiment", "label", "train_tokens", "precision", "distill_token_passes", "convert_s",
                      "distill_s", "train_s", "kv_mem_change_pct", "heldout_ppl")


def perplexity_view(runs):
    """Every ok run with its held-out perplexity and the compute it took, grouped by experiment."""
    ok = runs[runs["status"] == "ok"] if len(runs) else runs
    columns = [c for c in PERPLEXITY_COLUMNS if c in runs.columns]
    return ok.loc[:, columns].sort_values(["experiment", "label"]).reset_index(drop=True)


def _seeds_note(table: pd.DataFrame) -> str:
    """How many seeds the rows of a recovery table stand on."""
    if table["seeds"].max() <= 1:
        return "one seed each."
    return ("one seed a row, except where it names several: their per-document mean (seconds and perplexities: "
            "their mean).")


def write_aggregate(aggregate: Aggregate, out_dir: str | Path) -> list[Path]:
    """tables/<table>.{csv,md,tex}, plots/<plot>.{png,pdf} and runs.csv under `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    tables = out_dir / "tables"
    for name, table in aggregate.tables.items():
        spec = TABLES[name]
        note = spec.note + (" Ours in percentage points; ± and [ ] are 95% intervals (paired bootstrap over the "
                            "same docs, or unpaired binomial where a run has no per-document results); "
                            "'not resolved': the interval contains 0. Full numbers: " + name + ".csv."
                            if aggregate.n_ok else " No run records were found: our columns are empty.")
        tables.mkdir(parents=True, exist_ok=True)
        table.to_csv(tables / f"{name}.csv", index=False)
        written.append(tables / f"{name}.csv")
        written += write_views(tables, name, {"": main_view(table, spec.by_precision, spec.with_kv_memory)},
                               spec.title, note)
        scores, deltas = task_views(table, TASK_COLUMNS.get(name) or _our_tasks(table), spec.suite == "commonsense")
        written += write_views(tables, f"{name}_tasks", {"Scores, ours / paper": scores,
                                                         "Δ vs baseline [95% CI]": deltas},
                               spec.title + ", per task", note)
    for name, figure in aggregate.figures().items():
        written += plots.save_figure(figure, out_dir / "plots", name)
    for name, (experiment, suite) in PAIRWISE_EXPERIMENTS.items():
        pairs = comparisons.pairwise(aggregate.runs, experiment, suite)
        if len(pairs):
            tasks = list(COMMONSENSE) if suite == "commonsense" else _our_tasks(pairs)
            pairs.to_csv(tables / f"{name}.csv", index=False)
            written += [tables / f"{name}.csv"] + write_views(
                tables, name, pairwise_views(pairs, tasks),
                f"Experiment {experiment}: every pair of its rows on the same docs",
                "B minus A in percentage points; [ ] a paired bootstrap 95% interval over the same documents "
                "(resampled within each task); 'not resolved': the interval contains 0.")
            if name in DELTA_PLOTS:
                reference, target = DELTA_PLOTS[name]
                written += plots.save_figure(plots.score_deltas_vs(
                    pairs, reference, f"Experiment {experiment}: each row against the {reference} model, paired",
                    target), out_dir / "plots", f"{name}_vs_{reference}")
                written += plots.save_figure(plots.scores_vs_recovery_ppl(
                    pairs, reference, f"Experiment {experiment}: what a row keeps against how well it fits the text "
                    "it recovered on"), out_dir / "plots", f"{name}_vs_recovery_ppl")
    for experiment in ZERO_SHOT_EXPERIMENTS:
        table = zero_shot_table(aggregate.runs, experiment)
        if len(table):
            written += write_table(table, tables, experiment,
                                   f"Experiment {experiment}: conversions without fine-tuning at equal KV bytes",
                                   "Held-out perplexity on the same held-out rows for every conversion, one seed "
                                   "(deterministic given the calibration rows); × original: its multiple of the "
                                   "original model's perplexity.")
    comparison = budget_comparison(aggregate.runs, reference_conversions(results_root() / "transmla"))
    if len(comparison):
        written += write_table(comparison, tables, "budget_vs_transmla",
                               "Zero-shot held-out perplexity at equal cached elements per token and layer: ours "
                               "and TransMLA's own converter",
                               "The same SmolLM2-135M, the same 32 x 256 calibration rows and the same 32 x 512 "
                               "held-out rows (original 31.1); TransMLA run by scripts/transmla_reference.py "
                               "(results/transmla/README.md); one conversion each, deterministic given the "
                               "calibration rows. ours / TransMLA: the perplexity ratio with a paired bootstrap "
                               "95% interval over the 32 held-out rows; 'not resolved': it contains 1.")
        written += plots.save_figure(plots.budget_vs_reference(comparison), out_dir / "plots", "budget_vs_transmla")
    for name, experiments in PERPLEXITY_PAIRS.items():
        pairs = perplexity_pairs(aggregate.runs, experiments)
        if len(pairs):
            written += write_table(perplexity_pairs_view(pairs), tables, name,
                                   f"Held-out perplexity, every pair of rows of {', '.join(experiments)} that "
                                   "differs in one factor",
                                   "B/A: perplexity ratio (below 1: B better) with a paired bootstrap 95% interval "
                                   "over the same held-out rows; per seed: the ratio of the runs with that seed; "
                                   "verdict: resolved only when the interval excludes 1 and every seed agrees "
                                   "(mha2mla_exp/aggregate/perplexity_pairs.py).")
            written += plots.save_figure(plots.perplexity_ratios(pairs, f"Held-out perplexity, pairs of rows of "
                                                                        f"{', '.join(experiments)}"),
                                         out_dir / "plots", name)
    for experiment in RECOVERY_EXPERIMENTS:
        rows = scored_rows(aggregate.runs, experiment)   # per-document results, read once for every table below
        table = recovery_table(aggregate.runs, aggregate.probes, experiment, rows)
        if len(table):
            written += write_table(table, tables, experiment,
                                   f"Experiment {experiment}: recovery recipes at equal compute",
                                   "Seconds: wall-clock on the run's machine, layer-wise distillation (ILD) + "
                                   "fine-tune, held-out probes excluded; ppl @ N s: the probe curve (held-out "
                                   "rows of train.eval_batches) read at the shortest run's seconds; final ppl: "
                                   "eval.perplexity's held-out rows; Avg: commonsense, points, paired bootstrap "
                                   "vs the paper's recipe (ce, all parameters) on the same docs; "
                                   + _seeds_note(table))
        grid = recovery_grid(aggregate.runs, experiment, rows)
        if len(grid):
            shown = grid.drop(columns=["run_dir", "own corpus"]).round({c: 2 for c in ("avg", "delta", "low", "high")})
            shown["lr"] = shown["lr"].map(lambda lr: "" if pd.isna(lr) else f"{lr:g}")   # 3e-4, not 0.00
            written += write_table(shown, tables, f"{experiment}_grid",
                                   f"Experiment {experiment}: the ingredient grid, each row against the original",
                                   "delta [low, high]: Avg − original in points with a paired bootstrap 95% "
                                   "interval over the same documents; differs: what sets a control apart from its "
                                   "recovery's usual recipe in this experiment; " + _seeds_note(grid))
            written += write_table(recovery_matrix(grid), tables, f"{experiment}_matrix",
                                   f"Experiment {experiment}: conversion x recovery, each against the original",
                                   "Avg − original in points [paired bootstrap 95% interval over the same documents]"
                                   "; n.r.: not resolved (the interval holds 0); each cell the recovery's usual "
                                   "recipe (controls: the grid table); empty: not run; " + _seeds_note(grid))
            interactions = recovery_interactions(aggregate.runs, experiment, grid, rows)
            if len(interactions):
                written += write_table(
                    interactions.drop(columns=["estimate", "low", "high", "resolved"]), tables,
                    f"{experiment}_interactions",
                    f"Experiment {experiment}: does what an ingredient buys depend on the conversion or the budget?",
                    "at a, at b: the contrast's Avg difference in points at each of two rows of the matrix; a − b: "
                    "their difference (an interaction) on the same documents, paired bootstrap 95% interval; n.r.: "
                    "not resolved; every pair of rows that ran both recoveries, so about one interval in twenty "
                    "excludes 0 by chance; " + _seeds_note(grid))
            written += plots.save_figure(plots.recovery_grid(
                grid, f"Experiment {experiment}: what each conversion keeps after each recovery, against the "
                "original", RECOVERY_GOALS.get(experiment)), out_dir / "plots", f"{experiment}_grid")
    check = comparisons.dtype_check(aggregate.runs)
    if len(check):
        check.to_csv(tables / "dtype_check.csv", index=False)
        written += [tables / "dtype_check.csv"] + write_views(
            tables, "dtype_check", {"": dtype_view(check, list(COMMONSENSE_PARTS))},
            "The same model on the same docs, evaluated in two dtypes",
            "same answers: documents whose scored choice (argmax of length-normalised log-likelihood; Winogrande: "
            "of log-likelihood) is the same in both dtypes, per task in %; Δ: the other dtype's Avg minus FP32's, "
            "paired bootstrap 95% interval.")
    view = perplexity_view(aggregate.runs)
    written += write_table(view, out_dir / "tables", "perplexity",
                           "Held-out perplexity and the compute behind it, every ok run",
                           "heldout_ppl on the data's held-out split (whole documents never trained on); "
                           "seconds are wall-clock on the run's machine (see runs.csv / results.json).")
    runs_csv = out_dir / "runs.csv"
    # every run, also those left out of the tables (status != ok), so failures stay visible
    aggregate.runs.assign(in_tables=aggregate.runs["status"] == "ok").to_csv(runs_csv, index=False)
    return written + [runs_csv]
