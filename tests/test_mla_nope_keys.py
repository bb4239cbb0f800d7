"""NoPE keys scaled by their attended rotation (mla/nope_keys.py): the statistic is what it says, each dropped
coordinate gets its readers' weighted mean cosine, kept pairs are untouched, and the option is validated and
named."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import MLASpec, ModelShape, convert_to_mla
from mha2mla_exp.mla.calibration import Calibration
from mha2mla_exp.mla.layouts import HeadPairs
from mha2mla_exp.mla.nope_keys import apply_nope_keys, nope_key_scale
from mha2mla_exp.mla.rope import ROPE_STRATEGIES

HALF = 8  # tiny models: head_dim 16


def calib_batches():
    return [torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(s)) for s in (4, 5)]


@torch.no_grad()
def test_attended_cosine_statistic_matches_brute_force():
    model = tiny_causal_lm("gqa")
    shape = ModelShape.from_config(model.config)
    calib = calib_batches()
    cosine = Calibration(model, calib, shape).get("attended_cosine")
    model.config._attn_implementation = "eager"
    theta = model.model.rotary_emb.inv_freq.double()
    total, count = torch.zeros(cosine.shape, dtype=torch.float64), 0
    for ids in calib:
        t = torch.arange(ids.shape[1], dtype=torch.float64)
        turn = torch.cos(theta * (t[:, None, None] - t[None, :, None]))  # [T, S, d_h/2]
        for i, p in enumerate(model(ids, output_attentions=True).attentions):
            total[i] += torch.einsum("bhts,tsf->hf", p.double(), turn)
        count += ids.numel()
    assert cosine.shape == (shape.num_layers, shape.num_heads, HALF)
    assert torch.allclose(cosine.double(), total / count, rtol=1e-4, atol=1e-6)
    assert (cosine <= 1 + 1e-6).all() and (cosine[..., -1] > cosine[..., 0]).all()  # the slowest pair turns least


@torch.no_grad()
def test_each_dropped_coordinate_gets_the_mean_cosine_of_the_heads_that_read_it():
    model = tiny_causal_lm("gqa")  # 4 query heads, 2 KV heads: each per-head NoPE row is read by 2 heads
    shape = ModelShape.from_config(model.config)
    calib = Calibration(model, calib_batches(), shape)
    cosine, (q_norms, _) = calib.get("attended_cosine"), calib.get("pair_norms")
    attn = model.model.layers[0].self_attn
    selection = HeadPairs([[0, 3], [1, 7]])
    plain = selection.split(attn, shape)
    attended = apply_nope_keys("attended", [plain], [selection], shape, calib)[0]
    rows = [(g, d) for g, p in enumerate(selection.pairs) for d in range(16) if d % HALF not in p]
    for j, (g, d) in enumerate(rows):
        f, heads = d % HALF, [2 * g, 2 * g + 1]
        w = q_norms[0, heads, f].double() ** 2
        expected = (w * cosine[0, heads, f].double()).sum() / w.sum()
        assert torch.allclose(attended.nope_weight[j].double(), plain.nope_weight[j].double() * expected, atol=1e-6)
    assert torch.equal(attended.rope_weight, plain.rope_weight) and torch.equal(attended.q_weight, plain.q_weight)


@torch.no_grad()
def test_rotated_coordinates_are_read_through_the_rotation(tokens):
    model = tiny_causal_lm("gqa")
    shape = ModelShape.from_config(model.config)
    calib = Calibration(model, [tokens], shape)
    calib.prefetch(ROPE_STRATEGIES.get("rorope").statistics)
    u, order = ROPE_STRATEGIES.get("rorope").ranked(shape, "product", calib)[0]
    from mha2mla_exp.mla.layouts import RotatedPairs

    selection = RotatedPairs(u, order[:3])
    freqs, readers = selection.nope_readers(shape)
    dropped = selection.dropped(shape)
    rows = selection.split(model.model.layers[0].self_attn, shape).nope_weight.shape[0]
    assert len(freqs) == rows == 2 * len(dropped)
    c, f = dropped[0]
    assert torch.allclose(readers[0], u[f, torch.tensor([0, 0, 1, 1]), c].double())
    ones = torch.ones(shape.num_heads, HALF)
    scale = nope_key_scale(selection, shape, ones * 0.5, ones)  # every head turns alike: that factor, whatever U
    assert torch.allclose(scale, torch.full_like(scale, 0.5))


@torch.no_grad()
@pytest.mark.parametrize("rope", ["2-norm", "rorope"])
def test_attended_nope_keys_leave_a_full_rope_conversion_exact_and_change_a_partial_one(rope, tokens):
    model = tiny_causal_lm("gqa")
    full = convert_to_mla(model, rope=rope, r=HALF, svd="none", nope_keys="attended", calibration=[tokens])
    assert (full(tokens).logits - model(tokens).logits).abs().max() < 1e-4
    plain = convert_to_mla(model, rope=rope, r=2, svd="joint", d_kv=8, init="bkv", calibration=[tokens])
    attended = convert_to_mla(
        model, rope=rope, r=2, svd="joint", d_kv=8, init="bkv", nope_keys="attended", calibration=[tokens]
    )
    assert (attended(tokens).logits - plain(tokens).logits).abs().max() > 1e-3
    assert attended.config.mla["nope_keys"] == "attended"


def test_nope_keys_are_validated_and_named():
    shape = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="unknown nope_keys='bogus'"):
        MLASpec.create(shape, rope="rorope", r=4, svd="joint", d_kv=16, nope_keys="bogus")
    spec = MLASpec.create(shape, rope="rorope", r=4, svd="joint", d_kv=16, init="bkv", nope_keys="attended")
    assert spec.name_parts() == ("rorope-r4-att", "joint-dkv16-bkv")
    assert {"attended_cosine", "pair_norms"} <= set(spec.statistics)
    assert "nope_keys='attended'" in spec.calibrated_fields()
    assert MLASpec.recorded({k: v for k, v in spec.to_dict().items() if k != "nope_keys"}).nope_keys == "plain"
    budget = MLASpec.create(
        shape, rope="rorope", r=None, svd="joint", init="bkv", kv_elements=72, rope_pairs=16, nope_keys="attended"
    )
    assert budget.name_parts() == ("rorope-att", "joint-kv72-p16-bkv")


def test_the_runner_takes_nope_keys_from_the_rope_group(tmp_path):
    from mha2mla_exp.runner import run, run_config
    from tests.test_runner import smoke_cfg

    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", "rope.nope_keys=attended", "train.tokens=256")
    record = run(run_config(cfg))
    assert record["status"] == "ok", record["error"]
    assert record["mla"]["nope_keys"] == "attended" and "-att__" in record["run_name"]
