"""The fine-tune recipe on a tiny model: pinned losses, precision modes (fp32 master weights), objectives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mha2mla_exp.data.rows import FiniteRows, local_rows
from mha2mla_exp.schema.fields import check_values
from mha2mla_exp.schema.sections import ObjectiveConfig, TrainConfig
from mha2mla_exp.train import (
    FineTuneRecipe,
    build_objective,
    check_epochs,
    finetune,
    plan_budget,
    precision_for,
    pretrain_share_pct,
)
from mha2mla_exp.train import precision as precision_module
from tests.conftest import tiny_causal_lm

TRAIN = {
    "tokens": 2048,
    "pretrain_share_pct": None,
    "seq_len": 16,
    "micro_batch_size": 4,
    "grad_accum": 2,
    "lr": 1e-3,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.01,
    "clip": 1.0,
    "warmup_steps": 2,
    "decay_fraction": 0.25,
    "freeze_non_attention": False,
    "checkpoint_every": 0,
    "log_every": 1,
    "divergence_factor": 4.0,
    "eval_every": 0,
    "optimizer_impl": "loop",
    "fused_loss": False,
}


def train_cfg(**changes) -> TrainConfig:
    return TrainConfig(**TRAIN | changes)


def rows(n=64, seq_len=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return FiniteRows(torch.randint(0, 97, (n, seq_len), generator=g), seed=0)


def run_recipe(tmp_path, mode="fp32", model=None, **changes):
    curve = []
    model = model or tiny_causal_lm("gqa")
    trained, record = finetune(
        model, rows(), train_cfg(**changes), tmp_path, precision=precision_for(mode, "cpu"), seed=0, on_log=curve.append
    )
    return trained, record, curve


def test_recipe_pins_its_losses_on_the_tiny_model(tmp_path):
    # the recipe's numbers (fp32, CPU): a change in data order, schedule, clipping or loss shows up here
    _, record, curve = run_recipe(tmp_path)
    losses = [row["loss"] for row in curve]
    assert record["steps"] == 2048 // (16 * 8) == len(losses)
    assert losses[:4] == pytest.approx(PINNED_FIRST_LOSSES, abs=1e-4)
    assert record["final_loss"] == pytest.approx(PINNED_FINAL_LOSS, abs=1e-4)
    assert [row["lr"] for row in curve[:3]] == pytest.approx([5e-4, 1e-3, 1e-3])  # warm-up over 2 steps


PINNED_FIRST_LOSSES = [4.5867, 4.5746, 4.6008, 4.5815]
PINNED_FINAL_LOSS = 4.3891


def test_global_batch_split_does_not_change_the_rows_read():
    source = rows(n=40)
    step = source.step_rows(3, 8)
    one = torch.cat([local_rows(step, m, 0, 1, 4) for m in range(2)])  # 1 process x 2 micro-batches
    two = torch.cat([local_rows(step, 0, p, 2, 4) for p in range(2)])  # 2 processes x 1
    four = torch.cat([local_rows(step, m, p, 2, 2) for m in range(2) for p in range(2)])  # 2 x 2 of 2 rows
    assert torch.equal(one, two) and torch.equal(one, four) and torch.equal(one, step)
    assert plan_budget(train_cfg(), pretrain_tokens=None, num_processes=2).rows_per_step == 16


# ---------------------------------------------------------------------------------------- the token budget


def test_the_one_budget_planner_gives_the_papers_share_of_pretraining():
    """SmolLM-135M, v1: 18k steps x 64 sequences x 2,048 tokens = 0.39 % of 600B, planned from conf/train/paper
    by the planner the dry run, the corpus check and the recipe share (data/ keeps no second one)."""
    import importlib.util

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mha2mla_exp.confutil import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=["train=paper", "model=smollm_135m"]))
    budget = plan_budget(cfg.train, pretrain_tokens=cfg.model.pretrain_tokens)
    assert (budget.steps, budget.rows_per_step, budget.tokens) == (18_000, 64, 2_359_296_000)
    assert pretrain_share_pct(budget.tokens, cfg.model.pretrain_tokens) == pytest.approx(0.393216)
    assert plan_budget(cfg.train, pretrain_tokens=None, num_processes=4).steps == 4_500  # the global batch grows
    shared = dataclasses.replace(cfg.train, pretrain_share_pct=0.5)
    assert plan_budget(shared, pretrain_tokens=6.0e11).steps == 22_889  # ceil(3e9 / 131,072): the share wins
    with pytest.raises(ValueError, match="needs model.pretrain_tokens"):
        plan_budget(shared, pretrain_tokens=None)
    with pytest.raises(ValueError, match="must be positive"):
        plan_budget(dataclasses.replace(cfg.train, grad_accum=0), pretrain_tokens=None)
    assert pretrain_share_pct(10, None) is None
    assert importlib.util.find_spec("mha2mla_exp.data.budget") is None


def test_budget_above_a_finite_corpus_is_refused_unless_epochs_are_allowed():
    assert check_epochs(500, 1000, False) == 0.5
    with pytest.raises(ValueError, match=r"train\.tokens: the budget of 3,000 tokens is 3\.00 passes .*allowed: 1\)"):
        check_epochs(3000, 1000, False)
    assert check_epochs(3000, 1000, True) == 3.0
    with pytest.raises(ValueError, match="allowed: 2"):
        check_epochs(3000, 1000, 2)
    assert check_epochs(10**12, None, False) is None  # a stream never repeats


def test_auto_precision_is_the_papers_recipe_on_cuda_and_measured_on_cpu(monkeypatch):
    cuda = precision_for("auto", "cuda")
    assert (cuda.mode, cuda.param_dtype, cuda.compute_dtype, cuda.optimizer_dtype) == (
        "bf16-autocast",
        torch.float32,
        torch.bfloat16,
        torch.float32,
    )
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda *a: (4.6, "probe"))
    fast = precision_for("auto", "cpu")
    assert fast.mode == "bf16-autocast" and fast.optimizer_dtype == torch.float32 and "4.60x" in fast.reason
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda *a: (0.9, "probe"))
    assert precision_for("auto", "cpu").mode == "fp32"
    with pytest.raises(ValueError, match="train.precision: unknown 'bf8'"):
        precision_for("bf8", "cpu")


def test_every_mode_keeps_fp32_master_weights_and_only_bf16_master_keeps_them_apart():
    """The docs call bf16-autocast "fp32 master weights": its weights are the master weights (fp32, updated by an
    fp32 optimizer), so it needs no separate copy; bf16-master does (bf16 weights), bf16-pure has none."""
    modes = {m: precision_for(m, "cuda") for m in ("fp32", "bf16-autocast", "bf16-master", "bf16-pure")}
    assert {m: p.optimizer_dtype for m, p in modes.items()} == {
        "fp32": torch.float32,
        "bf16-autocast": torch.float32,
        "bf16-master": torch.float32,
        "bf16-pure": torch.bfloat16,
    }
    assert {m for m, p in modes.items() if p.separate_master_copy} == {"bf16-master"}
    assert not hasattr(modes["bf16-autocast"], "master_weights")  # the name that said False for fp32 masters


@pytest.mark.parametrize("bf16_speed, full_probe", [(0.02, False), (3.0, True)])
def test_the_bf16_probe_screens_small_before_it_times_large(monkeypatch, bf16_speed, full_probe):
    calls = []

    def fake_seconds(dtype, rows, hidden, intermediate, repeats=5):
        calls.append(rows)
        return 1.0 if dtype == torch.float32 else 1.0 / bf16_speed

    monkeypatch.setattr(precision_module, "matmul_seconds", fake_seconds)
    speedup, detail = precision_module.cpu_bf16_speedup.__wrapped__(123, 456)
    assert speedup == pytest.approx(bf16_speed)
    assert calls == [precision_module.SCREEN_ROWS] * 2 + ([2048, 2048] if full_probe else [])
    assert ("screened" in detail) != full_probe


def fraction_changed(before: dict, model) -> float:
    after = model.state_dict()
    changed = total = 0
    for name, value in before.items():
        if name.endswith("weight") and value.dim() == 2:
            changed += (after[name].float() != value.float()).sum().item()
            total += value.numel()
    return changed / total


def test_master_weights_keep_the_small_updates_bf16_weights_round_away(tmp_path):
    # lr 1e-5 against weights of ~0.02: a bf16 weight's spacing there is ~1e-4, so pure-bf16 updates vanish
    start = tiny_causal_lm("gqa")
    before = {k: v.clone() for k, v in start.state_dict().items()}
    master, record, _ = run_recipe(tmp_path / "m", "bf16-master", model=tiny_causal_lm("gqa"), lr=1e-5, tokens=512)
    pure, _, _ = run_recipe(tmp_path / "p", "bf16-pure", model=tiny_causal_lm("gqa"), lr=1e-5, tokens=512)
    assert next(master.parameters()).dtype == torch.float32  # the exact master weights come back, not their rounding
    assert fraction_changed(before, master) > 0.9
    assert fraction_changed({k: v.to(torch.bfloat16) for k, v in before.items()}, pure) < 0.2
    assert record["precision"] == {
        "mode": "bf16-master",
        "param_dtype": "bfloat16",
        "compute_dtype": "bfloat16",
        "optimizer_dtype": "float32",
        "reason": "set in the config",
    }


def test_autocast_trains_fp32_weights_and_leaves_no_autocast_behind(tmp_path):
    model, record, curve = run_recipe(tmp_path, "bf16-autocast", tokens=512)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.randint(0, 97, (1, 8))
    assert model(input_ids=ids).logits.dtype == torch.float32  # evaluation outside any autocast wrapper
    assert record["precision"]["compute_dtype"] == "bfloat16" and record["precision"]["param_dtype"] == "float32"
    _, fp32, fp32_curve = run_recipe(tmp_path / "fp32", "fp32", tokens=512)
    assert curve[-1]["loss"] == pytest.approx(fp32_curve[-1]["loss"], abs=0.05)  # bf16 compute, same recipe
    assert curve[-1]["loss"] != fp32_curve[-1]["loss"]


def test_distillation_from_an_identical_teacher_starts_at_zero(tmp_path):
    student, teacher = tiny_causal_lm("gqa"), tiny_causal_lm("gqa")
    curve = []
    recipe = FineTuneRecipe(
        student,
        rows(),
        train_cfg(tokens=256, lr=1e-3),
        tmp_path,
        precision=precision_for("fp32", "cpu"),
        seed=0,
        objective=ObjectiveConfig(name="kd"),
        teacher=teacher,
        on_log=curve.append,
    )
    recipe.run()
    assert curve[0]["loss"] == pytest.approx(0.0, abs=1e-6)  # KL(p || p) = 0 before the first update


def test_objectives_mix_and_check_their_arguments():
    logits, ids = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    teacher = torch.randn(2, 6, 11)
    ce, kd = build_objective(ObjectiveConfig("ce")), build_objective(ObjectiveConfig("kd", temperature=2.0))
    half = build_objective(ObjectiveConfig("ce+kd", kd_weight=0.5, temperature=2.0))
    assert half(logits, ids, teacher) == pytest.approx(0.5 * ce(logits, ids) + 0.5 * kd(logits, ids, teacher))
    assert build_objective(ObjectiveConfig("ce+kd", kd_weight=0.0))(logits, ids, teacher) == pytest.approx(
        ce(logits, ids)
    )
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert ce(logits, ids) == pytest.approx(reference.item())
    with pytest.raises(ValueError, match="unknown objective.name=.mse."):
        build_objective(ObjectiveConfig("mse"))
    with pytest.raises(ValueError, match=r"objective: 'ce' does not take \['temperature'\]"):
        build_objective(ObjectiveConfig("ce", temperature=2.0))
    # the ranges of its arguments are the schema's, checked once at the runner's entry
    assert check_values(ObjectiveConfig("ce+kd", kd_weight=2), "objective.") == [
        "objective.kd_weight: must lie in [0, 1], got 2"
    ]
    with pytest.raises(ValueError, match="needs the original model as teacher"):
        FineTuneRecipe(
            tiny_causal_lm("gqa"),
            rows(),
            train_cfg(),
            "/tmp",
            precision=precision_for("fp32", "cpu"),
            seed=0,
            objective=ObjectiveConfig(name="kd"),
        )


def test_activation_checkpointing_recomputes_to_the_same_losses(tmp_path):
    _, plain, plain_curve = run_recipe(tmp_path / "plain")
    model, recomputed, curve = run_recipe(tmp_path / "recomputed", activation_checkpointing=True)
    assert model.model.gradient_checkpointing  # it was switched on...
    assert [r["loss"] for r in curve] == pytest.approx([r["loss"] for r in plain_curve], abs=1e-6)  # ...and is exact
    assert recomputed["final_loss"] == pytest.approx(plain["final_loss"], abs=1e-6)
