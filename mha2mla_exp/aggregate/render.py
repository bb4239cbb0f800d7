"""Tables on disk: the full frame as CSV; for a reader, a compact main view and a per-task view, as
Markdown and LaTeX. Empty cells are written empty, never as "nan"."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..schema.commonsense_suite import column_labels
from .files import write_text
from .records import recipe_label

CI_NAMES = {"paired bootstrap": "paired", "unpaired binomial": "unpaired"}


def column_label(column: str) -> str:
    """A score column's heading: the commonsense suite's label, else its name."""
    return column_labels().get(column, column)


def _missing(value) -> bool:
    return value is None or (not isinstance(value, (str, dict, list)) and pd.isna(value))


def _num(value, digits: int = 1) -> str:
    return "" if _missing(value) else f"{float(value):.{digits}f}".replace("-", "−")


def _interval(estimate, low, high) -> str:
    if _missing(estimate):
        return ""
    if _missing(low):
        return _num(estimate)
    return f"{_num(estimate)} [{_num(low)}, {_num(high)}]"


def _delta(row, column: str) -> str:
    """A row's `column`_delta with its interval."""
    return _interval(row.get(f"{column}_delta"), row.get(f"{column}_delta_low"), row.get(f"{column}_delta_high"))


def _tokens(value) -> str:
    return "" if _missing(value) else f"{int(value):,}"


def row_label(row) -> str:
    """A row's configuration in words: "FT full attention", "2-norm r=4, joint SVD d_kv=16 (init=activation)"."""
    method = row.get("method")
    if method == "original":
        text = "original"
    elif method == "finetuned_full_attention":
        text = "FT full attention"
    elif method == "partial_rope":
        text = "NoPE (r=0)" if row.get("rope") == "none" else f"{row.get('rope')} r={_int(row.get('r'))}"
    elif not _missing(row.get("kv_elements")):  # a KV budget split per layer: r and d_kv are the split's
        dims = row.get("rope_dims") if isinstance(row.get("rope_dims"), str) else "?"
        text = f"{row.get('rope')} + {row.get('svd')} SVD, {_int(row['kv_elements'])} KV elements (rope dims {dims})"
    else:
        text = f"{row.get('rope')} r={_int(row.get('r'))}, {row.get('svd')} SVD d_kv={_int(row.get('d_kv'))}"
    if isinstance(row.get("options"), str):
        text += f" ({row['options']})"
    if not _missing(row.get("distill_token_passes")):
        text += " + layer-wise distillation"
    if recipe_label(row):
        text += f" [{recipe_label(row)}]"
    return text


def strategy_name(row) -> str:
    """A row's partial-RoPE strategy as Table 3 names it: "high", "NoPE", "2-norm+SVD joint", "FT full attention"."""
    if row.get("method") == "finetuned_full_attention":
        return "FT full attention"
    if row.get("method") == "partial_rope":
        return "NoPE" if row.get("rope") == "none" else str(row.get("rope"))
    return f"{row.get('rope')}+SVD {row.get('svd')}"


def _int(value) -> str:
    return "?" if _missing(value) else str(int(value))


def eval_docs_label(row) -> str:
    """The docs a row was scored on and the dtype they ran in: "50/task, MMLU 57 · FP32"."""
    docs = row.get("eval_docs")
    if not isinstance(docs, dict) or not docs:
        return ""
    if "mmlu" in docs or "piqa" in docs:
        per_task = max(v for k, v in docs.items() if k != "mmlu") if len(docs) > 1 else None
        text = ", ".join(
            p for p in (f"{per_task}/task" if per_task else "", f"MMLU {docs['mmlu']}" if "mmlu" in docs else "") if p
        )
    else:
        text = f"{max(docs.values())}/length"
    return f"{text} · {row['eval_dtype']}" if isinstance(row.get("eval_dtype"), str) else text


def _seeds(row) -> str:
    n = row.get("n_seeds")
    if _missing(n) or not n:
        return ""
    sd = row.get("avg_seed_sd")
    return f"{int(n)}" + ("" if _missing(sd) else f" (sd {_num(sd)})")


def _avg(row) -> str:
    if _missing(row.get("avg")):
        return ""
    low, high = row.get("avg_low"), row.get("avg_high")
    return _num(row["avg"]) if _missing(low) else f"{_num(row['avg'])} ± {_num((high - low) / 2)}"


def _kv_cache(row) -> str:
    quant = row.get("kv_quant")
    dtype = "" if _missing(row.get("kv_dtype")) else row["kv_dtype"]
    if quant in (None, "unquantized"):
        return dtype
    groups = f"{row['kv_grouping']} groups" if isinstance(row.get("kv_grouping"), str) else ""
    details = [d for d in (dtype, groups) if d]
    return f"{quant} ({'; '.join(details)})" if details else quant


def main_view(table: pd.DataFrame, by_precision: bool = False, with_kv_memory: bool = False) -> pd.DataFrame:
    """Avg, delta vs baseline with its 95% interval, budget, docs, seeds, the paper's Avg and delta beside."""
    models = table["ours_model"].dropna().unique()
    rows = table if not len(models) else table[table["model"].isin(table.loc[table["ours_model"].notna(), "model"])]
    out = []
    for row in rows.to_dict("records"):
        line = {}
        if rows["model"].nunique() > 1:
            line["model"] = row.get("model") or ""
        line["row"] = row_label(row)
        if by_precision:
            line["KV cache"] = _kv_cache(row)
            line["KV B/token"] = "" if _missing(row.get("kv_bytes_per_token")) else f"{row['kv_bytes_per_token']:,.0f}"
        line["tokens"] = _tokens(row.get("train_tokens")) if row.get("n_seeds") else ""
        line["eval docs"] = eval_docs_label(row)
        line["seeds"] = _seeds(row)
        if with_kv_memory:
            line["KV mem %"] = _num(row.get("kv_mem_change_pct"), 2)
        line["Avg ±95%"] = _avg(row)
        line["Δ [95% CI]"] = _interval(row.get("avg_delta"), row.get("avg_delta_low"), row.get("avg_delta_high"))
        line["vs"] = row.get("vs") or ""
        line["CI"] = CI_NAMES.get(row.get("ci"), "")
        line["verdict"] = row.get("verdict") if row.get("n_seeds") else ""
        if "longbench_avg" in table and table["longbench_avg"].notna().any():
            line["LongBench Avg"] = _num(row.get("longbench_avg"))
        line["paper Avg"] = _num(row.get("avg_paper"), 2)
        line["paper Δ"] = _num(row.get("avg_delta_paper"), 2)
        if with_kv_memory:
            line["paper KV mem %"] = _num(row.get("kv_mem_change_pct_paper"), 2)
        out.append({k: ("" if _missing(v) else v) for k, v in line.items()})
    return pd.DataFrame(out)


def task_views(table: pd.DataFrame, tasks: list[str], paper_tasks: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per task: (ours / paper scores, our deltas with their 95% intervals), rows of ours only."""
    ours = table[table["n_seeds"].fillna(0) > 0]
    scores, deltas = [], []
    for row in ours.to_dict("records"):
        head = {"row": row_label(row), "tokens": _tokens(row.get("train_tokens")), "eval docs": eval_docs_label(row)}
        if isinstance(row.get("kv_quant"), str) and row["kv_quant"] != "unquantized":
            head["row"] += f", {_kv_cache(row)}"
        score, delta = dict(head), dict(head)
        for task in tasks:
            name = column_label(task)
            paper = row.get(f"{task}_paper") if paper_tasks else None
            score[name] = _num(row.get(task)) + ("" if _missing(paper) else f" / {_num(paper, 2)}")
            delta[name] = _delta(row, task)
        delta["vs"] = row.get("vs") or ""
        scores.append(score)
        deltas.append(delta)
    return pd.DataFrame(scores), pd.DataFrame(deltas)


def display_frame(table: pd.DataFrame) -> pd.DataFrame:
    """Every cell as text: floats with two decimals, missing values as ''."""

    def cell(value):
        if _missing(value):
            return ""
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    return pd.DataFrame({column: [cell(v) for v in table[column]] for column in table.columns}, columns=table.columns)


def to_markdown(table: pd.DataFrame) -> str:
    text = display_frame(table)
    if not len(text.columns):
        return "(no rows)"
    return text.to_markdown(index=False, disable_numparse=True)


def to_latex(table: pd.DataFrame) -> str:
    text = display_frame(table)
    if not len(text.columns):
        return "% no rows\n"
    text = text.apply(lambda column: column.str.replace("−", "-", regex=False))
    return text.to_latex(index=False, escape=True)


def views_text(views: dict[str, pd.DataFrame], title: str = "", note: str = "") -> tuple[str, str]:
    """(Markdown, LaTeX) of `views` ({heading: frame}) one after the other, Markdown under `title` and `note`."""
    header = [f"# {title}" if title else "", note]
    body = [(f"## {heading}\n\n" if heading else "") + to_markdown(view) for heading, view in views.items()]
    markdown = "\n\n".join(part for part in header + body if part) + "\n"
    latex = "\n".join((f"% {heading}\n" if heading else "") + to_latex(view) for heading, view in views.items())
    return markdown, latex


def write_csv(table: pd.DataFrame, path: Path) -> Path:
    """The full frame as CSV (no index)."""
    return write_text(path, table.to_csv(index=False))


def perplexity_pairs_view(pairs: pd.DataFrame) -> pd.DataFrame:
    """`perplexity_pairs` as written: ratios to 4 digits, each seed's ratio to 3 (the plots' question left out)."""
    pairs = pairs.drop(columns=["question"], errors="ignore")
    per_seed = pairs["B/A per seed"].map(lambda ratios: ", ".join(f"{x:.3f}" for x in ratios))
    return pairs.round(4).assign(**{"B/A per seed": per_seed})


def pairwise_views(pairs: pd.DataFrame, tasks: list[str]) -> dict[str, pd.DataFrame]:
    """The headline comparison: each pair's Avg difference with its interval, then per task."""
    main, per_task = [], []
    for row in pairs.to_dict("records"):
        head = {"B": row["B"], "A": row["A"], "eval docs": row["eval docs"]}
        main.append(
            head
            | {
                "Avg B": _avg(row),
                "Avg A": _num(row["A avg"]),
                "Δ B − A [95% CI]": _delta(row, "avg"),
                "CI": CI_NAMES.get(row.get("ci"), ""),
                "verdict": row.get("verdict") or "",
            }
        )
        per_task.append({"B": row["B"], "A": row["A"]} | {column_label(t): _delta(row, t) for t in tasks})
    return {"Avg": pd.DataFrame(main), "Δ B − A per task [95% CI]": pd.DataFrame(per_task)}


def dtype_view(check: pd.DataFrame, tasks: list[str]) -> pd.DataFrame:
    """Per model: the share of documents whose scored answer is the same in both dtypes, and the scores."""
    out = []
    for row in check.to_dict("records"):
        line = {
            "model": row["model"],
            "eval docs": row["eval docs"],
            "dtype vs FP32": row["dtype"],
            "same answers": f"{row['same answers']:,}/{row['docs']:,} ({_num(row['same answers %'], 2)} %)",
        }
        line |= {column_label(t): _num(row.get(f"{t} same %")) for t in tasks if f"{t} same %" in row}
        line |= {
            "Avg FP32": _num(row["avg FP32"]),
            "Avg": _num(row["avg"]),
            "Δ [95% CI]": _interval(row["avg_delta"], row["avg_delta_low"], row["avg_delta_high"]),
        }
        out.append(line)
    return pd.DataFrame(out)
