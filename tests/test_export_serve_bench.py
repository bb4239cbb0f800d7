"""scripts/serve_bench.py's checks (no vLLM needed: the module imports only the standard library at the top): the
bench fails when the export's default and eager log-probs differ beyond bf16 rounding (issue 54: 1.8 before the
exact rope), when fp32 greedy tokens differ from transformers', or when the capacity is not the formula."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/serve_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(eager_shift: float = 0.0) -> dict:
    fp32 = [[-1.0, -2.0, -3.0], [-0.5, -4.0]]
    bf16 = [[-1.01, -2.0, -3.02], [-0.5, -4.01]]  # our own bf16 rounding: at most 0.02
    served = [[-1.005, -2.01, -3.0], [-0.49, -4.0]]
    eager = [[x + eager_shift * (i > 0) for i, x in enumerate(row)] for row in served]  # later positions wrong
    return {
        "reference": {"prompts": [[1, 2, 3, 4], [1, 2, 3]], "logprobs_bf16": bf16, "logprobs_fp32": fp32},
        "export": {"logprobs": served},
        "export_eager": {"logprobs": eager},
        "export_fp32": {"logprobs": fp32, "greedy": [[5, 6], [7, 8]]},
        "transformers_fp32": {"logprobs": fp32, "greedy": [[5, 6], [7, 8]]},
        "capacity_ratio": {"engine": 14.222, "formula": 14.222},
        "rope": {"cos_sin_equal_to_default": True, "mscale": 1.0},
    }


def test_checks_pass_on_a_correct_export(bench):
    checks = bench.check(report())
    assert all(c["pass"] for c in checks.values())
    assert checks["default_vs_eager_logprobs"]["tolerance"] == pytest.approx(0.04)  # twice our bf16 rounding


def test_eager_mode_off_by_the_old_rope_bug_fails(bench):
    assert not bench.check(report(eager_shift=1.8))["default_vs_eager_logprobs"]["pass"]
    assert not bench.check(report(eager_shift=0.05))["default_vs_eager_logprobs"]["pass"]  # beyond 2 x 0.02


def test_greedy_capacity_and_rope_mismatches_fail(bench):
    bad = report()
    bad["export_fp32"] = copy.deepcopy(bad["export_fp32"]) | {"greedy": [[5, 6], [7, 9]]}
    bad["capacity_ratio"] = {"engine": 13.9, "formula": 14.222}
    bad["rope"] = {"cos_sin_equal_to_default": False, "mscale": 1.0}
    checks = bench.check(bad)
    assert not checks["greedy_fp32_vllm_vs_transformers"]["pass"]
    assert checks["greedy_fp32_vllm_vs_transformers"]["equal"] == [True, False]
    assert not checks["capacity_is_the_formula"]["pass"] and not checks["rope_table_equal_to_default"]["pass"]
    failed = report()
    failed["export_eager"] = {}  # an engine that died: a failure, not a pass
    assert not bench.check(failed)["default_vs_eager_logprobs"]["pass"]
