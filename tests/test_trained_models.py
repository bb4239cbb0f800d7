"""Trained weights are kept before evaluation and reused by every later evaluation of the same trained model;
budgets that would repeat a finite corpus are refused before loading; streamed data trains and resumes exactly."""

from __future__ import annotations

import importlib
import json

import pytest

from mha2mla_exp.runner import ConfigError, run, run_config, run_dir_for, stages, trained_model_for, validate
from tests.test_runner import smoke_cfg

run_module = importlib.import_module("mha2mla_exp.runner.run")  # the module (the package exports its function)

FAST = ("train.tokens=2048", "train.precision=fp32")


def test_a_failed_evaluation_keeps_the_weights_and_a_relaunch_reuses_them(tmp_path, monkeypatch):
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", *FAST)
    real_evaluate = stages.evaluate

    def broken(*args, **kwargs):
        raise RuntimeError("the benchmark crashed")

    monkeypatch.setattr(stages, "evaluate", broken)
    with pytest.raises(RuntimeError, match="the benchmark crashed"):
        run(run_config(cfg))
    plan = validate(run_config(cfg))
    trained = trained_model_for(plan)
    assert trained.complete()  # saved before the evaluation started
    assert json.loads((run_dir_for(plan) / "results.json").read_text())["status"] == "failed"

    def no_training(*args, **kwargs):
        raise AssertionError("a kept trained model must not be trained again")

    monkeypatch.setattr(stages, "evaluate", real_evaluate)
    monkeypatch.setattr(run_module, "finetune", no_training)
    again = run(run_config(cfg))
    assert again["status"] == "ok" and again["reused_trained_model"] is True
    assert again["train"]["steps"] == 2048 // (32 * 8)
    assert (run_dir_for(plan) / "metrics.jsonl").read_text() == trained.metrics_path.read_text()

    # a new evaluation of the same trained model is a new run that reuses the weights too
    other = smoke_cfg(tmp_path, "mla_2-norm_joint", *FAST, "eval.perplexity.max_batches=1", "kv_measure_tokens=32")
    other_plan = validate(run_config(other))
    assert (
        other_plan.identity.trained_hash == plan.identity.trained_hash
        and other_plan.identity.eval_hash != plan.identity.eval_hash
    )
    record = run(run_config(other))
    assert record["status"] == "ok" and record["reused_trained_model"] is True
    assert record["eval"]["perplexity"]["heldout"] != again["eval"]["perplexity"]["heldout"]  # fewer rows


def test_weights_of_a_trained_model_load_back_to_the_same_evaluation(tmp_path):
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", *FAST)
    first = run(run_config(cfg))
    plan = validate(run_config(cfg))
    (run_dir_for(plan) / "results.json").unlink()  # forget the evaluation, keep the trained model
    second = run(run_config(cfg))
    assert second["reused_trained_model"] is True
    assert second["eval"]["perplexity"]["heldout"] == pytest.approx(first["eval"]["perplexity"]["heldout"], rel=1e-6)
    assert second["kv"]["bytes_per_token_measured"] == first["kv"]["bytes_per_token_measured"]
    # the reused record says what the kept model is and what it cost, as the run that trained it did
    assert second["conversion"] == first["conversion"] and second["conversion"]["rope_layout"]
    assert second["timings"]["train_s"] == first["timings"]["train_s"] > 0


def test_a_budget_that_would_repeat_the_corpus_is_refused_before_loading(tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("no weight may be loaded for a refused budget")

    monkeypatch.setattr(stages, "load", no_loading)
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", "train.tokens=10000000")
    with pytest.raises(ConfigError, match=r"train\.tokens: the budget of 10,000,\d+ tokens is [\d.]+ passes"):
        run(run_config(cfg))
    assert not list(tmp_path.rglob("results.json"))
    monkeypatch.undo()
    allowed = run(
        run_config(
            smoke_cfg(
                tmp_path,
                "mla_2-norm_joint",
                "train.tokens=400000",
                "train.epochs_allowed=true",
                "train.seq_len=128",
                "train.checkpoint_every=0",
                "train.precision=fp32",
            )
        )
    )
    assert allowed["status"] == "ok"
    assert allowed["train"]["data"]["epochs"] > 1 and allowed["train"]["data"]["fresh_tokens"] is False


def streamed_cfg(tmp_path, *extra):
    import random

    rng = random.Random(0)
    words = ["union", "state", "congress", "nation", "peace", "law", "trade", "people", "year", "the", "of"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "corpus.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))}) + "\n"
            for _ in range(600)
        )
    )
    mixture = f'[{{name: toy, path: json, data_files: "{path}", weight: 1.0, text_field: text}}]'
    return smoke_cfg(
        tmp_path / "runs",
        "mla_2-norm_joint",
        "data=smollm_corpus",
        f"data.mixture={mixture}",
        "data.held_out_documents=40",
        "data.seq_len=32",
        "data.max_documents=null",
        *extra,
    )


def test_a_streamed_corpus_trains_on_fresh_rows_and_resumes_exactly(tmp_path):
    extra = ("train.tokens=4096", "train.checkpoint_every=2", "train.precision=fp32")
    reference = run(run_config(streamed_cfg(tmp_path / "a", *extra)))
    assert reference["status"] == "ok" and reference["data"]["streamed"] is True
    read = reference["train"]["data"].pop("mixture_read")  # the one part: every token read is its
    assert reference["train"]["data"] == {"rows_read": 128, "epochs": None, "fresh_tokens": True}
    assert read["token_shares_read"] == {"toy": 1.0} and read["tokens_read"]["toy"] >= 128 * 32

    cfg = streamed_cfg(tmp_path / "b", *extra)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(run_config(cfg), fail_at_step=5)
    resumed = run(run_config(cfg))
    assert resumed["status"] == "ok" and resumed["resumed"] is True
    assert resumed["train"]["final_loss"] == pytest.approx(reference["train"]["final_loss"], abs=1e-6)
    assert resumed["eval"]["perplexity"]["heldout"] == pytest.approx(
        reference["eval"]["perplexity"]["heldout"], rel=1e-6
    )


def test_a_run_that_trains_loads_fp32_master_weights_even_where_auto_means_bf16(monkeypatch, tmp_path):
    import torch

    from mha2mla_exp import models

    seen = []
    monkeypatch.setattr(models, "load_model", lambda cfg, device=None, dtype=None: seen.append(dtype))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    trains = validate(run_config(smoke_cfg(tmp_path, "mla_2-norm_joint", "train.precision=auto", "model.dtype=auto")))
    evaluates = validate(run_config(smoke_cfg(tmp_path, "original", "model.dtype=auto")))
    assert (
        trains.training.precision.param_dtype == torch.float32
        and trains.training.precision.compute_dtype == torch.bfloat16
    )
    for plan in (trains, evaluates):
        model, cpu = plan.config.model, torch.device("cpu")
        stages.load(model, plan.evaluation.placement(cpu), cpu)
    # trained: fp32 masters (bf16 only as compute); evaluated only: fp32 too, cast to bf16 for the suites as every
    # other row is (evaluation/placement.py: the same perplexity precision and rotary phases for every row)
    assert seen == [torch.float32, torch.float32]


def test_recipes_from_one_conversion_convert_once_and_train_as_from_a_fresh_one(tmp_path, monkeypatch):
    fresh = run(run_config(smoke_cfg(tmp_path / "a", "mla_2-norm_joint", *FAST, "train.lr=1e-3")))
    assert "reused_conversion" not in fresh
    run(
        run_config(smoke_cfg(tmp_path / "b", "mla_2-norm_joint", *FAST))
    )  # another recipe: converts and keeps the conversion

    def no_conversion(*args, **kwargs):
        raise AssertionError("the kept conversion must be reused")

    monkeypatch.setattr(stages, "convert", no_conversion)
    reused = run(run_config(smoke_cfg(tmp_path / "b", "mla_2-norm_joint", *FAST, "train.lr=1e-3")))
    assert reused["reused_conversion"].endswith(
        "__converted-"
        + validate(run_config(smoke_cfg(tmp_path / "b", "mla_2-norm_joint", *FAST))).identity.conversion_hash
    )
    assert reused["train"]["final_loss"] == pytest.approx(fresh["train"]["final_loss"], abs=1e-6)
    assert reused["rope_pairs"] == fresh["rope_pairs"]
    assert reused["model"]["params_original"] == fresh["model"]["params_original"]
