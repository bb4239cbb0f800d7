"""From run directories (and optionally a W&B project) to the registered tables, plots and runs.csv on disk.

`build_aggregate` reads the records once; `write_aggregate` builds every entry of the table registry
(`table_registry.TABLES`, declared in `catalog`) from the runs of its experiments and writes its files, leaving
a file whose bytes are unchanged untouched.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import catalog  # noqa: F401  (registers the tables)
from .files import write_text
from .kinds import PaperTable
from .plots import SAVE_METADATA, save_figure
from .records import canonical_runs, load_runs, results_root, training_curves, variant_label
from .render import views_text, write_csv
from .table_registry import TABLES, Artifact, Entry, Inputs, PlotFiles, SkippedPlot, TableFiles


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

    def figures(self) -> dict[str, PlotFiles]:
        """Every registered entry's figures with data, by name (this builds every entry)."""
        return {
            artifact.name: artifact
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


class Written(list):
    """The paths written or found up to date; `figures`: {name: question} of the figures written, `skipped`:
    {name: why} of those with nothing to draw (their stale files removed)."""

    def __init__(self):
        super().__init__()
        self.figures: dict[str, str] = {}
        self.skipped: dict[str, str] = {}


def write_artifact(artifact: Artifact, out_dir: Path) -> list[Path]:
    """A table's files under out_dir/tables, a plot's under out_dir/plots; a skipped plot's old files removed."""
    if isinstance(artifact, SkippedPlot):
        for fmt in SAVE_METADATA:
            (out_dir / "plots" / f"{artifact.name}.{fmt}").unlink(missing_ok=True)
        return []
    if isinstance(artifact, PlotFiles):
        return save_figure(artifact.figure, out_dir / "plots", artifact.name)
    tables = out_dir / "tables"
    markdown, latex = views_text(dict(artifact.views), artifact.caption, artifact.note)
    written = [] if artifact.csv is None else [write_csv(artifact.csv, tables / f"{artifact.name}.csv")]
    return written + [
        write_text(tables / f"{artifact.name}.md", markdown),
        write_text(tables / f"{artifact.name}.tex", latex),
    ]


def write_aggregate(aggregate: Aggregate, out_dir: str | Path, entries: Iterable[Entry] | None = None) -> Written:
    """Every registered entry's files (tables/<name>.{csv,md,tex}, plots/<name>.{png,pdf}) and runs.csv under
    `out_dir`; the paths written or found already up to date, with the figures drawn and skipped. `entries`: only
    these (default: the registry)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = Written()
    owner: dict[tuple[str, str], str] = {}  # (tables | plots, file name) -> the entry that wrote it
    for entry in TABLES if entries is None else entries:
        for artifact in entry.build(aggregate.inputs(entry)):
            key = ("tables" if isinstance(artifact, TableFiles) else "plots", artifact.name)
            if key in owner:  # two entries (or one, twice) would overwrite each other's files
                raise ValueError(f"{key[0]}/{artifact.name} is written by both {owner[key]!r} and {entry.name!r}")
            owner[key] = entry.name
            written += write_artifact(artifact, out_dir)
            if isinstance(artifact, PlotFiles):
                written.figures[artifact.name] = artifact.question
            elif isinstance(artifact, SkippedPlot):
                written.skipped[artifact.name] = artifact.reason
    # every run, also those left out of the tables (status != ok), so failures stay visible
    runs = aggregate.runs.assign(in_tables=aggregate.runs["status"] == "ok")
    written.append(write_csv(runs, out_dir / "runs.csv"))
    return written


REBUILD = "python -m mha2mla_exp.aggregate results/runs --gallery docs/FIGURES.md"


def gallery_markdown(written: Written, plots_dir: Path, gallery: Path) -> str:
    """docs/FIGURES.md: every figure written with its question and the command that rebuilds it, then the
    declared figures that had no data and why."""
    link = Path(os.path.relpath(plots_dir, gallery.parent)).as_posix()
    lines = [
        "# Figures",
        "",
        "Every figure the aggregate draws from the committed run records (results/runs), with the question it "
        f"answers. Rebuild them all (and this page) with `{REBUILD}`; each is declared, with its question, in "
        "`mha2mla_exp/aggregate/catalog.py`. Never edited by hand.",
        "",
    ]
    for name, question in written.figures.items():
        image, pdf = f"![{name}]({link}/{name}.png)", f"PDF: [{name}.pdf]({link}/{name}.pdf)"
        lines += [f"## {name}", "", question, "", image, "", pdf, ""]
    if written.skipped:
        lines += ["## Not drawn: no data", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in written.skipped.items()]
        lines.append("")
    return "\n".join(lines)


def write_gallery(written: Written, plots_dir: Path, gallery: str | Path) -> Path:
    gallery = Path(gallery)
    return write_text(gallery, gallery_markdown(written, Path(plots_dir), gallery))


__all__ = [
    "Aggregate",
    "build_aggregate",
    "write_aggregate",
    "write_artifact",
    "write_gallery",
    "Written",
    "entry_inputs",
    "results_root",
    "TableFiles",
    "PlotFiles",
]
