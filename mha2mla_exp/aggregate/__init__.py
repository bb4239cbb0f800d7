"""Run records -> the paper's tables (1, 2, 3, 5), the studies' tables and the plots, our numbers beside the paper's.

    from mha2mla_exp.aggregate import build_aggregate, write_aggregate
    agg = build_aggregate(["results/runs"])      # agg.tables["table1"], agg.runs, agg.figures() (name: PlotFiles)
    write_aggregate(agg, "results/aggregate")

CLI: `python -m mha2mla_exp.aggregate [RUN_DIRS...] [--out DIR] [--wandb-project ENTITY/PROJECT] [--gallery MD]`.

What is written is the table registry (`TABLES`): each table or plot is one entry in `catalog.py` naming its
experiments, its kind (`kinds.py`: the builder) and its caption. How to add one: results/aggregate/README.md.
"""

from .pipeline import Aggregate, build_aggregate, results_root, write_aggregate
from .plots import (
    kv_memory_vs_avg,
    long_context_vs_length,
    loss_curves,
    recovery_curves,
    save_figure,
    strategy_comparison,
)
from .records import canonical_runs, load_runs, training_curves
from .table_registry import TABLES, Entry, Inputs, PlotFiles, TableFiles, register

__all__ = [
    "Aggregate",
    "build_aggregate",
    "write_aggregate",
    "results_root",
    "TABLES",
    "register",
    "Entry",
    "Inputs",
    "TableFiles",
    "PlotFiles",
    "load_runs",
    "canonical_runs",
    "training_curves",
    "kv_memory_vs_avg",
    "strategy_comparison",
    "loss_curves",
    "long_context_vs_length",
    "recovery_curves",
    "save_figure",
]
