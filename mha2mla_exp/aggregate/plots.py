"""The paper's comparisons as matplotlib figures. Each function returns its Figure (no pyplot state), so callers
can test the axes and series or save them with `save_figure`, or raises `NoData` (the figure is then not
written). Colours come from `palette`: one per method in every figure."""

from __future__ import annotations

import io
import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FormatStrFormatter, NullFormatter

from .files import write_bytes
from .palette import PAPER, PAPER_FILL, method_color, method_of_row, shades
from .perplexity_pairs import strategy_perplexities
from .records import recipe_label, recovery_recipe, variant_label
from .render import column_label, eval_docs_label, row_label, strategy_name
from .table_registry import NoData

AVG_LABEL = "Avg commonsense score (points)"
_LONG_CONTEXT_KEY = re.compile(r"^long_context\.(?P<task>.+)@(?P<length>\d+)$")


# no creation date in a PDF (the only thing that changed between two renderings of the same figure)
SAVE_METADATA = {"png": {}, "pdf": {"CreationDate": None}}


def figure_bytes(figure: Figure, fmt: str) -> bytes:
    """The figure as `fmt` (png | pdf) bytes, the same bytes for the same figure: 150 dpi, tight bounding box."""
    if figure.get_layout_engine() is not None:
        # constrained layout moves the axes again on every draw: place them once, then keep them there
        figure.draw_without_rendering()
        figure.set_layout_engine("none")
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=150, bbox_inches="tight", metadata=SAVE_METADATA[fmt])
    return buffer.getvalue()


def save_figure(figure: Figure, out_dir: Path, name: str) -> list[Path]:
    """`name`.png and `name`.pdf under `out_dir` (a file left alone when it holds these bytes already)."""
    return [write_bytes(Path(out_dir) / f"{name}.{fmt}", figure_bytes(figure, fmt)) for fmt in SAVE_METADATA]


def what_differs(descriptions: list[dict[str, str]]) -> tuple[list[str], list[str]]:
    """Series labels from the parts of their descriptions that differ between them, and the parts they share
    (for the panel's title): a label says what sets a series apart, not everything about it."""
    keys = list(dict.fromkeys(k for d in descriptions for k in d))
    varying = [k for k in keys if len({d.get(k, "") for d in descriptions}) > 1]
    shared = [descriptions[0].get(k, "") for k in keys if k not in varying] if descriptions else []
    labels = [", ".join(d.get(k, "") for k in varying if d.get(k, "")) for d in descriptions]
    return labels, [s for s in shared if s]


def _empty_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _legend_below(ax, below: float = 0.16, extra: list[Patch] | None = None, **kwargs) -> None:
    """The panel's legend under its axes (`below`: axes heights under it, room for the tick labels), never over
    its data; `extra`: keys that stand for no single artist (a set of bars)."""
    handles, labels = ax.get_legend_handles_labels()
    handles += extra or []
    labels += [h.get_label() for h in extra or []]
    ax.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -below), fontsize="x-small", frameon=False, **kwargs
    )


def _errors(points: pd.DataFrame) -> np.ndarray:
    low = (points["y"] - points["low"]).clip(lower=0).fillna(0)
    high = (points["high"] - points["y"]).clip(lower=0).fillna(0)
    return np.vstack([low.to_numpy(), high.to_numpy()])


def _docs_total(row) -> int:
    docs = row.get("eval_docs")
    return sum(docs.values()) if isinstance(docs, dict) else 0


def _train_data(runs: pd.DataFrame | None) -> dict[str, str]:
    """setting -> recovery text other than the corpus (the tables do not carry it; the runs do)."""
    if runs is None or not len(runs) or "train_data" not in runs:
        return {}
    named = runs[runs["train_data"].apply(lambda v: isinstance(v, str))]
    return dict(zip(named["setting"], named["train_data"]))


def _recipe_description(row, train_data: dict[str, str]) -> dict[str, str]:
    """What can set two of our rows apart besides the conversion: its options, recovery recipe and eval docs."""
    recipe = recipe_label({**row, "train_data": train_data.get(row.get("setting"))})
    options = row.get("options")
    return {
        "options": options if isinstance(options, str) else "default options",
        "recipe": recipe or "the paper's recipe",
        "docs": eval_docs_label(row),
    }


def _ours(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["n_seeds"].fillna(0) > 0]


def _memory_points(rows: pd.DataFrame, source: str) -> pd.DataFrame:
    suffix = "_paper" if source == "paper" else ""
    memory = pd.to_numeric(rows[f"kv_mem_change_pct{suffix}"], errors="coerce").astype(float)
    memory = memory.where(~(memory.isna() & rows["method"].isin(["finetuned_full_attention", "original"])), 0.0)
    points = pd.DataFrame({"x": 100.0 + memory, "y": pd.to_numeric(rows[f"avg{suffix}"], errors="coerce")})
    if source == "ours":
        points["low"] = pd.to_numeric(rows["avg_low"], errors="coerce")
        points["high"] = pd.to_numeric(rows["avg_high"], errors="coerce")
    return points.dropna(subset=["x", "y"]).sort_values("x")


MAX_SERIES = 7  # per panel; the rest are in the table


def _budget_title(tokens) -> str:
    return "conversion only (0 tokens)" if not tokens else f"{int(tokens):,} fine-tune tokens"


def kv_memory_vs_avg(
    table1: pd.DataFrame, models: list[str] | None = None, budgets=None, runs: pd.DataFrame | None = None
) -> Figure:
    """What each KV saving costs, ours against the paper: commonsense Avg (95 % whiskers) against KV memory (% of
    MHA), one panel per model and fine-tune budget of ours (`budgets`: only these), the paper's 2.25B-token points
    dashed in every panel. A line joins one recipe's d_kv sweep; its full-attention baseline (fine-tuned on the
    same tokens, the original for 0) stands alone at 100 %. Models without runs of ours are drawn only when no
    model has any (the paper's points alone)."""
    rows = table1 if models is None else table1[table1["model"].isin(models)]
    ours = _ours(rows)
    mla = ours[(ours["method"] == "partial_rope+svd") & ours["kv_mem_change_pct"].notna() & ours["avg"].notna()]
    if budgets is not None:
        mla = mla[mla["train_tokens"].isin(list(budgets))]
    panels = sorted({(m, int(t)) for m, t in zip(mla["model"], mla["train_tokens"])}, key=lambda p: (p[0], p[1]))
    if not panels:
        panels = [(m, None) for m in rows.loc[rows["avg_paper"].notna(), "model"].unique()]
    if not panels:
        raise NoData("no Table 1 row has both a KV memory and an Avg")
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    figure = Figure(figsize=(4.6 * ncols, 5.2 * nrows), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False, sharey=True)
    train_data = _train_data(runs)
    for ax, (model, tokens) in zip(axes.flat, panels):
        in_model = rows[rows["model"] == model]
        paper = in_model[in_model["method"].isin(["finetuned_full_attention", "partial_rope+svd"])]
        paper = _memory_points(paper.dropna(subset=["avg_paper"]).drop_duplicates(["method", "d_kv"]), "paper")
        ax.plot(paper["x"], paper["y"], "o--", mfc="white", color=PAPER, label="paper (2.25B tokens)")
        shared = _draw_budget(ax, _ours(in_model), tokens, train_data) if tokens is not None else "no runs of ours"
        title = f"{model} · {_budget_title(tokens)}" if tokens is not None else model
        ax.set_title(title + "\n" + textwrap.fill(shared, 60), fontsize=8)
        ax.set_xlabel("KV cache memory (% of MHA)")
        ax.set_xlim(0, 110)
        ax.grid(alpha=0.3)
        _legend_below(ax)
    for ax in axes[:, 0]:
        ax.set_ylabel(AVG_LABEL)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle("What each KV saving costs: ours (filled, 95 % whiskers) against the paper (hollow)")
    return figure


def _draw_budget(ax, ours: pd.DataFrame, tokens: int, train_data: dict[str, str]) -> str:
    """Our series at one budget; returns what they share (for the title)."""
    at = ours[ours["train_tokens"] == tokens]
    mla = at[(at["method"] == "partial_rope+svd") & at["kv_mem_change_pct"].notna() & at["avg"].notna()]
    described = [(_recipe_description(row, train_data), row) for row in mla.to_dict("records")]
    series: dict[tuple, list[dict]] = {}
    for description, row in described:
        series.setdefault(tuple(description.items()), []).append(row)
    # best evidenced first: most documents scored, then most d_kv points
    order = sorted(series, key=lambda k: (-_docs_total(series[k][0]), -len(series[k]), k))
    shown, hidden = order[:MAX_SERIES], order[MAX_SERIES:]
    labels, shared = what_differs([dict(k) for k in shown])
    base_method = "finetuned_full_attention" if tokens else "original"
    method = method_of_row(series[shown[0]][0]) if shown else "2-norm"
    colors = shades(method, len(shown))
    for i, (key, label, color) in enumerate(zip(shown, labels, colors)):
        points = _memory_points(pd.DataFrame(series[key]), "ours")
        ax.errorbar(
            points["x"] + 0.9 * i,  # a small sideways step, so that whiskers at one memory size stay apart
            points["y"],
            yerr=_errors(points),
            marker="s",
            capsize=2,
            color=color,
            label=f"ours: {label}" if label else "ours",
        )
    docs = {dict(k)["docs"] for k in shown}
    baselines = at[(at["method"] == base_method) & at["avg"].notna()]
    baselines = baselines[baselines.apply(eval_docs_label, axis=1).isin(docs)]
    for i, (_, base) in enumerate(baselines.iterrows()):
        point = _memory_points(base.to_frame().T, "ours")
        name = "original" if base_method == "original" else "FT full attention"
        ax.errorbar(
            point["x"] + 0.9 * i,
            point["y"],
            yerr=_errors(point),
            marker="D",
            capsize=2,
            ls="none",
            color=method_color(name),
            label=f"ours: {name}" + (f", {eval_docs_label(base)}" if len(docs) > 1 else ""),
        )
    notes = list(shared) + ([f"+{len(hidden)} more series in table1.csv"] if hidden else [])
    return "; ".join(notes)


def _pick(rows: list[dict], train_data: dict[str, str]) -> dict:
    """The best-evidenced of several rows of one strategy: most documents, then the paper's options and recipe."""

    def rank(row):
        described = _recipe_description(row, train_data)
        return (-_docs_total(row), described["options"] != "default options", described["recipe"], row["setting"])

    return sorted(rows, key=rank)[0]


def strategy_comparison(table3: pd.DataFrame, runs: pd.DataFrame | None = None, models=None) -> Figure:
    """Table 3 as bars, per model of ours: commonsense Avg per partial-RoPE strategy, the paper's (grey) beside ours
    (the method's colour, 95 % whiskers) at the budget where most strategies have a commonsense run of ours, a
    strategy without one marked "not run"; beside it the same strategies by held-out perplexity (ours only, the
    paper has none), at the budget where most were measured. Hatched: with SVD."""
    rows = table3 if models is None else table3[table3["model"].isin(models)]
    strategies = rows[rows["method"].isin(["partial_rope", "partial_rope+svd"])]
    model_names = [m for m in dict.fromkeys(rows["model"].dropna()) if len(_ours(rows[rows["model"] == m]))]
    if not model_names:
        raise NoData("no Table 3 row of ours")
    figure = Figure(figsize=(13, 5.2 * len(model_names)), layout="constrained")
    axes = figure.subplots(len(model_names), 2, squeeze=False)
    train_data = _train_data(runs)
    for (left, right), model in zip(axes, model_names):
        in_model = strategies[strategies["model"] == model].assign(strategy=lambda f: f.apply(strategy_name, axis=1))
        _strategy_avg(left, rows[rows["model"] == model], in_model, train_data)
        left.set_title(f"{model}: commonsense Avg (Table 3)", fontsize=10)
        _strategy_perplexity(right, runs, model, list(dict.fromkeys(in_model["strategy"])))
        right.set_title(f"{model}: held-out perplexity, same strategies (ours)", fontsize=10)
    figure.suptitle("Which partial-RoPE strategy keeps most: r = d_h/16; SVD rows at d_kv = d_h/4")
    return figure


def _bar_style(strategy: str, source: str) -> dict:
    method = strategy.split("+", 1)[0]
    hatch = "//" if "+SVD" in strategy else None
    if source == "paper":
        return {"color": PAPER_FILL, "edgecolor": PAPER, "hatch": hatch, "linewidth": 0.6}
    return {"color": method_color(method), "edgecolor": "black", "hatch": hatch, "linewidth": 0.6}


def _not_drawn(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, rotation=90, ha="center", va="bottom", fontsize=7, color="0.35")


def _strategy_avg(ax, in_model_all: pd.DataFrame, in_model: pd.DataFrame, train_data: dict[str, str]) -> None:
    ours = _ours(in_model)
    ours = ours[ours["avg"].notna()]
    by_budget = ours.groupby("train_tokens")["strategy"].nunique()
    budget = max(by_budget.index, key=lambda t: (by_budget[t], t)) if len(by_budget) else None
    categories = list(dict.fromkeys(in_model["strategy"]))
    x = np.arange(len(categories))
    paper = in_model.groupby("strategy", sort=False)["avg_paper"].first().reindex(categories).astype(float)
    chosen = {
        s: _pick(g.to_dict("records"), train_data)
        for s, g in ours[ours["train_tokens"] == budget].groupby("strategy", sort=False)
    }
    floor = np.nanmin(pd.concat([paper, ours["avg_low"], in_model_all["avg_paper"], in_model_all["avg"]]).astype(float))
    bottom = np.floor(floor - 3)
    for i, strategy in enumerate(categories):
        if pd.isna(paper[strategy]):
            _not_drawn(ax, x[i] - 0.2, bottom + 0.3, "not in paper")
        else:
            label = None if paper.iloc[:i].notna().any() else "paper (2.25B tokens)"  # one legend entry
            style = _bar_style(strategy, "paper")
            ax.bar(x[i] - 0.2, paper[strategy] - bottom, 0.4, bottom=bottom, label=label, **style)
        row = chosen.get(strategy)
        if row is None:
            _not_drawn(ax, x[i] + 0.2, bottom + 0.3, "not run")
            continue
        ax.bar(x[i] + 0.2, row["avg"] - bottom, 0.4, bottom=bottom, **_bar_style(strategy, "ours"))
        ax.errorbar(
            x[i] + 0.2,
            row["avg"],
            yerr=[[row["avg"] - row["avg_low"]], [row["avg_high"] - row["avg"]]],
            color="black",
            capsize=3,
        )
    docs = sorted({eval_docs_label(r) for r in chosen.values()})
    key = []
    if chosen:
        scored = "; ".join([_budget_title(budget), *filter(None, docs)])
        key = [Patch(facecolor="white", edgecolor="black", label=f"ours ({scored})")]
    paper_base = in_model_all.loc[in_model_all["method"] == "finetuned_full_attention", "avg_paper"].dropna()
    if len(paper_base):
        ax.axhline(paper_base.iloc[0], color=PAPER, ls="--", lw=1, label="paper: FT full attention")
    # the original on the documents most of our bars were scored on
    most_docs = max(docs, key=[eval_docs_label(r) for r in chosen.values()].count) if docs else None
    originals = _ours(in_model_all)
    originals = originals[(originals["method"] == "original") & (originals.apply(eval_docs_label, axis=1) == most_docs)]
    if len(originals):
        ax.axhline(
            originals["avg"].iloc[0],
            color=method_color("original"),
            lw=1,
            label="ours: original" + (f" ({most_docs})" if most_docs else ""),
        )
    ax.set_ylim(bottom=bottom)
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set_ylabel(AVG_LABEL)
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax, below=0.3, extra=key, ncols=2)


def _strategy_perplexity(ax, runs: pd.DataFrame | None, model: str, categories: list[str]) -> None:
    rows = strategy_perplexities(runs, model) if runs is not None else pd.DataFrame()
    if not len(rows):
        _empty_note(ax, "no held-out perplexity of these strategies")
        return
    budget = rows.groupby("train_tokens")["strategy"].nunique()
    budget = max(budget.index, key=lambda t: (budget[t], t))
    at = rows[rows["train_tokens"] == budget]
    base = at[at["strategy"] == "FT full attention"]
    at = at[at["strategy"] != "FT full attention"]
    categories = categories + [s for s in at["strategy"] if s not in categories]
    x = np.arange(len(categories))
    top = at.set_index("strategy").reindex(categories)
    for i, strategy in enumerate(categories):
        if pd.isna(top.loc[strategy, "ppl"]):
            ax.text(
                x[i],
                0.02,
                "not run",
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color="0.35",
                transform=ax.get_xaxis_transform(),
            )
            continue
        row = top.loc[strategy]
        ax.bar(x[i], row["ppl"], 0.6, **_bar_style(strategy, "ours"))
        ax.errorbar(
            x[i], row["ppl"], yerr=[[row["ppl"] - row["low"]], [row["high"] - row["ppl"]]], color="black", capsize=3
        )
    for _, b in base.iterrows():
        ax.axhline(b["ppl"], color=method_color("FT full attention"), lw=1, label="ours: FT full attention")
    seeds = "-".join(str(n) for n in sorted({int(at["seeds"].min()), int(at["seeds"].max())}))
    label = f"ours ({_budget_title(budget)}, {seeds} seeds; 95 %: bootstrap over held-out documents)"
    key = [Patch(facecolor="white", edgecolor="black", label=label)]
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set_ylabel("held-out perplexity (lower is better)")
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax, below=0.3, extra=key)


def loss_curves(curves: pd.DataFrame, runs: pd.DataFrame) -> Figure:
    """How fine-tuning converged, one panel per study (an experiment, split by its question where it has more
    than `MAX_CURVES` configurations): training loss smoothed over a few steps, the raw curve faint behind; runs
    of one configuration (seeds) averaged per step; runs that did not finish ok dashed with their status."""
    if not len(curves):
        raise NoData("no run logged a training curve")
    info = runs.set_index("run_dir")
    panels = loss_panels(curves, info)
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    figure = Figure(figsize=(6.4 * ncols, 5.6 * nrows), layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False)
    for ax, (title, panel) in zip(axes.flat, panels):
        _draw_loss_panel(ax, title, panel, info)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle("Fine-tuning loss by study (smoothed; raw curve faint behind)")
    return figure


MAX_CURVES = 8
SPLIT_KEYS = (
    "method",
    "svd",
    "rope",
    "d_kv",
    "kv_elements",
    "r",
    "train_tokens",
    "trainable",
    "train_data",
    "precision",
)
SEPARATE = ("objective",)  # losses of two objectives are not on one scale: never in one panel


def _curve_key(run) -> str:
    """One configuration: runs of one setting (seeds) are one curve; a run that did not finish is its own."""
    return str(run["setting"]) if run["status"] == "ok" else str(run.name)


def loss_panels(curves: pd.DataFrame, info: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, curves) per panel: one per experiment, split by objective, and then by the configuration key that
    leaves at most `MAX_CURVES` configurations a panel in the fewest panels."""
    frame = curves.assign(
        experiment=curves["run_dir"].map(info["experiment"]),
        key=curves["run_dir"].map(lambda d: _curve_key(info.loc[d])),
    )
    panels = []
    for experiment, group in frame.groupby("experiment", sort=True):
        configurations = group.drop_duplicates("key").set_index("key")["run_dir"]
        for title, keys in _split(configurations, info, str(experiment)):
            panels.append((title, group[group["key"].isin(keys)]))
    return panels


def _split(configurations: pd.Series, info: pd.DataFrame, title: str) -> list[tuple[str, set]]:
    def values(column):
        return configurations.map(lambda d: _text_value(info.loc[d].get(column)))

    splits = {c: values(c) for c in SEPARATE + SPLIT_KEYS}
    column = next((c for c in SEPARATE if splits[c].nunique() > 1), None)
    if column is None and len(configurations) > MAX_CURVES:
        useful = [c for c in SPLIT_KEYS if splits[c].nunique() > 1]
        fitting = [c for c in useful if splits[c].value_counts().max() <= MAX_CURVES]
        if fitting:
            column = min(fitting, key=lambda c: splits[c].nunique())
        elif useful:
            column = min(useful, key=lambda c: splits[c].value_counts().max())
    if column is None:
        if len(configurations) <= MAX_CURVES:
            return [(title, set(configurations.index))]
        ordered = sorted(configurations.index)
        parts = [ordered[i : i + MAX_CURVES] for i in range(0, len(ordered), MAX_CURVES)]
        return [(f"{title} ({n}/{len(parts)})", set(p)) for n, p in enumerate(parts, start=1)]
    out = []
    for value in sorted(splits[column].unique()):
        chosen = configurations[splits[column] == value]
        out += _split(chosen, info, f"{title}, {_split_title(column, value)}")
    return out


def _text_value(value) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "none"
    whole = isinstance(value, (int, np.integer, float)) and float(value).is_integer()
    return f"{int(value):,}" if whole else str(value)


def _split_title(column: str, value: str) -> str:
    names = {"svd": "SVD", "train_tokens": "tokens", "train_data": "recovery text", "kv_elements": "KV elements"}
    return f"{names.get(column, column)} {value}"


def _describe_curve(run) -> dict[str, str]:
    row = dict(run)
    base = row_label(
        {
            **row,
            "options": None,
            "objective": None,
            "train_data": None,
            "trainable": None,
            "lr": None,
            "precision": None,
        }
    )
    options = row.get("options")
    tokens = row.get("train_tokens")
    return {
        "conversion": base,
        "options": options if isinstance(options, str) else "default options",
        "recipe": recipe_label(row) or "the paper's recipe",
        "tokens": "" if pd.isna(tokens) else f"{int(tokens):,} tokens",
    }


def _smooth(values: pd.Series) -> pd.Series:
    window = max(1, len(values) // 20)
    return values.rolling(window, min_periods=1, center=True).mean()


def _draw_loss_panel(ax, title: str, panel: pd.DataFrame, info: pd.DataFrame) -> None:
    by_tokens = panel["tokens"].notna().all()
    x_column = "tokens" if by_tokens else "step"
    curves = []
    for key, group in panel.groupby("key", sort=False):
        first = info.loc[group["run_dir"].iloc[0]]
        mean = group.groupby(x_column)["loss"].mean()
        curves.append((first, mean, group["run_dir"].nunique()))
    descriptions = [_describe_curve(run) for run, _, _ in curves]
    labels, shared = what_differs(descriptions)
    order = sorted(range(len(curves)), key=lambda i: (method_of_row(curves[i][0]), labels[i]))
    by_method: dict[str, int] = {}
    for i in order:
        method = method_of_row(curves[i][0])
        by_method[method] = by_method.get(method, 0) + 1
    colors = {m: iter(shades(m, n)) for m, n in by_method.items()}
    low, high = [], []
    for i in order:
        run, mean, n = curves[i]
        color = next(colors[method_of_row(run)])
        label = labels[i] or descriptions[i]["conversion"]
        if n > 1:
            label += f" (mean of {n})"
        dashed = run["status"] != "ok"
        if dashed:
            label += f" [{run['status']}]"
        smooth = _smooth(mean)
        ax.plot(mean.index, mean.to_numpy(), color=color, alpha=0.2, lw=0.6)
        style = {"ls": "--" if dashed else "-", "lw": 1.4, "label": textwrap.fill(label, 70)}
        ax.plot(smooth.index, smooth.to_numpy(), color=color, **style)
        low.append(float(smooth.min()))
        high.append(float(smooth.iloc[min(len(smooth) - 1, max(1, len(smooth) // 10))]))
    if low:  # the first steps (loss ~10) would flatten what differs between the curves
        ax.set_ylim(min(low) - 0.1, max(max(high), min(low) + 0.5) + 0.1)
    ax.set_xlabel("fine-tuning tokens" if by_tokens else "step")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 100k, not 100000 running into its neighbour
    ax.set_ylabel("training loss")
    ax.set_title(textwrap.fill(" · ".join([title, *shared]), 70), fontsize=8)
    ax.grid(alpha=0.3)
    _legend_below(ax)


def long_context_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The `long_context.<task>@<length>` scores of ok runs as label/task/length/score rows."""
    rows = []
    ok = runs[runs["status"] == "ok"] if len(runs) else runs
    for column in runs.columns:
        match = _LONG_CONTEXT_KEY.match(str(column))
        if not match:
            continue
        for _, run in ok[ok[column].notna()].iterrows():
            docs = (
                (run.get("eval_docs") or {}).get(f"{match['task']}@{match['length']}")
                if isinstance(run.get("eval_docs"), dict)
                else None
            )
            label = variant_label(run) + (f" ({docs} docs/length)" if docs else "")  # other doc samples: other lines
            rows.append(
                {
                    "label": label,
                    "run_dir": run["run_dir"],
                    "task": match["task"],
                    "length": int(match["length"]),
                    "score": float(run[column]),
                }
            )
    return pd.DataFrame(rows, columns=["label", "run_dir", "task", "length", "score"])


def long_context_vs_length(runs: pd.DataFrame) -> Figure:
    """How retrieval holds up as the context grows: long-context score against context length, one line per
    variant (and task, when several)."""
    points = long_context_points(runs)
    if not len(points):
        raise NoData("no run has a long-context score (e.g. +experiment=kv_precision_cpu has not been run)")
    figure = Figure(figsize=(7, 5), layout="constrained")
    ax = figure.add_subplot()
    several_tasks = points["task"].nunique() > 1
    for (label, task), group in points.groupby(["label", "task"], sort=True):
        mean = group.groupby("length")["score"].mean()
        n = group["run_dir"].nunique()
        name = f"{label} · {task}" if several_tasks else label
        ax.plot(mean.index, mean.to_numpy(), marker="o", label=name if n == 1 else f"{name} (mean of {n})")
    ax.set_xscale("log", base=2)
    lengths = sorted(points["length"].unique())  # the evaluated lengths as plain numbers, not powers of two
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("long-context score (%)")
    ax.set_title("Long-context score vs context length")
    ax.grid(alpha=0.3)
    _legend_below(ax)
    return figure


def _compute_spent(frame: pd.DataFrame, seconds: pd.Series, tokens: pd.Series) -> pd.DataFrame:
    """x coordinates: wall seconds and training tokens, distillation's included (it runs first)."""
    return frame.assign(
        seconds=frame["distill_s"].fillna(0).astype(float) + seconds.fillna(0).astype(float),
        tokens_spent=frame["distill_token_passes"].fillna(0).astype(float) + tokens.fillna(0).astype(float),
    )


def recovery_curves(runs: pd.DataFrame, probes: pd.DataFrame, experiment: str = "recovery") -> Figure:
    """Held-out perplexity and commonsense Avg against the compute spent recovering a conversion, one series
    per (d_kv, recipe): the in-training probe curves (`train.eval_every`) as lines, finished runs as markers.
    Distillation's seconds and token passes come first on the x axes; references are dotted lines."""
    figure = Figure(figsize=(11, 8))
    axes = figure.subplots(2, 2)
    ok = runs[(runs["status"] == "ok") & (runs["experiment"] == experiment)] if len(runs) else runs
    converted = ok[ok["method"] == "partial_rope+svd"] if len(ok) else ok
    if not len(converted):
        for ax in axes.flat:
            _empty_note(ax, f"no ok runs in experiment {experiment!r}")
        return figure
    converted = _compute_spent(
        converted.assign(recipe=converted.apply(recovery_recipe, axis=1)),
        converted["train_s"],
        converted["train_tokens"],
    )
    probe = probes[probes["run_dir"].isin(converted["run_dir"])] if len(probes) else probes
    if len(probe):
        probe = probe.merge(converted[["run_dir", "d_kv", "recipe", "distill_s", "distill_token_passes"]], on="run_dir")
        probe = _compute_spent(probe, probe["elapsed_s"], probe["tokens"])
    colors = {}
    for (d_kv, recipe), group in converted.groupby(["d_kv", "recipe"], sort=True):
        name = f"d_kv={d_kv}: {recipe}"
        color = colors.setdefault(name, f"C{len(colors)}")
        group = group.sort_values("seconds")
        for col, x in enumerate(("seconds", "tokens_spent")):
            axes[0, col].plot(group[x], group["heldout_ppl"], "o", color=color, label=name)
            if group["avg"].notna().any():
                axes[1, col].plot(group[x], group["avg"], "o-", color=color, label=name)
        curves = probe[(probe["d_kv"] == d_kv) & (probe["recipe"] == recipe)] if len(probe) else probe
        for _, curve in curves.groupby("run_dir") if len(curves) else []:
            for col, x in enumerate(("seconds", "tokens_spent")):
                axes[0, col].plot(curve[x], curve["heldout_ppl_probe"], "-", color=color, alpha=0.7)
        start = converted[(converted["d_kv"] == d_kv) & (converted["recipe"] == "conversion only")]
        if recipe.startswith("ILD") and len(start):
            # distillation's own stretch: from the unrecovered conversion to the distilled model
            for _, run in group.iterrows():
                first = curves[curves["run_dir"] == run["run_dir"]].sort_values("step") if len(curves) else curves
                after = first["heldout_ppl_probe"].iloc[0] if len(first) else run["heldout_ppl"]
                for col, x in enumerate(("distill_s", "distill_token_passes")):
                    axes[0, col].plot([0, run[x]], [start["heldout_ppl"].iloc[0], after], "--", color=color, alpha=0.7)
    for _, ref in ok[ok["method"].isin(["original", "finetuned_full_attention"])].iterrows():
        for col in range(2):
            for row, value in ((0, ref["heldout_ppl"]), (1, ref["avg"])):
                if not pd.isna(value):
                    axes[row, col].axhline(value, ls=":", color="grey")
                    axes[row, col].annotate(
                        ref["label"].split(": ", 1)[-1],
                        (0, value),
                        xycoords=("axes fraction", "data"),
                        fontsize="x-small",
                        color="grey",
                        va="bottom",
                    )
    for col, xlabel in enumerate(
        ("compute: wall seconds (distillation + fine-tune)", "tokens: fine-tune tokens + distillation token passes")
    ):
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("held-out perplexity")
        axes[1, col].set_ylabel(AVG_LABEL)
        for row in range(2):
            axes[row, col].set_xlabel(xlabel)
            axes[row, col].grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0, 0].legend(unique.values(), unique.keys(), fontsize="small")
    if not axes[1, 0].lines:
        for ax in axes[1]:
            _empty_note(ax, "no commonsense scores in these runs")
    for col in range(2):
        axes[0, col].set_title(
            "lines: in-training probes (train.eval_batches rows); dots: the final held-out evaluation", fontsize="small"
        )
        axes[1, col].set_title("each finished run; the 95 % intervals are in the experiment's table", fontsize="small")
    figure.suptitle(f"Recovery of a converted model against compute (experiment {experiment!r})")
    figure.tight_layout()
    return figure


VERDICT_COLORS = {"B lower": "C2", "B higher": "C3", "not resolved": "grey"}
RATIO_TICKS = (0.25, 0.33, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4)
WIDE_RATIO_TICKS = (0.25, 0.33, 0.5, 0.67, 1, 1.5, 2, 3, 4)


def _finish_forest(figure: Figure, ax, colors: dict[str, str], title: str) -> Figure:
    """A forest plot's legend (one entry per verdict colour), grid and title."""
    for verdict, color in colors.items():
        ax.plot([], [], "o-", color=color, label=verdict)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title, fontsize="small")
    figure.tight_layout()
    return figure


MAX_FOREST_ROWS = 30  # per panel


def _common_suffix(labels: list[str]) -> str:
    """The longest tail, from a space on, that every label shares (" [lr 3e-4] @ 163,840 tokens")."""
    if not labels:
        return ""
    tail = labels[0]
    for label in labels[1:]:
        while not label.endswith(tail):
            tail = tail[1:]
    cut = tail.find(" ")
    return tail[cut:] if cut >= 0 and len(tail) < min(map(len, labels)) else ""


def perplexity_ratios(pairs: pd.DataFrame, title: str) -> Figure:
    """`perplexity_pairs`' table as forest plots, one panel per question the pairs answer (`question`), at most
    `MAX_FOREST_ROWS` rows a panel, sorted by ratio: per pair, B/A on a log axis with its paired bootstrap 95 %
    interval (coloured by verdict) and each seed's own ratio as a cross; what every label of a panel shares is
    in its title."""
    if not len(pairs):
        raise NoData("no pairs of rows that differ in one factor")
    questions = pairs["question"] if "question" in pairs else pairs["factor"]
    panels = []
    for question, group in pairs.groupby(questions, sort=True):
        group = group.sort_values("B/A", kind="stable").reset_index(drop=True)
        parts = -(-len(group) // MAX_FOREST_ROWS)
        for n in range(parts):
            name = question if parts == 1 else f"{question} ({n + 1}/{parts})"
            panels.append((name, group.iloc[n * MAX_FOREST_ROWS : (n + 1) * MAX_FOREST_ROWS]))
    heights = [len(p) + 2 for _, p in panels]
    figure = Figure(figsize=(11, 1.2 + 0.24 * sum(heights)), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (question, panel) in zip(axes, panels):
        tail = _common_suffix(list(panel["A"]) + list(panel["B"]))
        labels = [f"{b.removesuffix(tail)}  vs  {a.removesuffix(tail)}" for a, b in zip(panel["A"], panel["B"])]
        y = np.arange(len(panel))[::-1]
        for yi, (_, pair) in zip(y, panel.iterrows()):
            color = VERDICT_COLORS.get(pair["verdict"], "black")
            if not pd.isna(pair["B/A low"]):
                ax.plot([pair["B/A low"], pair["B/A high"]], [yi, yi], "-", color=color, lw=2)
            ax.plot(pair["B/A"], yi, "o", color=color)
            seeds = list(pair["B/A per seed"])
            ax.plot(seeds, [yi] * len(seeds), "x", color="black", ms=4)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        low, high = ax.get_xlim()  # ratios, not powers of ten; fewer of them on a wide axis
        ticks = RATIO_TICKS if high / low < 2.5 else WIDE_RATIO_TICKS
        ax.set_xticks([t for t in ticks if low <= t <= high], minor=False)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(y, labels, fontsize="small")
        ax.set_ylim(-0.8, len(panel) - 0.2)
        ax.grid(alpha=0.3, axis="x")
        ax.set_title(f"{question}" + (f"  (every row{tail})" if tail else ""), fontsize="small", loc="left")
    axes[-1].set_xlabel(
        "perplexity B / A (left of 1: B better); bar: paired bootstrap 95 % over held-out documents; x: each seed"
    )
    for verdict, color in VERDICT_COLORS.items():
        axes[0].plot([], [], "o-", color=color, label=verdict)
    axes[0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.suptitle(title, fontsize="small")
    return figure


SCORE_VERDICT_COLORS = {"B lower": "C3", "B higher": "C2", "not resolved": "grey"}  # a score: higher is better


def score_deltas_vs(pairs: pd.DataFrame, reference: str, title: str, target: float | None = None) -> Figure:
    """`pairwise`'s Avg deltas of every row against one `reference` row (A) as a forest plot: B − A in points with
    its paired bootstrap 95 % interval, coloured by verdict, best on top; `target`: a dashed line (a goal)."""
    rows = pairs[pairs["A"] == reference] if len(pairs) else pairs
    rows = rows.sort_values("avg_delta", ascending=False).reset_index(drop=True) if len(rows) else rows
    labels = [f"{r['B']}  ({r['eval docs']})" for _, r in rows.iterrows()] if len(rows) else []
    figure = Figure(figsize=(6 + 0.05 * max(map(len, labels), default=0), 1.5 + 0.3 * max(len(rows), 4)))
    ax = figure.subplots()
    if not len(rows):
        _empty_note(ax, f"no rows paired with {reference!r}")
        return figure
    y = np.arange(len(rows))[::-1]
    for yi, (_, row) in zip(y, rows.iterrows()):
        color = SCORE_VERDICT_COLORS.get(row["verdict"], "black")
        ax.plot([row["avg_delta_low"], row["avg_delta_high"]], [yi, yi], "-", color=color, lw=2)
        ax.plot(row["avg_delta"], yi, "o", color=color)
    ax.axvline(0.0, color="black", lw=0.8)
    if target is not None:
        ax.axvline(target, color="black", lw=0.8, ls="--", label=f"goal: {target:+g} points")
    ax.set_yticks(y, labels, fontsize="x-small")
    ax.set_xlabel(f"Avg B − {reference} (points); bar: paired bootstrap 95 % over the same documents")
    return _finish_forest(figure, ax, SCORE_VERDICT_COLORS, title)


def scores_vs_recovery_ppl(
    pairs: pd.DataFrame, reference: str, title: str, columns=("avg", "hellaswag", "arc", "piqa")
) -> Figure:
    """One panel per score column: each row's paired difference to the `reference` row (A) against its held-out
    perplexity on the text it recovered on (log axis), bars its paired bootstrap 95 % interval; the points are
    numbered and the numbers listed below. Rows without that perplexity (recovered on the corpus) are left out."""
    rows = pairs[(pairs["A"] == reference) & pairs["B recovery text ppl"].notna()] if len(pairs) else pairs
    rows = rows.sort_values("B recovery text ppl").reset_index(drop=True) if len(rows) else rows
    figure = Figure(figsize=(3.2 * len(columns), 3.4))  # the numbered labels go below, outside the axes
    axes = figure.subplots(1, len(columns), sharex=True)
    if not len(rows):
        _empty_note(axes[0], f"no row recovered on its own text is paired with {reference!r}")
        return figure
    x = rows["B recovery text ppl"].astype(float).to_numpy()
    for ax, column in zip(axes, columns):
        y = rows[f"{column}_delta"].astype(float)
        errors = np.vstack(
            [(y - rows[f"{column}_delta_low"]).clip(lower=0), (rows[f"{column}_delta_high"] - y).clip(lower=0)]
        )
        ax.errorbar(x, y, yerr=errors, fmt="o", color="tab:blue", ecolor="tab:blue", alpha=0.8, capsize=2)
        for i, (xi, yi) in enumerate(zip(x, y), start=1):
            ax.annotate(str(i), (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize="x-small")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xscale("log")
        for axis_ticks in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis_ticks(FormatStrFormatter("%g"))  # 20, 30, 40 rather than 2x10^1
        name = "Avg" if column == "avg" else column_label(column)
        ax.set_title(f"{name} − {reference}", fontsize="small")
        ax.set_xlabel("held-out ppl on the recovery text")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("points; bar: paired bootstrap 95 %")
    legend = "\n".join(f"{i}: {label}" for i, label in enumerate(rows["B"], start=1))
    figure.suptitle(title, fontsize="small")
    figure.text(0.01, 0.0, legend, fontsize=5.5, va="top", ha="left", family="monospace")
    figure.tight_layout()
    return figure


def budget_vs_reference(comparison: pd.DataFrame) -> Figure:
    """Held-out perplexity against cached elements per token and layer (`zero_shot.budget_comparison`): one
    line per converter and options, TransMLA's own code dashed; only our rows paired with it (same held-out
    rows) are drawn. The paired ratio and its interval are in the table."""
    figure = Figure(figsize=(6.4, 4.2))
    ax = figure.subplots()
    reference = comparison["converter"].str.startswith("TransMLA")
    paired = comparison[
        reference | comparison.get("ours / TransMLA [95 %]", pd.Series("", index=comparison.index)).astype(str).ne("")
    ]
    # a searched value's outcome, "key_weight=searched (2)", differs by budget; the series is the recipe
    paired = paired.assign(recipe=paired["options"].astype(str).str.replace(r" \([0-9.]+\)", "", regex=True))
    groups = sorted(
        paired.groupby(["converter", "recipe"], sort=False), key=lambda g: not g[0][0].startswith("TransMLA")
    )
    for (converter, options), rows in groups:
        rows = rows.sort_values("KV elements")
        label = f"{converter} ({options})" if options else converter
        reference = converter.startswith("TransMLA")
        ax.plot(
            rows["KV elements"],
            rows["held-out ppl"].astype(float),
            "s--" if reference else "o-",
            color="black" if reference else None,
            label=label[:110],
        )
    ax.set_xlabel("cached elements per token and layer")
    ax.set_ylabel("held-out perplexity (zero shot)")
    ax.set_yscale("log")
    ax.set_xticks(sorted(comparison["KV elements"].unique()))
    ax.legend(fontsize=5)
    ax.set_title("Ours against TransMLA's converter at equal KV bytes", fontsize=9)
    return figure


def recovery_grid(grid: pd.DataFrame, title: str, target: float | None = None) -> Figure:
    """`recovery_study.recovery_grid` as one panel per KV saving: a block per conversion, a line per run coloured
    by its recovery (data and objective), Avg − original with its paired bootstrap 95 % interval. Filled: the
    recovery's usual recipe in the experiment (a grid cell); hollow and annotated: a control that differs
    (tokens, lr, trainable parameters, recovery set); square: trained in fp32, circle: bf16 autocast."""
    savings = sorted(grid["kv saving %"].unique(), reverse=True) if len(grid) else []
    heights = [
        len(grid[grid["kv saving %"] == s]) + grid[grid["kv saving %"] == s]["conversion"].nunique() for s in savings
    ] or [1]
    figure = Figure(figsize=(11, 1.4 + 0.22 * sum(heights) + 0.5 * len(heights)))
    axes = figure.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    if not len(grid):
        _empty_note(axes[0], "no fine-tuned row paired with the original")
        return figure
    colors = {recovery: f"C{i}" for i, recovery in enumerate(sorted(grid["recovery"].unique()))}
    for ax, saving in zip(axes, savings):
        panel = grid[grid["kv saving %"] == saving].sort_values(["conversion", "recovery", "differs", "precision"])
        y, ticks, labels = 0.0, [], []
        for conversion, runs in reversed(list(panel.groupby("conversion", sort=True))):
            block = []
            for _, run in runs.iloc[::-1].iterrows():
                color, control = colors[run["recovery"]], bool(run["differs"])
                ax.plot([run["low"], run["high"]], [y, y], "-", color=color, lw=1.5, alpha=0.5 if control else 1)
                ax.plot(
                    run["delta"],
                    y,
                    "s" if run["precision"] == "fp32" else "o",
                    color=color,
                    markerfacecolor="white" if control else color,
                    markersize=5,
                )
                if control:
                    ax.annotate(
                        run["differs"],
                        (run["high"], y),
                        textcoords="offset points",
                        xytext=(4, -2.5),
                        fontsize="xx-small",
                        color=color,
                    )
                block.append(y)
                y += 1
            ticks.append(float(np.mean(block)))
            labels.append(textwrap.fill(conversion, 48))
            ax.axhline(y, color="grey", lw=0.4)
            y += 1
        ax.set_yticks(ticks, labels, fontsize="xx-small")
        ax.set_ylim(-0.8, y - 0.8)
        ax.axvline(0.0, color="black", lw=0.8)
        if target is not None:
            ax.axvline(target, color="black", lw=0.8, ls="--")
        ax.set_title(f"KV cache {saving:+.2f} %", fontsize="small", loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [axes[0].plot([], [], "o", color=c, label=r)[0] for r, c in colors.items()]
    handles += [
        axes[0].plot([], [], "s", color="grey", label="trained in fp32")[0],
        axes[0].plot([], [], "o", color="grey", markerfacecolor="white", label="control (annotated)")[0],
    ]
    if target is not None:
        handles.append(axes[0].plot([], [], "--", color="black", lw=0.8, label=f"goal: {target:+g} points")[0])
    axes[0].legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1].set_xlabel("Avg − original (points); bar: paired bootstrap 95 % over the same documents")
    figure.suptitle(title, fontsize="small")
    figure.tight_layout()
    return figure
