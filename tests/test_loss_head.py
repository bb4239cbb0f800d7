"""The step's fast paths equal the plain one: the chunked loss (train/loss_head.py) gives the plain path's loss and
gradients for every objective and precision, and the three AdamW implementations make the same updates."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mha2mla_exp.schema.fields import check_values, is_observer
from mha2mla_exp.schema.sections import ObjectiveConfig, TrainConfig
from mha2mla_exp.train import build_objective, finetune, precision_for
from mha2mla_exp.train.loss_head import ChunkedLoss, LogitsLoss, loss_head_for
from mha2mla_exp.train.optimizer import adamw
from tests.conftest import tiny_causal_lm
from tests.test_train_recipe import rows, train_cfg

OBJECTIVES = [ObjectiveConfig("ce"), ObjectiveConfig("kd", temperature=2.0), ObjectiveConfig("ce+kd", kd_weight=0.3)]


def loss_and_grads(model, loss_head, objective, batch, teacher=None, autocast=False):
    model.zero_grad(set_to_none=True)
    teacher_outputs = None
    if teacher is not None:
        with torch.no_grad():
            teacher_outputs = loss_head.teacher_outputs(teacher, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_head(model, batch, objective, teacher_outputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: o.name)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_chunked_loss_gives_the_plain_loss_and_gradients(objective, tie):
    model, teacher = tiny_causal_lm("gqa", tie=tie), tiny_causal_lm("gqa", seed=1, tie=tie).eval()
    batch = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    objective = build_objective(objective)
    teacher = teacher if objective.needs_teacher else None
    plain_loss, plain = loss_and_grads(model, LogitsLoss(), objective, batch, teacher)
    # 30 scored positions in chunks of 7: the last chunk is short
    fused_loss, fused = loss_and_grads(
        model, ChunkedLoss(model.model, model.lm_head, chunk_rows=7), objective, batch, teacher
    )
    assert fused_loss.item() == pytest.approx(plain_loss.item(), rel=1e-5, abs=1e-7)
    for name, grad in plain.items():
        assert torch.allclose(fused[name], grad, rtol=1e-4, atol=1e-6), name
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"  # a tied head: one parameter, both gradients
    assert plain[head].abs().sum() > 0 and plain["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("objective", OBJECTIVES[::2], ids=lambda o: o.name)
def test_chunked_loss_under_bf16_autocast_matches_the_plain_path(objective):
    model, teacher = tiny_causal_lm("gqa"), tiny_causal_lm("gqa", seed=1).eval()
    batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    objective = build_objective(objective)
    teacher = teacher if objective.needs_teacher else None
    plain_loss, plain = loss_and_grads(model, LogitsLoss(), objective, batch, teacher, autocast=True)
    fused_loss, fused = loss_and_grads(
        model, ChunkedLoss(model.model, model.lm_head, chunk_rows=8), objective, batch, teacher, autocast=True
    )
    assert fused_loss.item() == pytest.approx(plain_loss.item(), rel=1e-3)
    for name, grad in plain.items():  # bf16 products (8 mantissa bits) summed in another order
        cos = torch.nn.functional.cosine_similarity(fused[name].flatten(), grad.flatten(), dim=0)
        assert cos > 0.999, (name, cos.item())
        assert torch.allclose(fused[name].norm(), grad.norm(), rtol=2e-2), name


@pytest.mark.parametrize("mode", ["fp32", "bf16-master"])
def test_recipe_trains_to_the_same_losses_on_either_path(tmp_path, mode):
    curves = {}
    for fused in (False, True):
        curve = []
        finetune(
            tiny_causal_lm("gqa"),
            rows(),
            train_cfg(fused_loss=fused, tokens=1024),
            tmp_path / str(fused),
            precision=precision_for(mode, "cpu"),
            seed=0,
            on_log=curve.append,
        )
        curves[fused] = [row["loss"] for row in curve]
    tolerance = 1e-5 if mode == "fp32" else 2e-2
    assert curves[True] == pytest.approx(curves[False], abs=tolerance)
    assert len(curves[True]) == 8 and curves[True][-1] < curves[True][0]


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_implementations_make_the_same_updates(impl, dtype):
    lr = 1e-2
    reference = tiny_causal_lm("gqa").to(dtype)
    other = copy.deepcopy(reference)
    batch = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizers = {}
    for name, model in (("loop", reference), (impl, other)):
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizers[name] = adamw(groups, TrainConfig(lr=lr, betas=[0.9, 0.95], eps=1e-8, optimizer_impl=name))
    for _ in range(3 if dtype == torch.float32 else 1):  # in bf16 a rounding apart changes the next gradient
        for name, model in (("loop", reference), (impl, other)):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
    # bf16 weights: fused computes the update in fp32 and rounds once, the loop rounds every term; they may differ
    # by the weight's last two bits (2 ** -6 relative) plus one step's size (lr)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-6, "atol": lr}
    moved = 0
    for (name, a), b in zip(reference.named_parameters(), other.parameters()):
        assert torch.allclose(a.float(), b.float(), **tolerance), name
        moved += int(not torch.equal(a, tiny_causal_lm("gqa").to(dtype).get_parameter(name)))
    assert moved > 0


def test_fast_path_settings_are_checked_and_stay_out_of_the_identity():
    assert check_values(TrainConfig(optimizer_impl="adam8bit"), "train.") == [
        "train.optimizer_impl: expected one of fused, foreach, loop, got 'adam8bit'"
    ]  # the schema's, at entry

    class NoHead(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="train.fused_loss: NoHead has no bias-free lm_head"):
        loss_head_for(NoHead(), fused=True)
    assert isinstance(loss_head_for(NoHead(), fused=False), LogitsLoss)
    observers = {f.name for f in dataclasses.fields(TrainConfig) if is_observer(f)}
    assert {"fused_loss", "optimizer_impl"} <= observers  # the same numbers: in no run's identity


def test_the_record_says_which_path_ran(tmp_path):
    _, record = finetune(
        tiny_causal_lm("gqa"),
        rows(),
        train_cfg(fused_loss=True, optimizer_impl="fused", tokens=256),
        tmp_path,
        precision=precision_for("fp32", "cpu"),
        seed=0,
    )
    assert (record["loss_path"], record["optimizer_impl"]) == ("chunked", "fused")


def test_compiled_decoder_trains_to_the_eager_losses_on_the_fused_path(tmp_path):
    curves = {}
    for compiled in (False, True):
        curve = []
        trained, record = finetune(
            tiny_causal_lm("gqa"),
            rows(),
            train_cfg(fused_loss=True, compile=compiled, tokens=512),
            tmp_path / str(compiled),
            precision=precision_for("fp32", "cpu"),
            seed=0,
            on_log=curve.append,
        )
        curves[compiled] = [row["loss"] for row in curve]
        assert "forward" not in vars(trained.model) and record["compiled"] is compiled  # evaluation runs eager
    assert curves[True] == pytest.approx(curves[False], abs=1e-4)
