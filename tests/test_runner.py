"""The runner end to end on a tiny model: sweep, skip on relaunch, resume after a crash, divergence."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mha2mla_exp.mla.lowrank import FACTOR_SPLIT
from mha2mla_exp.runner import run, run_config, run_dir_for, trained_model_for, validate
from tests.compositions import one_row

ROOT = Path(__file__).resolve().parents[1]


def smoke_cfg(tmp_path, row: str, *extra: str):
    """One row of experiment=smoke (conf/experiment/smoke.yaml), as its sweep launches it, with `extra` overrides."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=one_row(
                [
                    "+experiment=smoke",
                    f"results_dir={tmp_path}",
                    *extra,
                ],
                row,
            ),
        )


def launch(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "mha2mla_exp", *overrides, f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_smoke_experiment_runs_records_and_skips_on_relaunch(tmp_path):
    first = launch(tmp_path, "+experiment=smoke")
    assert first.returncode == 0, first.stderr[-3000:]
    records = sorted((tmp_path / "smoke").glob("*/results.json"))
    assert len(records) == 3, first.stdout[-2000:]
    results = {p.parent.name: json.loads(p.read_text()) for p in records}
    for name, r in results.items():
        assert r["status"] == "ok", (name, r["error"])
        assert (tmp_path / "smoke" / name / "config.yaml").exists()
        assert r["kv"]["bytes_per_token_measured"] > 0
        assert r["eval"]["perplexity"]["heldout"] > 1
        assert 1 <= r["machine"]["torch_threads"] <= os.cpu_count()  # timings depend on it
    variants = {r["variant"] for r in results.values()}
    assert variants == {"original", "partial_rope", "partial_rope+svd"}
    mla = next(r for r in results.values() if r["variant"] == "partial_rope+svd")
    assert mla["kv"]["ratio_measured"] == pytest.approx(mla["kv"]["ratio_nominal"])
    assert mla["train"]["steps"] > 0 and mla["train"]["tokens"] == mla["train"]["steps"] * 32 * 4 * 2
    assert mla["conversion"]["lowrank_factors"] == FACTOR_SPLIT  # the split its training started from
    assert "lowrank_factors" not in next(r for r in results.values() if r["variant"] == "partial_rope")["conversion"]
    curve = (
        [json.loads(line) for line in (records[0].parent / "metrics.jsonl").read_text().splitlines()]
        if (records[0].parent / "metrics.jsonl").exists()
        else []
    )
    assert all(a["step"] < b["step"] for a, b in zip(curve, curve[1:]))

    stamps = {p: p.stat().st_mtime_ns for p in records}
    second = launch(tmp_path, "+experiment=smoke")
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("already done (ok)") == 3
    assert {p: p.stat().st_mtime_ns for p in records} == stamps


def test_crashed_run_resumes_to_the_same_final_loss(tmp_path):
    extra = ("train.checkpoint_every=2", "train.tokens=4096", "train.log_every=1")
    reference = run(run_config(smoke_cfg(tmp_path / "a", "mla_2-norm_joint", *extra)))
    assert reference["status"] == "ok"

    cfg = smoke_cfg(tmp_path / "b", "mla_2-norm_joint", *extra)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(run_config(cfg), fail_at_step=5)
    run_dir, trained = run_dir_for(validate(run_config(cfg))), trained_model_for(validate(run_config(cfg)))
    crashed = json.loads((run_dir / "results.json").read_text())
    assert crashed["status"] == "failed"
    assert json.loads((trained.dir / "checkpoint" / "progress.json").read_text())["step"] == 4

    resumed = run(run_config(cfg))
    assert resumed["status"] == "ok" and resumed["resumed"] is True
    assert resumed["train"]["steps"] == reference["train"]["steps"]
    assert resumed["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-5)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, *range(1, reference["train"]["steps"] + 1)]  # probe at 0; no duplicates from the crash
    assert not (trained.dir / "checkpoint").exists() and trained.complete()  # resume point gone, weights kept


def test_recovery_probe_records_a_curve_without_changing_the_run(tmp_path):
    extra = ("train.tokens=4096", "train.log_every=1")
    plain = run(run_config(smoke_cfg(tmp_path / "a", "mla_2-norm_joint", *extra)))
    cfg = smoke_cfg(tmp_path / "b", "mla_2-norm_joint", *extra, "train.eval_every=3", "train.eval_batches=1")
    probed = run(run_config(cfg))
    assert probed["status"] == plain["status"] == "ok"
    assert probed["train"]["final_loss"] == pytest.approx(plain["train"]["final_loss"], abs=1e-6)
    rows = [
        json.loads(line) for line in (run_dir_for(validate(run_config(cfg))) / "metrics.jsonl").read_text().splitlines()
    ]
    probes = [r for r in rows if "heldout_ppl_probe" in r]
    steps = probed["train"]["steps"]
    assert [r["step"] for r in probes] == sorted({0, *range(3, steps + 1, 3), steps})  # before, every 3, last
    assert all(r["heldout_ppl_probe"] > 1 for r in probes)
    assert probes[0]["heldout_ppl_probe"] != pytest.approx(probes[-1]["heldout_ppl_probe"])
    assert [r["elapsed_s"] for r in probes] == sorted(r["elapsed_s"] for r in probes)


def test_exploding_fine_tune_is_recorded_as_diverged(tmp_path):
    exploding = ("train.lr=5.0", "train.warmup_steps=0", "train.divergence_factor=1.05", "train.tokens=8192")
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", *exploding)
    record = run(run_config(cfg))
    assert record["status"] == "diverged"
    assert "diverged at step" in record["error"]
    again = run(run_config(cfg))  # a diverged run is a result: not rerun
    assert again["status"] == "diverged"
    other_eval = run(run_config(smoke_cfg(tmp_path, "mla_2-norm_joint", *exploding, "kv_measure_tokens=32")))
    assert other_eval["status"] == "diverged" and "kept record" in other_eval["error"]  # known, not retrained


def test_invalid_config_exits_before_loading(tmp_path):
    # the smoke experiment's mla_2-norm_joint row (rope.r=2 svd.d_kv=8) with an impossible latent width
    result = launch(tmp_path, "+experiment=smoke", "hydra.mode=RUN", "rope.r=2", "svd.d_kv=999")
    assert result.returncode != 0
    assert "svd.d_kv" in result.stderr + result.stdout
    assert not list(tmp_path.glob("smoke/*/results.json"))


def local_cfg(tmp_path, folder, *extra: str):
    """A runner config for a local model folder, shape facts left to its config.json (conf/model/local.yaml)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                "+experiment=smoke",
                "model=local",
                f"model.id={folder}",
                "train=none",
                "eval=none",
                f"results_dir={tmp_path}",
                *extra,
            ],
        )


def test_a_local_folder_is_evaluated_as_an_ordinary_run(tmp_path):
    """An original model folder and a saved MLA conversion: shape facts from config.json, the conversion's
    settings from its own config (not converted again), records like every other run."""
    from mha2mla_exp.mla import convert_to_mla
    from mha2mla_exp.models import build_random_model
    from mha2mla_exp.runner.config import ConfigError
    from tests.conftest import tiny_byte_lm

    model, tokenizer = build_random_model(dataclasses.replace(tiny_byte_lm(), intermediate_size=None))
    for name, saved in (("plain", model), ("mla", convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=4))):
        saved.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)

    plan = validate(run_config(local_cfg(tmp_path / "runs", tmp_path / "plain", "variant=original")))
    assert (
        plan.conversion.shape.num_layers,
        plan.conversion.shape.num_kv_heads,
        plan.conversion.shape.head_dim,
        plan.conversion.spec,
    ) == (2, 2, 16, None)
    with pytest.raises(ConfigError, match="variant=mla"):
        validate(run_config(local_cfg(tmp_path / "runs", tmp_path / "mla", "variant=original")))

    record = run(run_config(local_cfg(tmp_path / "runs", tmp_path / "mla", "variant=mla")))
    assert record["status"] == "ok" and record["variant"] == "partial_rope+svd"
    assert {k: record["mla"][k] for k in ("rope", "r", "svd", "d_kv")} == {
        "rope": "high",
        "r": 2,
        "svd": "joint",
        "d_kv": 4,
    }
    assert record["kv"]["ratio_measured"] == pytest.approx((2 * 2 + 4) / (2 * 16))  # the saved latent's bytes
    assert record["train"] is None and record["eval"]["perplexity"]["heldout"] > 1


def test_an_auto_precision_relaunch_resumes_in_the_mode_it_started_in_whatever_the_probe_says(tmp_path, monkeypatch):
    from mha2mla_exp.train import precision as precision_module

    extra = ("train.precision=auto", "train.checkpoint_every=2", "train.tokens=2048")
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda *a: (4.6, "probe"))  # bf16 pays here
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", *extra)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(run_config(cfg), fail_at_step=3)
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda *a: (1.2, "probe"))  # a busier machine
    assert validate(run_config(cfg)).training.precision.mode == "fp32"  # what a fresh run would now choose
    resumed = run(run_config(cfg))
    assert resumed["status"] == "ok" and resumed["resumed"] is True
    assert resumed["train"]["precision"]["mode"] == "bf16-autocast" and resumed["train"]["resumed_from_step"] == 2
    assert "earlier work" in resumed["train"]["precision"]["reason"]
    assert len(list((tmp_path / "smoke").glob("*/results.json"))) == 1  # one run, not a second one in fp32


def test_a_deferring_cell_ends_at_once_while_another_process_makes_its_trained_model(tmp_path):
    from omegaconf import OmegaConf

    from mha2mla_exp.runner.sweep import SweepFailed, SweepSummary

    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", "trained_model_busy=defer")
    trained = trained_model_for(validate(run_config(cfg)))
    trained.dir.mkdir(parents=True)
    with trained.lock():  # what a parallel cell holds while it fine-tunes
        deferred = run(run_config(cfg))
    assert deferred["status"] == "deferred" and "relaunch" in deferred["error"]
    assert deferred["train"] is None and not trained.complete()  # nothing trained, nothing waited for
    done = run(run_config(cfg))  # the relaunch: the lock is free, so this cell makes the model
    assert done["status"] == "ok" and trained.complete()

    cells = tmp_path / "sweep"
    cells.mkdir()
    (cells / "cells.jsonl").write_text(
        '{"cell": 0, "overrides": "a", "status": "ok"}\n{"cell": 1, "overrides": "b", "status": "deferred"}\n'
    )
    with pytest.raises(SweepFailed, match="1 cells deferred"):  # the sweep is not complete: no exit 0
        SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(cells)}}}))
