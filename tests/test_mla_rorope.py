"""RoRoPE (mla/rope/rorope.py, layout 'shared' in mla/layouts.py): exact where it must be, and it finds what
a per-head selection cannot. Cache bytes, absorbed decoding and the kernel are covered with the other layouts
in test_mla_cache.py and test_kernels.py; remote-code loading in test_mla_remote_code.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from transformers import AutoModelForCausalLM

from mha2mla_exp.mla import ModelShape, convert_to_mla, max_d_kv
from mha2mla_exp.mla.layouts import RotatedPairs
from mha2mla_exp.mla.rope.rorope import principal_axes, rotated_pair_scores

HALF = 8  # tiny models: head_dim 16


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_full_budget_reproduces_the_original(tiny_model, tokens):
    """Every (component, frequency) pair keeps RoPE: the rotation alone, which commutes with RoPE."""
    ref = tiny_model(tokens).logits
    calib = [tokens.flip(1)]
    plain = convert_to_mla(tiny_model, rope="rorope", r=HALF, svd="none", calibration=calib)
    assert plain.config.rope_layout == "shared" and len(plain.config.rope_pairs[0]) == 1
    assert max_diff(plain(tokens).logits, ref) < 1e-4
    d_kv = max_d_kv(ModelShape.from_config(tiny_model.config), HALF, "joint")
    low_rank = convert_to_mla(
        tiny_model, rope="rorope", r=HALF, svd="joint", d_kv=d_kv, init="output", calibration=calib
    )
    assert max_diff(low_rank(tokens).logits, ref) < 1e-4


@torch.no_grad()
def test_no_pair_kept_is_nope(tiny_model, tokens):
    nope = convert_to_mla(tiny_model, rope="none", svd="none")(tokens).logits
    rotated = convert_to_mla(tiny_model, rope="rorope", r=0, svd="none", calibration=[tokens])(tokens).logits
    assert max_diff(rotated, nope) < 1e-4


@torch.no_grad()
def test_correlated_heads_keep_all_positional_energy_where_per_head_pairs_cannot(tokens):
    """KV head 1's keys are 2x head 0's: per frequency one principal component carries everything, so with
    n_kv*r = d_h/2 kept pairs RoRoPE keeps all of it (exact), while any per-head choice of r pairs drops some."""
    model = tiny_causal_lm("gqa")
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight.view(2, 16, -1)
            w[1] = 2 * w[0]
    ref = model(tokens).logits
    rotated = convert_to_mla(model, rope="rorope", r=HALF // 2, svd="none", calibration=[tokens])
    assert rotated.config.rope_pairs[0] == [list(range(HALF))]  # every frequency, once: the first component
    assert max_diff(rotated(tokens).logits, ref) < 1e-4
    per_head = convert_to_mla(model, rope="2-norm", r=HALF // 2, svd="none", calibration=[tokens])
    assert max_diff(per_head(tokens).logits, ref) > 1e-3


def test_principal_axes_and_scores():
    moments = torch.tensor([[[1.0, 0.0], [0.0, 4.0]], [[2.0, 2.0], [2.0, 2.0]]], dtype=torch.float64)  # 2 freqs
    u = principal_axes(moments)
    assert torch.allclose(u.transpose(1, 2) @ u, torch.eye(2, dtype=torch.float64).expand(2, 2, 2))
    assert torch.allclose(u[0, :, 0].abs(), torch.tensor([0.0, 1.0], dtype=torch.float64))  # largest first
    assert torch.allclose(u[1, :, 0].abs(), torch.tensor([0.5**0.5] * 2, dtype=torch.float64))
    # 4 query heads over 2 KV heads: head h meets pair (c, f) with |U_f[g(h), c]| ||q_{h,f}||
    q = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 0.0], [3.0, 0.0]])
    k = torch.tensor([[1.0, 1.0], [10.0, 0.5]])
    product = rotated_pair_scores(q, k, u, "product")
    assert product.shape == (2, 2)
    # frequency 0, U = swap (up to sign): component 0 is KV head 1's axis, met by query heads 2 and 3
    assert product[0, 0].item() == pytest.approx((3 + 3) * 1.0)
    assert product[1, 0].item() == pytest.approx((1 + 1) * 10.0)
    total = rotated_pair_scores(q, k, u, "sum")
    assert total[1, 0].item() == pytest.approx((1 + 1) + 4 * 10.0)


@torch.no_grad()
def test_selection_is_the_budget_and_round_trips(tmp_path, tokens):
    model = tiny_causal_lm("qwen2")
    mla = convert_to_mla(model, rope="rorope", r=3, svd="split", d_kv=6, calibration=[tokens])
    shape = ModelShape.from_config(model.config)
    for pairs in mla.config.rope_pairs:
        assert len(pairs) == 1 and len(pairs[0]) == shape.num_kv_heads * 3  # n_kv*r pairs in one rope key
    attn = mla.model.layers[0].self_attn
    assert attn.k_rope_proj.out_features == shape.num_kv_heads * 2 * 3  # the same cache as per-head r=3
    assert attn.q_rope_scale.shape == (shape.num_heads, shape.num_kv_heads * 3)
    mla.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_layout == "shared" and loaded.config.rope_pairs == mla.config.rope_pairs
    assert max_diff(loaded(tokens).logits, mla(tokens).logits) == 0


def test_rotated_split_keeps_exactly_the_key_space():
    """The rope rows and the compact NoPE rows are an orthogonal change of basis of W_k, and the NoPE
    embedding maps the compact rows back to the projected keys P k (orthonormal columns)."""
    model = tiny_causal_lm("qwen2")
    shape = ModelShape.from_config(model.config)
    torch.manual_seed(0)
    u = torch.linalg.qr(torch.randn(HALF, 2, 2, dtype=torch.float64))[0]
    kept = [(0, 1), (1, 1), (1, 5)]
    split = RotatedPairs(u, kept).split(model.model.layers[0].self_attn, shape)
    w_k = model.model.layers[0].self_attn.k_proj.weight.double()
    rows = torch.cat([split.rope_weight, split.nope_weight]).double()
    assert rows.shape == w_k.shape
    assert torch.allclose(rows.T @ rows, w_k.T @ w_k, atol=1e-5)  # an orthogonal transform of the rows
    embed = split.nope_embed.double()
    assert torch.allclose(embed.T @ embed, torch.eye(embed.shape[1], dtype=torch.float64), atol=1e-6)
    assert split.nope_weight.shape[0] == 2 * 16 - 2 * len(kept)


# ---- score='rotation' (ours): the 2-norm score times how far each pair's rotation moves where heads attend ----


@torch.no_grad()
def test_rotation_distance_statistic_matches_brute_force():
    from mha2mla_exp.mla.calibration import Calibration

    model = tiny_causal_lm("qwen2")
    shape = ModelShape.from_config(model.config)
    calib = [torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(4)) for _ in range(2)]
    rho = Calibration(model, calib, shape).get("rotation_distance")
    model.config._attn_implementation = "eager"
    theta = model.model.rotary_emb.inv_freq.double()  # [d_h/2]
    total = torch.zeros_like(rho, dtype=torch.float64)
    count = 0
    for ids in calib:
        probs = model(ids, output_attentions=True).attentions
        t = torch.arange(ids.shape[1], dtype=torch.float64)
        distance = 2 * torch.sin(theta * (t[:, None, None] - t[None, :, None]) / 2).abs()  # |1 - e^{i theta d}|
        for i, p in enumerate(probs):
            total[i] += torch.einsum("bhts,tsf->hf", p.double(), distance)
        count += ids.numel()
    assert rho.shape == (shape.num_layers, shape.num_heads, HALF)
    assert torch.allclose(rho.double(), total / count, rtol=1e-4, atol=1e-6)
    assert (rho[..., 0] > rho[..., -1]).all()  # the highest frequency turns most


def test_rotation_score_skips_pairs_that_do_not_turn():
    from mha2mla_exp.mla.rope.two_norm import pair_scores, top_pairs

    q = torch.tensor([[1.0, 1.0, 5.0]] * 2)  # 2 query heads, one KV head; pair 2 loudest
    k = torch.tensor([[1.0, 2.0, 5.0]])
    distance = torch.tensor([[1.2, 0.8, 0.01]] * 2)  # ... but pair 2 barely turns within the attended span
    assert top_pairs(pair_scores(q, k, 1, "product"), 1) == [[2]]
    assert top_pairs(pair_scores(q, k, 1, "rotation", distance), 1) == [[1]]
    u = torch.eye(1, dtype=torch.float64).expand(3, 1, 1)
    assert torch.allclose(
        rotated_pair_scores(q, k, u, "rotation", distance), pair_scores(q, k, 1, "rotation", distance)
    )


@torch.no_grad()
@pytest.mark.parametrize("rope", ["2-norm", "rorope"])
def test_rotation_score_converts_and_is_named(rope, tokens):
    model = tiny_causal_lm("gqa")
    mla = convert_to_mla(model, rope=rope, r=HALF, svd="none", score="rotation", calibration=[tokens])
    assert max_diff(mla(tokens).logits, model(tokens).logits) < 1e-4
    from mha2mla_exp.mla import MLASpec

    spec = MLASpec.create(ModelShape.from_config(model.config), rope=rope, r=2, svd="none", score="rotation")
    assert spec.statistics[-1] == "rotation_distance" and spec.name_parts()[0] == f"{rope}-r2-rotation"
