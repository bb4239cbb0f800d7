"""Write a table as CSV, Markdown and LaTeX. Empty cells are written empty, never as "nan"."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def display_frame(table: pd.DataFrame) -> pd.DataFrame:
    """Every cell as text: floats with the paper's two decimals, missing values as ''."""
    def cell(value):
        if value is None or (not isinstance(value, str) and pd.isna(value)):
            return ""
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)
    return pd.DataFrame({column: [cell(v) for v in table[column]] for column in table.columns},
                        columns=table.columns)


def to_markdown(table: pd.DataFrame) -> str:
    text = display_frame(table)
    try:
        return text.to_markdown(index=False, disable_numparse=True)
    except ImportError:  # pandas needs the optional `tabulate` for this; a plain pipe table says the same
        return _pipe_table(text)


def _pipe_table(text: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, text.columns)) + " |", "|" + "|".join("---" for _ in text.columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in text.itertuples(index=False)]
    return "\n".join(lines)


def to_latex(table: pd.DataFrame) -> str:
    text = display_frame(table)
    try:
        return text.to_latex(index=False, escape=True)
    except ImportError:  # pandas needs the optional `jinja2` for this
        return _tabular(text)


def _tabular(text: pd.DataFrame) -> str:
    def escape(value: str) -> str:
        for char in "\\&%$#_{}":
            value = value.replace(char, "\\" + char)
        return value
    lines = [r"\begin{tabular}{" + "l" * len(text.columns) + "}", r"\toprule",
             " & ".join(escape(str(c)) for c in text.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(escape(v) for v in row) + r" \\" for row in text.itertuples(index=False)]
    return "\n".join(lines + [r"\bottomrule", r"\end{tabular}", ""])


def write_table(table: pd.DataFrame, out_dir: Path, name: str, title: str = "", note: str = "") -> list[Path]:
    """`name`.csv, `name`.md and `name`.tex under `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.csv", out_dir / f"{name}.md", out_dir / f"{name}.tex"]
    table.to_csv(paths[0], index=False)
    header = [f"# {title}" if title else "", note]
    paths[1].write_text("\n\n".join(part for part in header if part) + "\n\n" + to_markdown(table) + "\n")
    paths[2].write_text(to_latex(table))
    return paths
