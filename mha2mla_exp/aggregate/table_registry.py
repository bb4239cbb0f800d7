"""The registry of what the aggregate writes: every table and plot is one entry, found by name.

An entry declares, in one place, the experiments it reads (the `experiment` its run records name; None: every
run), how it is built (its kind: a class of `kinds`, whose `build` turns the entry's inputs into files) and its
caption. `write_aggregate` builds every registered entry in registration order; the entries themselves are
declared in `catalog`. Like the method registries (mha2mla_exp/registry.py), a name is registered once and an
unknown name is an error that lists the known ones; unlike them an entry is an instance (a kind with its
settings), so one kind serves many tables.

The pipeline hands an entry only the runs of its experiments (`Inputs`), so what an entry declares is all it can
read: a table cannot silently depend on another experiment's records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import pandas as pd
from matplotlib.figure import Figure


@dataclass(frozen=True)
class TableFiles:
    """tables/<name>.md and .tex: the `views` ({heading: frame}) one after the other under `caption` and `note`;
    tables/<name>.csv: the full frame `csv`, where there is one."""

    name: str
    views: Mapping[str, pd.DataFrame]
    caption: str = ""
    note: str = ""
    csv: pd.DataFrame | None = None


@dataclass(frozen=True)
class PlotFiles:
    """plots/<name>.png and .pdf; `question`: what the figure answers (its caption in the gallery)."""

    name: str
    figure: Figure
    question: str


@dataclass(frozen=True)
class SkippedPlot:
    """A declared figure with nothing to draw: not written (a stale copy is removed), `reason` says why."""

    name: str
    reason: str


Artifact = TableFiles | PlotFiles | SkippedPlot


class NoData(Exception):
    """Raised by a figure's drawing function when it has nothing to draw; the message says why."""


@dataclass(frozen=True)
class FigureSpec:
    """A figure declared beside its table: the stem of its files, the question it answers, and how it is drawn
    (`draw`, from the entry's inputs, returns the Figure or raises `NoData`)."""

    name: str
    question: str
    draw: Callable[..., Figure]

    def render(self, *args) -> PlotFiles | SkippedPlot:
        try:
            return PlotFiles(self.name, self.draw(*args), self.question)
        except NoData as why:
            return SkippedPlot(self.name, str(why))


@dataclass(frozen=True)
class Inputs:
    """What an entry reads: the canonical runs of its experiments (every run when it names none), their training
    curves and in-training probes, and the paper's tables (`Aggregate.tables`) as built from the same runs."""

    runs: pd.DataFrame
    curves: pd.DataFrame
    probes: pd.DataFrame
    tables: Mapping[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def n_ok(self) -> int:
        return int((self.runs["status"] == "ok").sum()) if len(self.runs) else 0


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One registered output. `name` is the stem of its files (some kinds write a few, all starting with it);
    `experiments` the recorded experiment names it reads (None: every run)."""

    name: str
    experiments: tuple[str, ...] | None = None

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"a table entry needs a file name, got {self.name!r}")
        if isinstance(self.experiments, str):  # ("a") is a string, not a one-element tuple
            raise TypeError(f"{self.name}: experiments must be a tuple of names, got {self.experiments!r}")

    @property
    def experiment(self) -> str:
        """The one experiment of a kind that reads exactly one."""
        if self.experiments is None or len(self.experiments) != 1:
            raise ValueError(f"{type(self).__name__} {self.name!r} reads one experiment, got {self.experiments!r}")
        return self.experiments[0]

    def build(self, inputs: Inputs) -> list[Artifact]:
        raise NotImplementedError


class TableRegistry:
    """The entries by name, in the order they were registered (the order they are written)."""

    def __init__(self):
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> Entry:
        if not isinstance(entry, Entry):
            raise TypeError(f"not a table entry: {entry!r}")
        if entry.name in self._entries:
            raise ValueError(f"table {entry.name!r} is registered twice")
        self._entries[entry.name] = entry
        return entry

    def remove(self, name: str) -> Entry:
        """Unregister `name` (a test's throwaway entry)."""
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown table {name!r}; expected one of {', '.join(map(repr, self._entries))}")
        return entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(tuple(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)


TABLES = TableRegistry()


def register(entry: Entry) -> Entry:
    """Add `entry` to the aggregate's tables (`TABLES`)."""
    return TABLES.add(entry)
