"""The paper's Tables 1, 2, 3 and 5, with our runs beside its numbers.

Every table is built the same way: pick the rows that belong to it (ours and the paper's), average our runs
of one configuration (`n_runs` says how many), join both on the configuration, and add the deltas the paper
prints: Avg minus the same model's baseline row (the fine-tuned full-attention model; for Table 2 the
unquantized original, the only baseline that table has). Cells without a number stay empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .records import COMMONSENSE, CONFIG_KEYS, LONGBENCH, METHODS, PAPER_HEAD_DIM
from .reference import paper_commonsense, paper_longbench

UNCONVERTED = ("original", "finetuned_full_attention")


@dataclass(frozen=True)
class TableSpec:
    name: str
    title: str
    id_columns: tuple[str, ...]
    metrics: dict[str, str]            # canonical column -> column stem in the table
    select: Callable[[pd.DataFrame], pd.Series]
    baseline_method: str
    with_kv_memory: bool = False
    ours_extras: dict[str, str] = field(default_factory=dict)   # canonical column -> table column (ours only)
    note: str = ""


def _head_dim(frame: pd.DataFrame) -> pd.Series:
    known = frame["model"].map(PAPER_HEAD_DIM)
    if "head_dim" in frame:
        known = frame["head_dim"].astype("Float64").fillna(known.astype("Float64"))
    return known.astype("Float64")


def _equals_or_unknown(values: pd.Series, expected: pd.Series) -> pd.Series:
    """values == expected, and True where expected is unknown (a model whose head dim nobody recorded)."""
    return (expected.isna() | (values.astype("Float64") == expected)).fillna(False).astype(bool)


def _default_r(frame):
    return _equals_or_unknown(frame["r"], _head_dim(frame) / 16)   # paper default r = d_h/16


def _unquantized(frame):
    return frame["precision"] == "BF16"


def _select_table1(frame):
    mla = (frame["method"] == "partial_rope+svd") & (frame["rope"] == "2-norm") & (frame["svd"] == "joint")
    return _unquantized(frame) & (frame["method"].isin(UNCONVERTED) | (mla & _default_r(frame)))


def _select_table2(frame):
    mla = (frame["method"] == "partial_rope+svd") & (frame["rope"] == "2-norm") & (frame["svd"] == "joint")
    return frame["method"].isin(UNCONVERTED) | (mla & _default_r(frame))


def _select_table3(frame):
    # Table 3 fixes r = d_h/16 and, for the SVD rows, d_kv = d_h/4 (16 for SmolLM)
    partial = (frame["method"] == "partial_rope") & _default_r(frame)
    low_rank = ((frame["method"] == "partial_rope+svd") & _default_r(frame)
                & _equals_or_unknown(frame["d_kv"], _head_dim(frame) / 4))
    return _unquantized(frame) & (frame["method"].isin(UNCONVERTED) | partial | low_rank)


def _select_table5(frame):
    return _unquantized(frame) & frame["method"].isin(("finetuned_full_attention", "partial_rope"))


_COMMONSENSE_METRICS = {"avg": "avg", **{task: task for task in COMMONSENSE}}
_ID = ("model", "ours_model", "method", "rope", "r", "svd", "d_kv", "options")

TABLES = {
    "table1": TableSpec(
        "table1", "Table 1: commonsense reasoning, original / full-attention FT / MLA at three d_kv",
        _ID, _COMMONSENSE_METRICS, _select_table1, "finetuned_full_attention", with_kv_memory=True,
        ours_extras={"train_tokens": "train_tokens_ours", "eval_limit": "eval_limit_ours"},
        note="MLA rows: 2-norm partial RoPE, r = d_h/16, joint SVD. avg_delta = Avg minus the same model's "
             "fine-tuned full-attention row."),
    "table2": TableSpec(
        "table2", "Table 2: LongBench by KV-cache precision and d_kv",
        ("model", "ours_model", "context", "method", "rope", "r", "svd", "d_kv", "options", "precision"),
        {"longbench.avg": "avg", **{f"longbench.{task}": task for task in LONGBENCH}},
        _select_table2, "original", with_kv_memory=True,
        ours_extras={"long_context.avg": "long_context_avg_ours"},
        note="precision BF16 = KV cache not quantized. avg_delta = Avg minus the same model's unquantized "
             "original row. long_context_avg_ours is our own long-context probe (no paper counterpart)."),
    "table3": TableSpec(
        "table3", "Table 3: partial-RoPE strategies, without and with SVD (joint vs split)",
        _ID, _COMMONSENSE_METRICS, _select_table3, "finetuned_full_attention",
        note="r = d_h/16; SVD rows at d_kv = d_h/4. avg_delta = Avg minus the same model's fine-tuned "
             "full-attention row."),
    "table5": TableSpec(
        "table5", "Table 5: partial-RoPE strategies by r",
        ("model", "ours_model", "method", "rope", "r", "options"), _COMMONSENSE_METRICS, _select_table5,
        "finetuned_full_attention",
        note="No SVD. The full row (r = d_h/2) is the fine-tuned full-attention model. avg_delta = Avg minus it."),
}


def _key(frame: pd.DataFrame) -> pd.Series:
    """The configuration a row stands for, as text; the unconverted model has no RoPE/SVD settings."""
    def one(row):
        if row["method"] in UNCONVERTED:
            parts = (row["model"], row["method"], row["precision"])
        else:
            parts = (row["model"], row["method"], row["rope"], row["r"], row["svd"], row["d_kv"], row["precision"])
        return "|".join("" if pd.isna(p) else str(p) for p in parts)
    return frame.apply(one, axis=1) if len(frame) else pd.Series([], dtype=object)


def _average_ours(ours: pd.DataFrame, spec: TableSpec) -> pd.DataFrame:
    """One row per configuration: the mean of its runs' numbers and how many runs there were."""
    value_columns = list(spec.metrics) + list(spec.ours_extras) + ["kv_mem_change_pct"]
    value_columns = [c for c in dict.fromkeys(value_columns) if c not in CONFIG_KEYS]
    keys = list(CONFIG_KEYS)
    if ours.empty:
        return pd.DataFrame(columns=keys + value_columns + ["head_dim", "n_runs"])
    numbers = ours[value_columns].apply(pd.to_numeric, errors="coerce").astype(float)
    frame = pd.concat([ours[keys + ["head_dim"]], numbers], axis=1)
    grouped = frame.groupby(keys, dropna=False, sort=False)
    averaged = grouped[value_columns].mean()
    averaged["head_dim"] = grouped["head_dim"].first()
    averaged["n_runs"] = grouped.size()
    return averaged.reset_index()


def build_table(spec: TableSpec, runs: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """One table from the canonical runs (`records.canonical_runs`) and the paper's rows for it."""
    ours = runs[(runs["status"] == "ok")] if len(runs) else runs
    if len(ours) and "distill_token_passes" in ours:
        # the paper's tables hold the paper's recipe; distilled runs are in the perplexity view and recovery plot
        ours = ours[ours["distill_token_passes"].isna()]
    if len(ours):
        ours = ours[spec.select(ours)]
        measured = [c for c in list(spec.metrics) + list(spec.ours_extras) if c in ours]
        ours = ours[ours[measured].notna().any(axis=1)] if measured else ours.iloc[0:0]
    ours = _average_ours(ours, spec)
    paper = paper[spec.select(paper)] if len(paper) else paper

    stems = dict(spec.metrics)
    if spec.with_kv_memory:
        stems = {"kv_mem_change_pct": "kv_mem_change_pct", **stems}
    ours = ours.rename(columns={c: f"{s}_ours" for c, s in stems.items()} | spec.ours_extras)
    paper = paper.rename(columns={c: f"{s}_paper" for c, s in stems.items()})
    ours["_key"], paper["_key"] = _key(ours), _key(paper)

    id_columns = [c for c in spec.id_columns if c not in ("ours_model", "options")]
    paper_side = paper[["_key", "paper_order"] + [c for c in id_columns if c in paper]
                       + [f"{s}_paper" for s in stems.values()]]
    ours_side = ours[["_key", "ours_model", "options", "n_runs"] + [c for c in id_columns if c in ours]
                     + list(spec.ours_extras.values()) + [f"{s}_ours" for s in stems.values()]]
    table = paper_side.merge(ours_side, on="_key", how="outer", suffixes=("", "_from_ours"), sort=False)
    for column in id_columns:
        if f"{column}_from_ours" in table:
            table[column] = table[column].combine_first(table.pop(f"{column}_from_ours"))
    table["n_runs"] = table["n_runs"].fillna(0).astype(int)

    table["avg_delta_ours"] = _deltas(table, "avg_ours", spec.baseline_method, ["model", "ours_model"])
    table["avg_delta_paper"] = _deltas(table, "avg_paper", spec.baseline_method, ["model"])

    table = _sorted(table)
    metric_columns = []
    for stem in stems.values():
        metric_columns += [f"{stem}_ours", f"{stem}_paper"]
        if stem == "avg":
            metric_columns += ["avg_delta_ours", "avg_delta_paper"]
    columns = list(spec.id_columns) + ["n_runs"] + list(spec.ours_extras.values()) + metric_columns
    table = table[columns].reset_index(drop=True)
    table[metric_columns] = table[metric_columns].astype(float).round(2)   # the paper's precision
    for column in spec.ours_extras.values():   # token counts and eval limits are counts: keep them integers
        values = pd.to_numeric(table[column], errors="coerce").astype(float)
        if (values.dropna() % 1 == 0).all():
            table[column] = pd.array(values.round(), dtype="Int64")
        else:
            table[column] = values.round(2)
    return table


def _deltas(table: pd.DataFrame, column: str, baseline_method: str, group: list[str]) -> pd.Series:
    """Avg minus the group's baseline Avg; empty on the baseline itself and where the baseline is
    missing or ambiguous (two different baseline values), so no delta is ever guessed."""
    is_base = (table["method"] == baseline_method) & (table["precision"] == "BF16" if "precision" in table
                                                      else True)
    deltas = pd.Series(np.nan, index=table.index)
    group_key = table[group].astype(object).fillna("").astype(str).agg("|".join, axis=1)
    for members in table.groupby(group_key, sort=False).groups.values():
        in_group = table.loc[members]
        base_values = in_group.loc[is_base.loc[members] & in_group[column].notna(), column].unique()
        if len(base_values) != 1:
            continue
        rows = [i for i in members if not is_base.loc[i]]
        deltas.loc[rows] = table.loc[rows, column] - base_values[0]
    return deltas


def _text(column: pd.Series) -> pd.Series:
    """Sortable text, '' for missing (a column can be all-missing floats when no run filled it)."""
    return column.astype(object).where(column.notna(), "").astype(str)


def _sorted(table: pd.DataFrame) -> pd.DataFrame:
    """The paper's row order; our rows without a paper counterpart after their model's paper rows."""
    model_rank = table.groupby("model", dropna=False, sort=False)["paper_order"].transform("min")
    method_rank = table["method"].map({m: i for i, m in enumerate(METHODS)}).fillna(len(METHODS))
    order = pd.DataFrame({
        "model_rank": model_rank.fillna(np.inf),
        "model": _text(table["model"]),
        "paper_order": table["paper_order"].fillna(np.inf),
        "method_rank": method_rank,
        "rope": _text(table["rope"]) if "rope" in table else "",
        "r": table["r"].astype("Float64").fillna(-1) if "r" in table else 0,
        "svd": _text(table["svd"]) if "svd" in table else "",
        "d_kv": -table["d_kv"].astype("Float64").fillna(0) if "d_kv" in table else 0,
        "precision": _text(table["precision"]) if "precision" in table else "",
        "ours_model": _text(table["ours_model"]),
        "options": _text(table["options"]),
    })
    return table.loc[order.sort_values(list(order.columns), kind="stable").index]


def build_tables(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """All four tables from the canonical runs; with no runs they hold the paper's numbers only."""
    commonsense, longbench = paper_commonsense(), paper_longbench()
    paper_rows = {
        "table1": commonsense[commonsense["table"] == 1],
        "table2": longbench,
        "table3": commonsense[commonsense["table"] == 3],
        "table5": commonsense[commonsense["table"] == 5],
    }
    return {name: build_table(spec, runs, paper_rows[name].copy()) for name, spec in TABLES.items()}
