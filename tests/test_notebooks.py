"""The notebooks run top to bottom headless: on the fixture runs, and with no runs at all (a clean checkout).

Both passes share one kernel, because importing the package (torch, transformers) is most of the cost.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
FIXTURES_ROOT = Path(__file__).resolve().parent / "fixtures"  # the runs are under <root>/runs


def outputs(notebook) -> tuple[str, list[str]]:
    """All text the notebook printed or displayed, and the MIME types of its rich outputs."""
    texts, kinds = [], []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", "") + out.get("data", {}).get("text/plain", ""))
            kinds += list(out.get("data", {}))
    return "\n".join(texts), kinds


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """compression_vs_performance.ipynb run on the fixtures (via $MHA2MLA_RESULTS) and on an empty root."""
    empty_root = tmp_path_factory.mktemp("no_results")
    template = nbformat.read(NOTEBOOKS / "compression_vs_performance.ipynb", as_version=4)
    client = NotebookClient(
        copy.deepcopy(template), timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    runs = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MHA2MLA_RESULTS", str(FIXTURES_ROOT))  # the kernel inherits it at start
        with client.setup_kernel():
            for name, root in (("fixtures", None), ("empty", empty_root)):
                notebook = copy.deepcopy(template)
                if root is not None:
                    client.execute_cell(new_code_cell(f"import os; os.environ['MHA2MLA_RESULTS'] = {str(root)!r}"), 0)
                for index, cell in enumerate(notebook.cells):
                    client.execute_cell(cell, index)  # raises CellExecutionError on any error
                runs[name] = notebook
    return runs


def test_notebook_on_fixture_runs(executed):
    text, kinds = outputs(executed["fixtures"])
    assert f"12 runs under {FIXTURES_ROOT / 'runs'}, 10 with status ok" in text
    assert kinds.count("image/png") == 2  # the Table 1 trade-off and the Table 2 scatter
    assert "RuntimeError: out of memory" in text and "diverged" in text  # failed runs are listed
    exchange = next(c for c in executed["fixtures"].cells if "points_lost_per_10pct" in c.source)
    assert "0.43" in exchange.outputs[0]["data"]["text/plain"]  # ours: 3.5 points for 81.25% saved


def test_headline_first_picked_by_parameters(executed):
    notebook = executed["fixtures"]
    parameters = notebook.cells[1]
    assert "parameters" in parameters.metadata.get("tags", [])  # papermill -p MODEL ... -p BUDGET ...
    assert "MODEL = None" in parameters.source and "BUDGET = None" in parameters.source
    first_image = next(c for c in notebook.cells if any("image/png" in o.get("data", {}) for o in c.get("outputs", [])))
    assert "kv_memory_vs_avg(table1, [MODEL] if MODEL else None, [BUDGET] if BUDGET else None" in first_image.source


def test_notebook_without_runs(executed):
    text, kinds = outputs(executed["empty"])
    assert "0 runs under" in text
    assert kinds.count("image/png") == 2  # the paper's points still drawn
    assert "135M SmolLM" in text


def test_committed_notebooks_have_no_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), path
