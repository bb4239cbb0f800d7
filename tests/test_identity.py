"""A run's identity: what changes the numbers is in its hash (device, precision, global batch), what only
observes it is not (logging, checkpoint cadence, probes, a disabled block); the trained model and its
evaluation have separate identities."""

from __future__ import annotations

import pytest
import torch

from mha2mla_exp.runner import run_config, validate
from tests.test_runner import smoke_cfg

BASE = ("train.precision=fp32",)


def plan(*overrides, tmp="/tmp/identity"):
    from pathlib import Path

    return validate(run_config(smoke_cfg(Path(tmp), "mla_2-norm_joint", *BASE, *overrides)))


@pytest.mark.parametrize(
    "observer",
    [
        "train.log_every=5",
        "train.checkpoint_every=7",
        "train.eval_every=3",
        "train.eval_batches=9",
        "train.epochs_allowed=true",
        "distill.lr=0.5",
        "distill.epochs=9",
        "logger=wandb_offline",
        "model.paper_name=renamed",
    ],
)
def test_observers_change_no_identity(observer):
    base, observed = plan(), plan(observer)
    assert (observed.identity.trained_hash, observed.identity.eval_hash) == (
        base.identity.trained_hash,
        base.identity.eval_hash,
    ), observer


@pytest.mark.parametrize(
    "setting, which",
    [
        ("train.lr=2e-4", "trained"),
        ("train.tokens=4096", "trained"),
        ("seed=1", "trained"),
        ("svd.d_kv=4", "trained"),
        ("distill.enabled=true", "trained"),
        ("objective=kd", "trained"),
        ("train.precision=bf16-master", "trained"),
        ("train.freeze_non_attention=true", "trained"),
        ("kv_quant=hqq4", "eval"),
        ("eval.perplexity.max_batches=1", "eval"),
        ("kv_measure_tokens=32", "eval"),
    ],
)
def test_what_changes_the_numbers_changes_the_right_identity(setting, which):
    base, changed = plan(), plan(setting)
    assert (changed.identity.trained_hash != base.identity.trained_hash) == (which == "trained"), setting
    assert (changed.identity.eval_hash != base.identity.eval_hash) == (which == "eval"), setting
    assert changed.identity.run_hash != base.identity.run_hash


def test_the_global_batch_is_the_identity_not_its_split():
    assert (
        plan("train.micro_batch_size=2", "train.grad_accum=4").identity.trained_hash == plan().identity.trained_hash
    )  # 8 rows either way
    four_rows = plan("train.micro_batch_size=2", "train.grad_accum=2")
    assert four_rows.identity.trained_hash != plan().identity.trained_hash


def test_device_and_precision_are_part_of_the_trained_identity(monkeypatch):
    cpu = plan("train.precision=auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = plan("train.precision=auto")
    assert cuda.launch.device_type == "cuda" and cuda.training.precision.mode == "bf16-autocast"
    assert cuda.identity.trained_hash != cpu.identity.trained_hash
    assert cuda.evaluation.dtype == "bfloat16" and cpu.evaluation.dtype == "float32"


@pytest.mark.parametrize("bf16_speed, chosen", [(0.02, "float32"), (4.6, "bfloat16")])
def test_eval_dtype_fastest_measures_on_cpu_and_is_identified_by_what_it_chose(monkeypatch, bf16_speed, chosen):
    """`eval.dtype=fastest` (commonsense_500's): bf16 only where bf16 matmuls measure fast on this CPU (an
    AVX2-only EPYC runs them ~45x slower), and the same run as the dtype it resolved to, written out."""
    from mha2mla_exp.train import precision as precision_module

    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda *a: (bf16_speed, "probe"))
    fastest = plan("eval.dtype=fastest")
    assert fastest.evaluation.dtype == chosen and f"{bf16_speed:.2f}x" in fastest.evaluation.dtype_reason
    assert fastest.identity.eval_hash == plan(f"eval.dtype={chosen}").identity.eval_hash
    assert plan("eval.dtype=auto").identity.eval_hash == plan().identity.eval_hash  # `auto` is what no key meant
    assert plan("eval.dtype=auto").evaluation.dtype == "float32"  # on CPU, measured or not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plan("eval.dtype=fastest").evaluation.dtype == "bfloat16"


def test_an_untrained_model_is_the_same_in_any_training_precision():
    a = validate(run_config(smoke_cfg("/tmp/identity", "original", "train.precision=fp32")))
    b = validate(run_config(smoke_cfg("/tmp/identity", "original", "train.precision=bf16-master", "train.lr=1.0")))
    assert a.identity.trained_hash == b.identity.trained_hash and not a.training.trains


def test_trained_names_say_what_was_trained_and_how():
    p = plan("objective=kd", "train.freeze_non_attention=true", "train.precision=bf16-master")
    assert p.identity.trained_name.endswith("__ft2.048k-kd-attn-lr0.0003-bf16m__s0")  # lr: not the paper's


def test_the_split_of_whitened_factors_is_part_of_what_a_fine_tune_starts_from(monkeypatch):
    import mha2mla_exp.runner.config as identity  # where the plan reads the split from (mla.lowrank)

    def hashes(*overrides):
        p = plan("svd.init=activation", *overrides)
        return p.identity.trained_hash, p.identity.conversion_hash

    trained, conversion = hashes()
    monkeypatch.setattr(identity, "FACTOR_SPLIT", "another-split")
    assert hashes() != (trained, conversion) and hashes()[1] != conversion  # the kept conversion too
    zero_shot = validate(
        run_config(smoke_cfg("/tmp/identity", "mla_2-norm_joint", "svd.init=activation", "train=none"))
    )
    monkeypatch.setattr(identity, "FACTOR_SPLIT", "per-direction-norm")
    assert (
        validate(
            run_config(smoke_cfg("/tmp/identity", "mla_2-norm_joint", "svd.init=activation", "train=none"))
        ).identity.trained_hash
        == zero_shot.identity.trained_hash
    )  # same product, same numbers
