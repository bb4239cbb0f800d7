"""Every registered figure, rendered once on the committed runs (results/runs), read as a reader would: each panel
draws data, has a legend of at most ~10 entries that covers no data point, at most ~40 rows, no label with `?`,
`nan` or `None`, and ours wherever the paper's are; the gallery shows every committed figure with its question."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import BarContainer, ErrorbarContainer

from mha2mla_exp.aggregate import build_aggregate
from mha2mla_exp.aggregate.pipeline import Written, gallery_markdown, write_artifact
from mha2mla_exp.aggregate.table_registry import TABLES, SkippedPlot

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "results/aggregate/plots"
BAD_LABEL = re.compile(r"\?|\bnan\b|\bNone\b")


@pytest.fixture(scope="session")
def committed():
    """The aggregate of the committed runs and every figure it draws (built once: a minute or two)."""
    agg = build_aggregate([ROOT / "results/runs"])
    return agg, agg.figures()


@functools.cache  # drawn once: each check reads the same panels
def _panels(figure):
    FigureCanvasAgg(figure).draw()  # legends and texts get their places
    return [ax for ax in figure.axes if ax.get_visible()]


def _labels(ax) -> list[str]:
    texts = [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
    texts += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    legend = ax.get_legend()
    texts += [t.get_text() for t in legend.get_texts()] if legend else []
    return texts + [t.get_text() for t in ax.texts]


def _data_points(ax) -> np.ndarray:
    """Every drawn data point in display coordinates."""
    points = [line.get_xydata() for line in ax.lines if len(line.get_xydata())]
    points += [np.array([[p.get_x() + p.get_width() / 2, p.get_y() + p.get_height()]]) for p in ax.patches]
    points = [p for p in points if p.size]
    if not points:
        return np.empty((0, 2))
    data = np.vstack(points).astype(float)
    return ax.transData.transform(data[np.isfinite(data).all(axis=1)])


def _has_data(ax) -> bool:
    return bool(ax.patches or any(len(line.get_xdata()) for line in ax.lines) or ax.collections)


def test_every_registered_figure_is_drawn_or_says_why(committed):
    agg, figures = committed
    declared = [
        artifact
        for entry in TABLES
        if entry.name in ("table1", "table3", "loss_curves", "long_context_vs_length")
        for artifact in entry.build(agg.inputs(entry))
        if not hasattr(artifact, "views")
    ]
    names = {a.name: a for a in declared}
    assert {"kv_memory_vs_avg", "strategy_comparison", "loss_curves"} <= set(figures)
    # no committed run has a long-context score: the figure is skipped, with its reason
    skipped = names["long_context_vs_length"]
    assert isinstance(skipped, SkippedPlot) and "long-context" in skipped.reason
    for name, plot in figures.items():
        assert len(plot.question) > 20, name  # what the figure answers, its caption in the gallery


@pytest.mark.parametrize("check", ["data", "legend", "labels", "rows", "legend_over_data"])
def test_every_panel_reads(committed, check):
    _, figures = committed
    for name, plot in figures.items():
        for ax in _panels(plot.figure):
            where = f"{name}: {ax.get_title()!r}"
            legend = ax.get_legend()
            if check == "data":
                assert _has_data(ax), where
            elif check == "legend" and legend is not None:
                assert len(legend.get_texts()) <= 10, where
            elif check == "labels":
                bad = [t for t in _labels(ax) if BAD_LABEL.search(t)]
                assert not bad, (where, bad)
            elif check == "rows":
                assert len([t for t in ax.get_yticklabels() if t.get_text()]) <= 40, where
            elif check == "legend_over_data" and legend is not None:
                box = legend.get_window_extent()
                if not ax.get_window_extent().overlaps(box):
                    continue  # outside the axes: nothing under it
                points = _data_points(ax)
                inside = (points[:, 0] > box.x0) & (points[:, 0] < box.x1)
                inside &= (points[:, 1] > box.y0) & (points[:, 1] < box.y1)
                assert not inside.any(), where


def test_ours_wherever_the_papers_are(committed):
    _, figures = committed
    for name in ("kv_memory_vs_avg", "strategy_comparison"):
        for ax in _panels(figures[name].figure):
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            if any(label.startswith("paper (") for label in labels):
                assert any(label.startswith("ours") for label in labels), (name, ax.get_title())


def test_table3_every_strategy_has_our_bar_or_says_not_run(committed):
    _, figures = committed
    avg = _panels(figures["strategy_comparison"].figure)[0]
    strategies = [t.get_text() for t in avg.get_xticklabels()]
    ours = [c for c in avg.containers if isinstance(c, BarContainer) and c.patches]
    ours = [p for c in ours for p in c.patches if p.get_facecolor()[:3] != (0.85, 0.85, 0.85)]
    not_run = [t for t in avg.texts if t.get_text() == "not run"]
    assert len(ours) + len(not_run) == len(strategies) >= 8
    assert len(ours) >= 2  # 2-norm and RoRoPE with joint SVD have commonsense runs
    whiskers = [c for c in avg.containers if isinstance(c, ErrorbarContainer)]
    assert len(whiskers) == len(ours)  # every bar of ours carries its interval
    perplexity = _panels(figures["strategy_comparison"].figure)[1]
    assert "perplexity" in perplexity.get_ylabel() and len(perplexity.patches) >= 8


def test_headline_one_panel_per_budget_at_most_seven_series(committed):
    agg, figures = committed
    panels = _panels(figures["kv_memory_vs_avg"].figure)
    table = agg.tables["table1"]
    mla = table[(table["n_seeds"] > 0) & (table["method"] == "partial_rope+svd")]
    assert len(panels) == mla["train_tokens"].nunique()
    for ax in panels:
        ours = [c for c in ax.containers if c.get_label().startswith("ours") and "full attention" not in c.get_label()]
        assert 1 <= len(ours) <= 7, ax.get_title()


def test_loss_curves_at_most_eight_a_panel_smoothed_over_raw(committed):
    _, figures = committed
    for ax in _panels(figures["loss_curves"].figure):
        labelled = [line for line in ax.lines if not line.get_label().startswith("_")]
        assert 1 <= len(labelled) <= 8, ax.get_title()
        faint = [line for line in ax.lines if line.get_alpha() is not None and line.get_alpha() < 0.5]
        assert len(faint) == len(labelled)  # one raw curve behind each smoothed one


def test_forest_split_by_question(committed):
    _, figures = committed
    titles = [ax.get_title(loc="left") for ax in _panels(figures["cpu10x_perplexity"].figure)]
    assert any(t.startswith("strategy against strategy at equal r") for t in titles)
    assert any(t.startswith("SVD variants") for t in titles)


def test_gallery_shows_every_committed_figure_with_its_question(committed):
    _, figures = committed
    gallery = (ROOT / "docs/FIGURES.md").read_text()
    committed_pngs = sorted(p.stem for p in PLOTS.glob("*.png"))
    assert committed_pngs == sorted(figures)  # no stale PNG, none missing
    for name, plot in figures.items():
        assert f"## {name}\n\n{plot.question}\n\n![{name}](../results/aggregate/plots/{name}.png)" in gallery
    assert "python -m mha2mla_exp.aggregate results/runs --gallery docs/FIGURES.md" in gallery
    assert "`long_context_vs_length`:" in gallery  # skipped, and why


def test_a_skipped_figure_removes_its_stale_files(tmp_path):
    for fmt in ("png", "pdf"):
        (tmp_path / "plots").mkdir(exist_ok=True)
        (tmp_path / f"plots/old.{fmt}").write_bytes(b"stale")
    assert write_artifact(SkippedPlot("old", "no data"), tmp_path) == []
    assert not list((tmp_path / "plots").iterdir())
    written = Written()
    written.skipped["old"] = "no data"
    assert "- `old`: no data" in gallery_markdown(written, tmp_path / "plots", tmp_path / "FIGURES.md")
