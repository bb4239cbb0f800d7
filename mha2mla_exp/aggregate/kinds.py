"""The kinds of table entries: each turns the runs of its experiments into the files of one table (or study).

A kind is a frozen dataclass of `table_registry.Entry` with the settings its builder needs; `build` calls the
builder (`tables`, `comparisons`, `zero_shot`, `perplexity_pairs`, `recovery_study`, `plots`) and returns the
frames and figures to write, never writing itself. What a kind's numbers mean is its `note`, shared by every
entry of the kind unless an entry gives its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..schema.commonsense_suite import paper_columns, task_columns
from . import comparisons, plots
from .perplexity_pairs import perplexity_pairs, perplexity_view
from .records import results_root
from .recovery_study import recovery_grid, recovery_interactions, recovery_matrix, recovery_table, scored_rows
from .render import dtype_view, main_view, pairwise_views, perplexity_pairs_view, task_views
from .table_registry import Artifact, Entry, FigureSpec, Inputs, PlotFiles, TableFiles
from .tables import TableSpec, build_table, paper_rows
from .zero_shot import budget_comparison, reference_conversions, zero_shot_table


def _passkey_columns(table: pd.DataFrame) -> list[str]:
    """The per-length score columns of a long-context table (passkey@L)."""
    return [c for c in table.columns if c.startswith("passkey@") and "_" not in c]


def _seeds_note(table: pd.DataFrame) -> str:
    """How many seeds the rows of a recovery table stand on."""
    if table["seeds"].max() <= 1:
        return "one seed each."
    return (
        "one seed a row, except where it names several: their per-document mean (seconds and perplexities: their mean)."
    )


@dataclass(frozen=True, kw_only=True)
class PaperTable(Entry):
    """A table of the paper's kind (`tables.build_table`): our rows beside the paper's, each against its baseline.
    Files: <name>.csv (every column), <name>.md/.tex (the main view), <name>_tasks.md/.tex (per task); `plot`:
    the figure drawn beside it from the table and the entry's inputs."""

    caption: str
    note: str
    spec: TableSpec
    plot: FigureSpec | None = None

    def table(self, runs: pd.DataFrame) -> pd.DataFrame:
        paper, every = paper_rows(self.spec)
        return build_table(self.spec, runs, paper, every)

    def build(self, inputs: Inputs) -> list[Artifact]:
        table = inputs.tables[self.name] if self.name in inputs.tables else self.table(inputs.runs)
        spec = self.spec
        note = self.note + (
            " Ours in percentage points; ± and [ ] are 95% intervals (paired bootstrap over the "
            "same docs, or unpaired binomial where a run has no per-document results); "
            "'not resolved': the interval contains 0. Full numbers: " + self.name + ".csv."
            if inputs.n_ok
            else " No run records were found: our columns are empty."
        )
        commonsense = spec.suite == "commonsense"
        scores, deltas = task_views(table, list(spec.tasks) if commonsense else _passkey_columns(table), commonsense)
        out = [
            TableFiles(
                self.name, {"": main_view(table, spec.by_precision, spec.with_kv_memory)}, self.caption, note, csv=table
            ),
            TableFiles(
                f"{self.name}_tasks",
                {"Scores, ours / paper": scores, "Δ vs baseline [95% CI]": deltas},
                self.caption + ", per task",
                note,
            ),
        ]
        if self.plot is not None:
            out.append(self.plot.render(table, inputs))
        return out


PAIRWISE_NOTE = (
    "B minus A in percentage points; [ ] a paired bootstrap 95% interval over the same documents "
    "(resampled within each task); 'not resolved': the interval contains 0."
)


@dataclass(frozen=True, kw_only=True)
class Pairwise(Entry):
    """Every pair of one experiment's rows scored on the same docs (`comparisons.pairwise`), B − A with its paired
    interval. `against`: a row (its label, as A) every other row is also plotted against: <name>_vs_<against>
    (forest plot, `goal` a dashed line in points) and <name>_vs_recovery_ppl."""

    caption: str
    note: str = PAIRWISE_NOTE
    suite: str = "commonsense"
    against: str | None = None
    goal: float | None = None

    def build(self, inputs: Inputs) -> list[Artifact]:
        pairs = comparisons.pairwise(inputs.runs, self.experiment, self.suite)
        if not len(pairs):
            return []
        tasks = list(paper_columns()) if self.suite == "commonsense" else _passkey_columns(pairs)
        out: list[Artifact] = [TableFiles(self.name, pairwise_views(pairs, tasks), self.caption, self.note, csv=pairs)]
        if self.against is not None:
            experiment, reference = self.experiment, self.against
            out += [
                PlotFiles(
                    f"{self.name}_vs_{reference}",
                    plots.score_deltas_vs(
                        pairs,
                        reference,
                        f"Experiment {experiment}: each row against the {reference} model, paired",
                        self.goal,
                    ),
                    f"Experiment {experiment}: how many commonsense points each row keeps against the {reference} "
                    "model" + ("" if self.goal is None else f", and which reach the goal ({self.goal:+g} points)"),
                ),
                PlotFiles(
                    f"{self.name}_vs_recovery_ppl",
                    plots.scores_vs_recovery_ppl(
                        pairs,
                        reference,
                        f"Experiment {experiment}: what a row keeps against how well it fits the text it recovered on",
                    ),
                    f"Experiment {experiment}: does fitting the recovery text better (lower perplexity on it) keep "
                    f"more of the {reference} model's scores?",
                ),
            ]
        return out


ZERO_SHOT_NOTE = (
    "Held-out perplexity on the same held-out rows for every conversion, one seed (deterministic given "
    "the calibration rows); × original: its multiple of the original model's perplexity."
)


@dataclass(frozen=True, kw_only=True)
class ZeroShot(Entry):
    """One experiment's conversions without fine-tuning, by KV memory (`zero_shot.zero_shot_table`)."""

    caption: str
    note: str = ZERO_SHOT_NOTE

    def build(self, inputs: Inputs) -> list[Artifact]:
        table = zero_shot_table(inputs.runs, self.experiment)
        return [TableFiles(self.name, {"": table}, self.caption, self.note, csv=table)] if len(table) else []


@dataclass(frozen=True, kw_only=True)
class ReferenceConverter(Entry):
    """Our zero-shot conversions against another converter's measured on the same rows
    (`zero_shot.budget_comparison`): the reference's JSON records live in <results root>/<reference_dir>.
    Files: <name>.csv/.md/.tex and plot <name>."""

    caption: str
    note: str
    reference_dir: str

    def build(self, inputs: Inputs) -> list[Artifact]:
        comparison = budget_comparison(inputs.runs, reference_conversions(results_root() / self.reference_dir))
        if not len(comparison):
            return []
        return [
            TableFiles(self.name, {"": comparison}, self.caption, self.note, csv=comparison),
            PlotFiles(self.name, plots.budget_vs_reference(comparison), self.caption),
        ]


PERPLEXITY_PAIRS_NOTE = (
    "B/A: perplexity ratio (below 1: B better) with a paired bootstrap 95% interval over the same "
    "held-out rows; per seed: the ratio of the runs with that seed; verdict: resolved only when "
    "the interval excludes 1 and every seed agrees (mha2mla_exp/aggregate/perplexity_pairs.py)."
)


@dataclass(frozen=True, kw_only=True)
class PerplexityPairs(Entry):
    """Every pair of rows of the experiments, read together, that differs in one factor, by held-out perplexity
    (`perplexity_pairs`). Files: <name>.csv/.md/.tex and the forest plot <name>."""

    caption: str
    question: str
    note: str = PERPLEXITY_PAIRS_NOTE

    def build(self, inputs: Inputs) -> list[Artifact]:
        pairs = perplexity_pairs(inputs.runs, self.experiments)
        if not len(pairs):
            return []
        view = perplexity_pairs_view(pairs)
        title = f"Held-out perplexity, pairs of rows of {', '.join(self.experiments)}"
        return [
            TableFiles(self.name, {"": view}, self.caption, self.note, csv=view),
            PlotFiles(self.name, plots.perplexity_ratios(pairs, title), self.question),
        ]


RECOVERY_NOTE = (
    "Seconds: wall-clock on the run's machine, layer-wise distillation (ILD) + fine-tune, held-out "
    "probes excluded; ppl @ N s: the probe curve (held-out rows of train.eval_batches) read at the "
    "shortest run's seconds; final ppl: eval.perplexity's held-out rows; Avg: commonsense, points, "
    "paired bootstrap vs the paper's recipe (ce, all parameters) on the same docs; "
)
GRID_NOTE = (
    "delta [low, high]: Avg − original in points with a paired bootstrap 95% interval over the same "
    "documents; differs: what sets a control apart from its recovery's usual recipe in this experiment; "
)
MATRIX_NOTE = (
    "Avg − original in points [paired bootstrap 95% interval over the same documents]; n.r.: not resolved "
    "(the interval holds 0); each cell the recovery's usual recipe (controls: the grid table); empty: not "
    "run; "
)
INTERACTIONS_NOTE = (
    "at a, at b: the contrast's Avg difference in points at each of two rows of the matrix; a − b: "
    "their difference (an interaction) on the same documents, paired bootstrap 95% interval; n.r.: "
    "not resolved; every pair of rows that ran both recoveries, so about one interval in twenty "
    "excludes 0 by chance; "
)


@dataclass(frozen=True, kw_only=True)
class RecoveryStudy(Entry):
    """A recovery study (`recovery_study`): <name> (recipes at equal compute), <name>_grid (each row against the
    original), <name>_matrix (conversion x recovery), <name>_interactions, and the grid as plot <name>_grid,
    `goal` (Avg points against the original) a dashed line on it."""

    caption: str
    goal: float | None = None

    def build(self, inputs: Inputs) -> list[Artifact]:
        experiment = self.experiment
        rows = scored_rows(inputs.runs, experiment)  # per-document results, read once for every table below
        out: list[Artifact] = []
        table = recovery_table(inputs.runs, inputs.probes, experiment, rows)
        if len(table):
            out.append(TableFiles(self.name, {"": table}, self.caption, RECOVERY_NOTE + _seeds_note(table), csv=table))
        grid = recovery_grid(inputs.runs, experiment, rows)
        if not len(grid):
            return out
        shown = grid.drop(columns=["run_dir", "own corpus"]).round({c: 2 for c in ("avg", "delta", "low", "high")})
        shown["lr"] = shown["lr"].map(lambda lr: "" if pd.isna(lr) else f"{lr:g}")  # 3e-4, not 0.00
        seeds = _seeds_note(grid)
        matrix = recovery_matrix(grid)
        out += [
            TableFiles(
                f"{self.name}_grid",
                {"": shown},
                f"Experiment {experiment}: the ingredient grid, each row against the original",
                GRID_NOTE + seeds,
                csv=shown,
            ),
            TableFiles(
                f"{self.name}_matrix",
                {"": matrix},
                f"Experiment {experiment}: conversion x recovery, each against the original",
                MATRIX_NOTE + seeds,
                csv=matrix,
            ),
        ]
        interactions = recovery_interactions(inputs.runs, experiment, grid, rows)
        if len(interactions):
            shown = interactions.drop(columns=["estimate", "low", "high", "resolved"])
            out.append(
                TableFiles(
                    f"{self.name}_interactions",
                    {"": shown},
                    f"Experiment {experiment}: does what an ingredient buys depend on the conversion or the budget?",
                    INTERACTIONS_NOTE + seeds,
                    csv=shown,
                )
            )
        out.append(
            PlotFiles(
                f"{self.name}_grid",
                plots.recovery_grid(
                    grid,
                    f"Experiment {experiment}: what each conversion keeps after each recovery, against the original",
                    self.goal,
                ),
                f"Experiment {experiment}: what each conversion keeps after each recovery, against the original"
                + ("" if self.goal is None else f" (goal: {self.goal:+g} points)"),
            )
        )
        return out


DTYPE_NOTE = (
    "same answers: documents whose scored choice (argmax of length-normalised log-likelihood; Winogrande: "
    "of log-likelihood) is the same in both dtypes, per task in %; Δ: the other dtype's Avg minus FP32's, "
    "paired bootstrap 95% interval."
)


@dataclass(frozen=True, kw_only=True)
class DtypeCheck(Entry):
    """The same model on the same docs evaluated in two dtypes (`comparisons.dtype_check`)."""

    caption: str
    note: str = DTYPE_NOTE

    def build(self, inputs: Inputs) -> list[Artifact]:
        check = comparisons.dtype_check(inputs.runs)
        if not len(check):
            return []
        return [
            TableFiles(self.name, {"": dtype_view(check, list(task_columns()))}, self.caption, self.note, csv=check)
        ]


@dataclass(frozen=True, kw_only=True)
class PerplexityView(Entry):
    """Every ok run's held-out perplexity and the compute behind it (`perplexity_pairs.perplexity_view`); written
    even when empty."""

    caption: str
    note: str

    def build(self, inputs: Inputs) -> list[Artifact]:
        view = perplexity_view(inputs.runs)
        return [TableFiles(self.name, {"": view}, self.caption, self.note, csv=view)]


@dataclass(frozen=True, kw_only=True)
class Plot(Entry):
    """A figure of its own (`figure`, drawn from the entry's inputs): plots/<name>.png/.pdf, or nothing when it
    has no data."""

    figure: FigureSpec

    def __post_init__(self):
        super().__post_init__()
        if self.figure.name != self.name:
            raise ValueError(f"plot entry {self.name!r} declares figure {self.figure.name!r}")

    def build(self, inputs: Inputs) -> list[Artifact]:
        return [self.figure.render(inputs)]


@dataclass(frozen=True, kw_only=True)
class RecoveryCurves(Entry):
    """Held-out perplexity and Avg against the compute spent recovering, one experiment (`plots.recovery_curves`)."""

    question: str

    def build(self, inputs: Inputs) -> list[Artifact]:
        figure = plots.recovery_curves(inputs.runs, inputs.probes, self.experiment)
        return [PlotFiles(self.name, figure, self.question)]
