"""The GPU smoke test's CPU dry mode (issue 44): every stage runs and writes its JSON, a mismatch exits non-zero.

The dry mode is what CI can run of scripts/gpu_smoke.sh: the same stages at tiny sizes, the Triton kernel through
its interpreter, FSDP as one gloo process. On a lent GPU the same driver runs without --dry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mha2mla_exp.bench import gpu_smoke
from mha2mla_exp.runner import run_config, validate

ROOT = Path(__file__).resolve().parents[1]


def smoke(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mha2mla_exp.bench.gpu_smoke",
            "--dry",
            "--out",
            str(out),
            "--work",
            str(out / "work"),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    result = smoke(out)
    return out, result


def stage(out: Path, name: str) -> dict:
    return json.loads(gpu_smoke.stage_path(out, name).read_text())


@pytest.mark.slow
def test_the_dry_mode_passes_every_stage_and_says_so(dry_run):
    out, result = dry_run
    summary = json.loads((out / "summary.json").read_text())
    failed = {s: r for s, r in summary["stages"].items() if r["status"] != "pass"}
    assert result.returncode == 0, (failed, result.stdout[-3000:], result.stderr[-3000:])
    assert summary["ok"] is True and summary["dry"] is True
    assert list(summary["stages"]) == list(gpu_smoke.STAGES)
    for name in gpu_smoke.STAGES:
        record = stage(out, name)
        assert record["stage"] == name and record["status"] == "pass" and record["seconds"] >= 0


def test_each_stage_records_what_it_measured(dry_run):
    out, _ = dry_run
    machine = stage(out, "machine")["measurements"]
    assert machine["commit"]
    from importlib.metadata import version

    assert machine["packages"]["torch"]["version"] == version("torch")  # the versions it ran with, recorded
    assert {"triton", "transformers", "accelerate", "lm_eval"} <= set(machine["packages"])

    kernel = stage(out, "decode_kernel")["measurements"]
    assert kernel["interpreted"] is True and kernel["dtype"] == "float16"
    assert all(
        case["kernel_calls"] == 1 and case["max_abs_err_vs_fp32_reference"] <= kernel["atol"]
        for case in kernel["cases"]
    )

    train = stage(out, "train_precision")["measurements"]
    assert train["fp32"]["precision"]["mode"] == "fp32"
    assert train["bf16-autocast"]["precision"]["mode"] == "bf16-autocast"
    assert train["fp32"]["steps"] == train["bf16-autocast"]["steps"] == train["comparison"]["steps"] > 0
    assert train["fp32"]["tokens_per_s"] > 0 and train["bf16-autocast"]["tokens_per_s"] > 0
    assert train["comparison"]["end_abs_gap"] <= train["comparison"]["end_gap_bound"]

    evaluation = stage(out, "evaluation")["measurements"]
    original, converted = evaluation["original"], evaluation["converted"]
    assert original["eval_dtype"] == converted["eval_dtype"] == "float32"  # auto on the CPU
    assert {"heldout_ppl", "passkey@512", "ppl.longdoc@256"} <= set(original["scores"]) == set(converted["scores"])
    # the converted row is the bf16 twin's fine-tuned model, reused, not trained again
    assert converted["trained_model"] and Path(converted["trained_model"]).name.startswith(
        Path(train["bf16-autocast"]["run_dir"]).name.rsplit("-", 1)[0]
    )
    assert converted["kv"]["bytes_per_token_measured"] < original["kv"]["bytes_per_token_measured"]

    fsdp = stage(out, "fsdp")["measurements"]
    assert fsdp["strategy"] == "fsdp" and fsdp["processes"] == 1
    assert fsdp["against_single_process_twin"]["ok"] is True

    bench = stage(out, "decode_bench")["measurements"]
    assert {row["variant"] for row in bench["rows"]} >= {"mha", "mla", "mla_absorbed"}
    assert all(row["status"] == "ok" for row in bench["rows"])


def test_a_kernel_result_off_the_reference_fails_the_smoke(tmp_path):
    result = smoke(tmp_path, "--stages", "decode_kernel", "--decode-atol", "0")  # no error allowed: a mismatch
    assert result.returncode == 1, result.stdout[-2000:]
    record = stage(tmp_path, "decode_kernel")
    assert record["status"] == "fail" and "off the fp32 reference" in record["reason"]
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is False


def test_bf16_losses_that_leave_the_fp32_twin_fail_the_comparison():
    fp32 = {step: 5.0 - 0.01 * step for step in range(1, 41)}
    assert gpu_smoke.compare_curves(fp32, {s: v * 1.01 for s, v in fp32.items()}, rtol=0.03)["ok"]
    assert not gpu_smoke.compare_curves(fp32, {s: v * 1.05 for s, v in fp32.items()}, rtol=0.03)["ok"]
    assert not gpu_smoke.compare_curves(fp32, {**fp32, 40: float("nan")}, rtol=0.03)["ok"]
    assert not gpu_smoke.compare_curves(fp32, {s: fp32[s] for s in range(1, 30)}, rtol=0.03)["ok"]  # cut short


def test_the_loss_bound_grows_with_the_curves_own_noise():
    """Two correct runs of a random-weight model differ by their noise: a fixed 3 % could be missed by chance."""
    import random

    rng = random.Random(0)
    one, two = ({s: 5.0 - 0.01 * s + rng.gauss(0, 0.5) for s in range(1, 301)} for _ in range(2))
    cmp = gpu_smoke.compare_curves(one, two, rtol=0.03)
    assert cmp["ok"] and cmp["end_gap_bound"] > 0.03 * cmp["reference_end_loss"]
    assert cmp["end_gap_bound"] == pytest.approx(gpu_smoke.NOISE_SIGMAS * cmp["end_gap_standard_error"])
    off = {s: v + 2 * cmp["end_gap_bound"] for s, v in two.items()}  # a real gap well past the noise
    assert not gpu_smoke.compare_curves(one, off, rtol=0.03)["ok"]


def test_a_stage_past_its_time_is_recorded_as_timed_out(tmp_path):
    result = smoke(tmp_path, "--stages", "train_precision", "--budget-s", "8")
    assert result.returncode == 1
    record = stage(tmp_path, "train_precision")
    assert record["status"] == "timeout", record


@pytest.mark.parametrize("name", list(gpu_smoke.runner_runs(gpu_smoke.GPU)))
def test_the_gpu_plans_runs_are_valid_runner_configs(name, tmp_path):
    # what only a GPU runs is checked here before it costs device time: the overrides compose and validate
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[*gpu_smoke.runner_runs(gpu_smoke.GPU)[name], f"results_dir={tmp_path}"]
        )
    plan = validate(run_config(cfg))
    assert plan.training.fine_tune == (name != "original") and plan.evaluation.dtype_reason
    if cfg.eval.long_context.enabled:  # checked only at evaluation time (evaluation/long_context.py), so here
        lc = cfg.eval.long_context
        assert max([*lc.lengths, *lc.ppl_lengths]) <= cfg.model.finetune_length
    if plan.training.fine_tune:
        assert plan.training.schedule.total_steps == 300  # "a few hundred steps"
