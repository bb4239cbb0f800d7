"""From run directories (and optionally a W&B project) to the registered tables, plots and runs.csv on disk.

`build_aggregate` reads the records once; `write_aggregate` builds every entry of the table registry
(`table_registry.TABLES`, declared in `catalog`) from the runs of its experiments and writes its files, leaving
a file whose bytes are unchanged untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from . import catalog  # noqa: F401  (registers the tables)
from .files import write_text
from .kinds import PaperTable
from .plots import save_figure
from .records import canonical_runs, load_runs, results_root, training_curves, variant_label
from .render import views_text, write_csv
from .table_registry import TABLES, Artifact, Entry, Inputs, PlotFiles, TableFiles


@dataclass
class Aggregate:
    records: pd.DataFrame  # one row per run, every results.json/config.yaml field flattened
    runs: pd.DataFrame  # one row per run, in the tables' terms (scores in points)
    tables: dict[str, pd.DataFrame]  # the paper tables ("table1", ...): every `PaperTable` entry's frame
    curves: pd.DataFrame  # training loss per logged step, per run
    probes: pd.DataFrame  # in-training held-out perplexity probes (train.eval_every), per run

    @property
    def n_ok(self) -> int:
        return int((self.runs["status"] == "ok").sum()) if len(self.runs) else 0

    def inputs(self, entry: Entry) -> Inputs:
        """What `entry` reads: the runs of its experiments, their curves and probes (all of them for None)."""
        return entry_inputs(entry, self.runs, self.curves, self.probes, self.tables)

    def figures(self) -> dict[str, Figure]:
        """Every registered entry's plots, by name (this builds every entry)."""
        return {
            artifact.name: artifact.figure
            for entry in TABLES
            for artifact in entry.build(self.inputs(entry))
            if isinstance(artifact, PlotFiles)
        }


def entry_inputs(
    entry: Entry,
    runs: pd.DataFrame,
    curves: pd.DataFrame,
    probes: pd.DataFrame,
    tables: dict[str, pd.DataFrame] | None = None,
) -> Inputs:
    if entry.experiments is None:
        return Inputs(runs, curves, probes, tables or {})
    runs = runs[runs["experiment"].isin(list(entry.experiments))] if len(runs) else runs
    run_dirs = set(runs["run_dir"]) if len(runs) else set()
    curves, probes = (frame[frame["run_dir"].isin(run_dirs)] if len(frame) else frame for frame in (curves, probes))
    return Inputs(runs, curves, probes, tables or {})


def build_aggregate(
    run_dirs: Iterable[str | Path] | None = None, wandb_project: str | None = None, wandb_api=None
) -> Aggregate:
    """Read every run record under `run_dirs` (default: <results root>/runs), plus a W&B project's runs
    when given, and build the paper tables. With no runs the tables hold the paper's numbers only."""
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
    curves, probes = training_curves(runs), training_curves(runs, "heldout_ppl_probe")
    tables = {
        entry.name: entry.table(entry_inputs(entry, runs, curves, probes).runs)
        for entry in TABLES
        if isinstance(entry, PaperTable)
    }
    return Aggregate(records=records, runs=runs, tables=tables, curves=curves, probes=probes)


def write_artifact(artifact: Artifact, out_dir: Path) -> list[Path]:
    """A table's files under out_dir/tables, a plot's under out_dir/plots."""
    if isinstance(artifact, PlotFiles):
        return save_figure(artifact.figure, out_dir / "plots", artifact.name)
    tables = out_dir / "tables"
    markdown, latex = views_text(dict(artifact.views), artifact.caption, artifact.note)
    written = [] if artifact.csv is None else [write_csv(artifact.csv, tables / f"{artifact.name}.csv")]
    return written + [
        write_text(tables / f"{artifact.name}.md", markdown),
        write_text(tables / f"{artifact.name}.tex", latex),
    ]


def write_aggregate(aggregate: Aggregate, out_dir: str | Path, entries: Iterable[Entry] | None = None) -> list[Path]:
    """Every registered entry's files (tables/<name>.{csv,md,tex}, plots/<name>.{png,pdf}) and runs.csv under
    `out_dir`; the paths written or found already up to date. `entries`: only these (default: the registry)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    owner: dict[tuple[str, str], str] = {}  # (tables | plots, file name) -> the entry that wrote it
    for entry in TABLES if entries is None else entries:
        for artifact in entry.build(aggregate.inputs(entry)):
            key = ("plots" if isinstance(artifact, PlotFiles) else "tables", artifact.name)
            if key in owner:  # two entries (or one, twice) would overwrite each other's files
                raise ValueError(f"{key[0]}/{artifact.name} is written by both {owner[key]!r} and {entry.name!r}")
            owner[key] = entry.name
            written += write_artifact(artifact, out_dir)
    # every run, also those left out of the tables (status != ok), so failures stay visible
    runs = aggregate.runs.assign(in_tables=aggregate.runs["status"] == "ok")
    return written + [write_csv(runs, out_dir / "runs.csv")]


__all__ = [
    "Aggregate",
    "build_aggregate",
    "write_aggregate",
    "write_artifact",
    "entry_inputs",
    "results_root",
    "TableFiles",
    "PlotFiles",
]
