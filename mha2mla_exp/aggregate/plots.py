"""The paper's comparisons as matplotlib figures. Each function returns its Figure (no pyplot state),
so callers can test the axes and series or save them with `save_figure`."""

from __future__ import annotations

import io
import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, NullFormatter

from .files import write_bytes
from .records import recovery_recipe, variant_label
from .render import TASK_NAMES, eval_docs_label

AVG_LABEL = "Avg commonsense score (points)"
_LONG_CONTEXT_KEY = re.compile(r"^long_context\.(?P<task>.+)@(?P<length>\d+)$")


# no creation date in a PDF (the only thing that changed between two renderings of the same figure)
SAVE_METADATA = {"png": {}, "pdf": {"CreationDate": None}}


def figure_bytes(figure: Figure, fmt: str) -> bytes:
    """The figure as `fmt` (png | pdf) bytes, the same bytes for the same figure: 150 dpi, tight bounding box."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=150, bbox_inches="tight", metadata=SAVE_METADATA[fmt])
    return buffer.getvalue()


def save_figure(figure: Figure, out_dir: Path, name: str) -> list[Path]:
    """`name`.png and `name`.pdf under `out_dir` (a file left alone when it holds these bytes already)."""
    return [write_bytes(Path(out_dir) / f"{name}.{fmt}", figure_bytes(figure, fmt)) for fmt in SAVE_METADATA]


def _ours_name(ours_model, model) -> str:
    return f"ours: {ours_model}" if ours_model == model else f"ours: {ours_model} ({model})"


def _series_name(group: pd.DataFrame, model) -> str:
    """One series of ours: a model at one budget on one doc sample."""
    first = group.iloc[0]
    docs = eval_docs_label(first)
    name = f"{_ours_name(first['ours_model'], model)}, {int(first['train_tokens']):,} tokens"
    return name + (f", {docs}" if docs else "")


def _empty_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


_SERIES = ["ours_model", "train_tokens", "eval_sample", "eval_dtype"]


def _ours_series(rows: pd.DataFrame):
    """Our rows grouped into series: one per (model, budget, eval sample, eval dtype)."""
    ours = rows[rows["n_seeds"].fillna(0) > 0]
    if not len(ours):
        return []
    keys = ours[_SERIES].astype(object).where(ours[_SERIES].notna(), "").astype(str).agg("|".join, axis=1)
    return list(ours.groupby(keys, sort=False))


def _errors(points: pd.DataFrame) -> np.ndarray:
    low = (points["y"] - points["low"]).clip(lower=0).fillna(0)
    high = (points["high"] - points["y"]).clip(lower=0).fillna(0)
    return np.vstack([low.to_numpy(), high.to_numpy()])


def kv_memory_vs_avg(table1: pd.DataFrame, models: list[str] | None = None) -> Figure:
    """Avg against KV memory (% of MHA) per model: the paper's fine-tuned baseline and MLA rows dashed; ours
    one line per budget (fine-tune tokens), doc sample and conversion options, with 95% whiskers. Each line
    starts at its budget's baseline (the full-attention fine-tune; the original model for 0 tokens), at
    100% by definition; an MLA row whose memory was not measured is left out rather than placed by formula.
    With runs of ours, only their models' paper lines are drawn."""
    figure = Figure(figsize=(8, 5))
    ax = figure.add_subplot()
    rows = table1 if models is None else table1[table1["model"].isin(models)]
    ours_models = rows.loc[rows["n_seeds"].fillna(0) > 0, "model"].dropna().unique()
    n_ours = 0
    for m, model in enumerate(ours_models if len(ours_models) else rows["model"].dropna().unique()):
        in_model = rows[rows["model"] == model]
        paper = in_model[in_model["method"].isin(["finetuned_full_attention", "partial_rope+svd"])]
        paper = paper.dropna(subset=["avg_paper"]).drop_duplicates(["method", "d_kv"])
        points = _memory_points(paper, "paper")
        if len(points):
            ax.plot(
                points["x"],
                points["y"],
                marker="o",
                mfc="none",
                ls="--",
                color="black" if len(ours_models) else f"C{m}",
                alpha=1.0 / (1 + m),
                label=f"paper: {model} (2.25B tokens)",
            )
        for _, group in _ours_series(in_model):
            tokens = group["train_tokens"].iloc[0]
            base = group[group["method"] == ("finetuned_full_attention" if tokens else "original")]
            mla = group[group["method"] == "partial_rope+svd"]
            for options, converted in mla.groupby(mla["options"].fillna(""), sort=True):
                series = pd.concat([base, converted])
                points = _memory_points(series, "ours")
                if len(points):
                    name = _series_name(series, model) + (f", {options}" if options else "")
                    # a small sideways offset per line, so that whiskers at one memory size stay apart
                    ax.errorbar(
                        points["x"] + 0.7 * n_ours,
                        points["y"],
                        yerr=_errors(points),
                        marker="s",
                        capsize=3,
                        color=f"C{n_ours}",
                        label=name,
                    )
                    n_ours += 1
    ax.set_xlabel("KV cache memory (% of MHA)")
    ax.set_ylabel(AVG_LABEL)
    ax.set_title("Compression vs performance (Table 1); whiskers: 95% intervals")
    if ax.lines or ax.containers:
        ax.legend(fontsize="x-small")
    else:
        _empty_note(ax, "no Table 1 rows with both memory and Avg")
    ax.grid(alpha=0.3)
    return figure


def _memory_points(rows: pd.DataFrame, source: str) -> pd.DataFrame:
    suffix = "_paper" if source == "paper" else ""
    memory = pd.to_numeric(rows[f"kv_mem_change_pct{suffix}"], errors="coerce").astype(float)
    memory = memory.where(~(memory.isna() & rows["method"].isin(["finetuned_full_attention", "original"])), 0.0)
    points = pd.DataFrame({"x": 100.0 + memory, "y": pd.to_numeric(rows[f"avg{suffix}"], errors="coerce")})
    if source == "ours":
        points["low"] = pd.to_numeric(rows["avg_low"], errors="coerce")
        points["high"] = pd.to_numeric(rows["avg_high"], errors="coerce")
    return points.dropna(subset=["x", "y"]).sort_values("x")


def _strategy_name(row) -> str:
    if row["method"] == "partial_rope":
        return str(row["rope"])
    return f"{row['rope']}+SVD {row['svd']}"


def strategy_comparison(table3: pd.DataFrame, models: list[str] | None = None) -> Figure:
    """Table 3 as bars: Avg per partial-RoPE strategy (with and without SVD), the paper's beside ours (one
    series per budget and doc sample, 95% whiskers), one panel per model; horizontal lines mark each
    series' full-attention fine-tune."""
    rows = table3 if models is None else table3[table3["model"].isin(models)]
    strategies = rows[rows["method"].isin(["partial_rope", "partial_rope+svd"]) & rows["options"].isna()]
    model_names = list(strategies["model"].dropna().unique())
    figure = Figure(figsize=(max(6, 6 * len(model_names)), 4.5))
    if not model_names:
        _empty_note(figure.add_subplot(), "no Table 3 rows")
        return figure
    axes = figure.subplots(1, len(model_names), squeeze=False)[0]
    for ax, model in zip(axes, model_names):
        in_model = strategies[strategies["model"] == model].assign(strategy=lambda f: f.apply(_strategy_name, axis=1))
        categories = list(dict.fromkeys(in_model["strategy"]))
        series = {"paper": (in_model.groupby("strategy", sort=False)["avg_paper"].first(), None)}
        for _, group in _ours_series(in_model):
            if group["avg"].notna().any():
                by = group.groupby("strategy", sort=False)
                interval = (by["avg_low"].first(), by["avg_high"].first())
                series[_series_name(group, model)] = (by["avg"].first(), interval)
        width = 0.8 / len(series)
        x = np.arange(len(categories))
        for i, (label, (values, interval)) in enumerate(series.items()):
            heights = values.reindex(categories).astype(float).to_numpy()
            yerr = None
            if interval is not None:
                low, high = (v.reindex(categories).astype(float).to_numpy() for v in interval)
                yerr = np.nan_to_num(np.vstack([heights - low, high - heights]))
            ax.bar(
                x + (i - (len(series) - 1) / 2) * width,
                heights,
                width,
                label=label,
                yerr=yerr,
                capsize=2,
                color="lightgrey" if label == "paper" else f"C{i - 1}",
                edgecolor="black",
                linewidth=0.5,
            )
        baselines = rows[(rows["model"] == model) & (rows["method"] == "finetuned_full_attention")]
        paper_base = baselines["avg_paper"].dropna().unique()
        if len(paper_base) == 1:
            ax.axhline(paper_base[0], color="black", ls="--", lw=1, label="paper: FT full attention")
        for i, (_, group) in enumerate(_ours_series(baselines)):
            if group["avg"].notna().any():
                ax.axhline(
                    group["avg"].iloc[0],
                    color="black",
                    ls="-",
                    lw=1,
                    alpha=0.4 + 0.6 / (i + 1),
                    label=f"FT full attention, {int(group['train_tokens'].iloc[0]):,} tokens",
                )
        heights = (
            pd.concat(
                [
                    in_model["avg_paper"],
                    in_model["avg_low"],
                    in_model["avg_high"],
                    baselines["avg_paper"],
                    baselines["avg"],
                ]
            )
            .astype(float)
            .dropna()
        )
        if len(heights):
            ax.set_ylim(heights.min() - 3, heights.max() + 2)  # the differences are a few points
        ax.set_xticks(x, categories, rotation=30, ha="right")
        ax.set_xlabel("partial-RoPE strategy")
        ax.set_ylabel(AVG_LABEL)
        ax.set_title(f"{model} (Table 3)")
        ax.legend(fontsize="x-small")
    figure.tight_layout()
    return figure


def loss_curves(curves: pd.DataFrame) -> Figure:
    """Training loss per variant: runs of one configuration (seeds) averaged per step; runs that did not
    finish ok are drawn dashed, one by one, with their status in the label."""
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    by_tokens = len(curves) > 0 and curves["tokens"].notna().all()
    x_column = "tokens" if by_tokens else "step"
    ok = curves[curves["status"] == "ok"]
    for label, group in ok.groupby("label", sort=True):
        mean = group.groupby(x_column)["loss"].mean()
        n = group["run_dir"].nunique()
        ax.plot(mean.index, mean.to_numpy(), label=label if n == 1 else f"{label} (mean of {n})")
    for (run_dir, label, status), group in curves[curves["status"] != "ok"].groupby(
        ["run_dir", "label", "status"], sort=True
    ):
        ax.plot(group[x_column], group["loss"], ls="--", label=f"{label} [{status}]")
    ax.set_xlabel("fine-tuning tokens" if by_tokens else "step")
    ax.set_ylabel("training loss")
    ax.set_title("Fine-tuning loss per variant")
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        _empty_note(ax, "no training curves")
    ax.grid(alpha=0.3)
    return figure


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
    """Long-context score against context length, one line per variant (and task, when several)."""
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    points = long_context_points(runs)
    several_tasks = points["task"].nunique() > 1
    for (label, task), group in points.groupby(["label", "task"], sort=True):
        mean = group.groupby("length")["score"].mean()
        n = group["run_dir"].nunique()
        name = f"{label} · {task}" if several_tasks else label
        ax.plot(mean.index, mean.to_numpy(), marker="o", label=name if n == 1 else f"{name} (mean of {n})")
    ax.set_xscale("log", base=2)
    if len(points):  # the evaluated lengths as plain numbers, not powers of two
        lengths = sorted(points["length"].unique())
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("long-context score (%)")
    ax.set_title("Long-context score vs context length")
    if ax.lines:
        ax.legend(fontsize="x-small")
    else:
        _empty_note(ax, "no long-context results")
    ax.grid(alpha=0.3)
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


def _finish_forest(figure: Figure, ax, colors: dict[str, str], title: str) -> Figure:
    """A forest plot's legend (one entry per verdict colour), grid and title."""
    for verdict, color in colors.items():
        ax.plot([], [], "o-", color=color, label=verdict)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title, fontsize="small")
    figure.tight_layout()
    return figure


def perplexity_ratios(pairs: pd.DataFrame, title: str) -> Figure:
    """`perplexity_pairs`' table as a forest plot: per pair, B/A on a log axis with its paired bootstrap 95 %
    interval (coloured by verdict) and each seed's own ratio as a cross; pairs grouped by the factor they vary."""
    pairs = pairs.sort_values(["factor", "B/A"], kind="stable").reset_index(drop=True) if len(pairs) else pairs
    labels = [f"{p['factor']}: {p['B']}  vs  {p['A']}" for _, p in pairs.iterrows()] if len(pairs) else []
    # the labels are long: widen the figure with them so that the axis keeps ~6 inches
    figure = Figure(figsize=(7 + 0.055 * max(map(len, labels), default=0), 1.5 + 0.28 * max(len(pairs), 4)))
    ax = figure.subplots()
    if not len(pairs):
        _empty_note(ax, "no pairs of rows that differ in one factor")
        return figure
    y = np.arange(len(pairs))[::-1]
    for yi, (_, pair) in zip(y, pairs.iterrows()):
        color = VERDICT_COLORS.get(pair["verdict"], "black")
        if not pd.isna(pair["B/A low"]):
            ax.plot([pair["B/A low"], pair["B/A high"]], [yi, yi], "-", color=color, lw=2)
        ax.plot(pair["B/A"], yi, "o", color=color)
        seeds = list(pair["B/A per seed"])
        ax.plot(seeds, [yi] * len(seeds), "x", color="black", ms=4)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    low, high = ax.get_xlim()  # ratios, not powers of ten
    ax.set_xticks([t for t in RATIO_TICKS if low <= t <= high], minor=False)
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(y, labels, fontsize="x-small")
    ax.set_xlabel("perplexity B / A (left of 1: B better); bar: paired bootstrap 95 % over held-out rows; x: each seed")
    return _finish_forest(figure, ax, VERDICT_COLORS, title)


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
        name = "Avg" if column == "avg" else TASK_NAMES.get(column, column)
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
