"""One colour per method in every figure: the paper's numbers in black or grey, ours in their method's colour.

A method is what a reader compares: the original model, the full-attention fine-tune, or a partial-RoPE strategy
(with or without SVD: the SVD is drawn by hatching or marker, not by another colour). Several series of one
method in one panel (recipes, eval samples) get shades of its colour, never another method's.
"""

from __future__ import annotations

from matplotlib.colors import to_hex, to_rgb

PAPER = "black"  # the paper's points, lines and bar edges
PAPER_FILL = "0.85"  # the paper's bars
METHOD_COLORS = {
    "original": "#7f7f7f",
    "FT full attention": "#8c564b",
    "2-norm": "#1f77b4",
    "high": "#ff7f0e",
    "low": "#2ca02c",
    "uniform": "#d62728",
    "rorope": "#9467bd",
    "NoPE": "#bcbd22",
    "TransMLA": "#17becf",
}
OTHER = "#e377c2"  # a method this table does not know yet


def method_of_row(row) -> str:
    """The palette's method of a canonical row (or table row): original, FT full attention, or its RoPE strategy."""
    method = row.get("method")
    if method == "original":
        return "original"
    if method == "finetuned_full_attention" or row.get("rope") == "full":
        return "FT full attention"
    if row.get("rope") == "none":
        return "NoPE"
    return str(row.get("rope"))


def method_color(method: str) -> str:
    return METHOD_COLORS.get(method, OTHER)


def shades(method: str, n: int) -> list[str]:
    """`n` distinguishable shades of `method`'s colour, its own colour first, then darker and lighter ones."""
    base = to_rgb(method_color(method))
    out = [base]
    for i in range(1, n):
        step = (i + 1) // 2 * 0.55 / max(1, (n - 1 + 1) // 2)
        towards = (0.0, 0.0, 0.0) if i % 2 else (1.0, 1.0, 1.0)
        out.append(tuple(c + (t - c) * step for c, t in zip(base, towards)))
    return [to_hex(c) for c in out]
