"""A KV budget split between the shared rope key and the latent (mla/budget.py): exact at full budget, never
above the budget in measured cache bytes, absorbed decode equal to expanded, and a search that finds what it is
built to find."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from transformers import AutoModelForCausalLM

from mha2mla_exp.mla import MLASpec, ModelShape, convert_to_mla
from mha2mla_exp.mla.budget import search_widths, selection_loss
from mha2mla_exp.mla.cache import LatentCache
from mha2mla_exp.mla.spec import budget_pair_range, kv_elements_per_token

FULL = 2 * 2 * 16  # tiny GQA: 2 KV heads x head_dim 16, keys and values


def calib(tokens):
    return [tokens.flip(1), tokens]


@torch.no_grad()
@pytest.mark.parametrize("rope_pairs", [None, 16])
def test_full_budget_reproduces_the_original(tokens, rope_pairs):
    """At 2*n_kv*d_h elements only one split is lossless: every pair keeps RoPE (32 dims) beside a latent of
    the values' full rank (32); the search must find it, as any dropped pair loses position."""
    model = tiny_causal_lm("gqa")
    mla = convert_to_mla(
        model,
        rope="rorope",
        svd="joint",
        init="bkv",
        kv_elements=FULL,
        rope_pairs=rope_pairs,
        calibration=calib(tokens),
        selection=[tokens],
    )
    assert (mla(tokens).logits - model(tokens).logits).abs().max() < 1e-4
    split = mla.config.mla["budget_split"]
    assert all(2 * s["rope_pairs"] + s["latent"] == FULL for s in split)
    assert {s["rope_pairs"] for s in split} == {16}
    if rope_pairs is None:  # the search scored the lossless split at the original's own loss
        search = mla.config.mla["budget_search"]
        assert search["rope_pairs"] == 16 and search["key_weight"] == 1.0
        best = [c for c in search["candidates"] if c["rope_pairs"] == 16]
        assert best[0]["selection_loss"] == pytest.approx(selection_loss(model, [tokens]), abs=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["gqa", "mha", "qwen2"])
def test_measured_cache_bytes_are_the_budget_and_absorbed_decode_equals_expanded(kind, tokens, tmp_path):
    model = tiny_causal_lm(kind)
    budget = 20
    mla = convert_to_mla(
        model,
        rope="rorope",
        svd="joint",
        init="output",
        score="rotation",
        kv_elements=budget,
        calibration=calib(tokens),
        selection=[tokens.flip(0)],
    )
    shape = ModelShape.from_config(model.config)
    spec = MLASpec.create(shape, rope="rorope", r=1, svd="joint", kv_elements=budget)
    assert kv_elements_per_token(shape, spec) == budget
    cache = LatentCache()
    expanded = mla(tokens, cache=cache, use_cache=True).logits
    assert cache.nbytes() == model.config.num_hidden_layers * tokens.numel() * budget * 4  # fp32: exactly B per token
    pairs = [s["rope_pairs"] for s in mla.config.mla["budget_split"]]
    assert [len(p[0]) for p in mla.config.rope_pairs] == pairs
    assert mla.config.latent_dims == [budget - 2 * k for k in pairs]

    mla.set_absorb(True)
    assert (mla(tokens).logits - expanded).abs().max() < 1e-4
    prompt = tokens[:, :8]
    absorbed = mla.generate(prompt, max_new_tokens=6, do_sample=False)
    mla.set_absorb(False)
    assert torch.equal(absorbed, mla.generate(prompt, max_new_tokens=6, do_sample=False))

    mla.save_pretrained(tmp_path)  # a folder that carries its split
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (loaded(tokens).logits - expanded).abs().max() < 1e-5


@torch.no_grad()
def test_the_search_keeps_the_split_of_lowest_selection_loss_among_those_it_tried(tokens):
    model = tiny_causal_lm("gqa")
    budget = 24
    selection = [tokens.flip(0)]
    searched = convert_to_mla(
        model,
        rope="rorope",
        svd="joint",
        init="bkv",
        kv_elements=budget,
        key_weight=None,
        calibration=calib(tokens),
        selection=selection,
    )
    search = searched.config.mla["budget_search"]
    allowed = budget_pair_range(ModelShape.from_config(model.config), budget)
    tried = {(c["rope_pairs"], c["key_weight"]): c["selection_loss"] for c in search["candidates"]}
    counts = {k for k, w in tried if w == 1.0}
    assert set(allowed[::4]) <= counts <= set(allowed)  # the coarse grid, then neighbours of the best
    weights = {w for k, w in tried if k == search["rope_pairs"]}
    assert {0.5, 1.0, 2.0, 4.0, 8.0} <= weights
    best = (search["rope_pairs"], search["key_weight"])
    assert tried[best] == min(tried.values())
    assert selection_loss(searched, selection) == pytest.approx(tried[best], abs=1e-6)
    for k, w in [(allowed.start, 1.0), best, (search["rope_pairs"], 0.5)]:  # each loss is that fixed split's
        fixed = convert_to_mla(
            model,
            rope="rorope",
            svd="joint",
            init="bkv",
            kv_elements=budget,
            rope_pairs=k,
            key_weight=w,
            calibration=calib(tokens),
        )
        assert selection_loss(fixed, selection) == pytest.approx(tried[k, w], abs=1e-6)


@torch.no_grad()
def test_the_key_weight_trades_the_values_fit_for_the_keys(tokens):
    model = tiny_causal_lm("gqa")
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens)).reshape(-1, model.config.hidden_size)

    def nope_keys_and_values(mla):
        a = mla.model.layers[0].self_attn
        latent = a.kv_down_proj(x)
        return a.k_up_proj(latent[:, a.k_latent]), a.v_up_proj(latent[:, a.v_latent])

    exact_k, exact_v = nope_keys_and_values(
        convert_to_mla(  # 2 pairs + the full-rank latent: lossless NoPE
            model, rope="rorope", svd="joint", init="bkv", kv_elements=FULL, rope_pairs=2, calibration=calib(tokens)
        )
    )
    errors = {}
    for weight in (0.25, 1.0, 4.0):
        k, v = nope_keys_and_values(
            convert_to_mla(
                model,
                rope="rorope",
                svd="joint",
                init="bkv",
                kv_elements=20,
                rope_pairs=2,
                key_weight=weight,
                calibration=calib(tokens),
            )
        )
        errors[weight] = ((k - exact_k).norm().item(), (v - exact_v).norm().item())
    assert errors[0.25][0] > errors[1.0][0] > errors[4.0][0]  # more weight on the keys: they fit better...
    assert errors[0.25][1] < errors[1.0][1] < errors[4.0][1]  # ... and the values worse


def test_a_searched_budget_without_a_selection_sample_is_refused(tokens):
    with pytest.raises(ValueError, match="needs a selection"):
        convert_to_mla(
            tiny_causal_lm("gqa"), rope="rorope", svd="joint", init="bkv", kv_elements=24, calibration=calib(tokens)
        )


def test_width_exchanges_keep_the_total_and_the_bounds_and_only_lower_the_score():
    """A separable convex price (layer l pays c_l / w_l) has its optimum at w_l proportional to sqrt(c_l): the
    exchanges must walk towards it, keep the total, stay within floor and caps, and never raise the score."""
    c = [1.0, 16.0, 4.0, 1.0]
    caps = [40, 40, 40, 24]
    scored = []

    def score(widths):  # a probe is one layer a step wider or narrower; a candidate keeps the total
        assert sum(widths) in (60, 64, 68) and all(1 <= w <= cap for w, cap in zip(widths, caps))
        scored.append(sum(ci / w for ci, w in zip(c, widths)))
        return scored[-1]

    widths, record = search_widths([16] * 4, caps, score, step=4, rounds=6)
    assert sum(widths) == 64 and record["scored"] == len(scored)
    assert record["uniform_loss"] == pytest.approx(sum(ci / 16 for ci in c))
    losses = [record["uniform_loss"]] + [r["selection_loss"] for r in record["rounds"]]
    assert losses == sorted(losses, reverse=True) and len(losses) > 2  # every kept round lowered it
    assert widths[1] > widths[2] > widths[0] and widths[1] > 16 > widths[0]  # the dear layer got most
    assert record["rounds"][-1]["widths"] == widths


def test_a_round_that_finds_no_gain_keeps_the_widths():
    widths, record = search_widths([8, 8], [16, 16], lambda w: 1.0 + 0 * sum(w), step=4)
    assert widths == [8, 8] and record["rounds"] == []


@torch.no_grad()
def test_a_measured_allocation_keeps_the_cache_bytes_and_lowers_the_selection_loss(tokens, tmp_path):
    model = tiny_causal_lm("mha")  # here an exchange pays (seeded): the search must move the latent
    selection = [tokens.flip(0)]
    kwargs = dict(rope="rorope", svd="joint", init="bkv", kv_elements=24, rope_pairs=4, calibration=calib(tokens))
    uniform = convert_to_mla(model, **kwargs)
    measured = convert_to_mla(model, **kwargs, allocation="measured", selection=selection)
    record = measured.config.mla["latent_allocation"]
    assert record["uniform_loss"] == pytest.approx(selection_loss(uniform, selection), abs=1e-6)
    widths = [s["latent"] for s in measured.config.mla["budget_split"]]
    assert sum(widths) == 2 * (24 - 8) and measured.config.latent_dims in (None, widths)
    final = selection_loss(measured, selection)
    assert record["rounds"] and widths == record["rounds"][-1]["widths"] != [16, 16]
    assert final == pytest.approx(record["rounds"][-1]["selection_loss"], abs=1e-6)
    assert final < record["uniform_loss"]
    cache = LatentCache()
    expanded = measured(tokens, cache=cache, use_cache=True).logits
    assert cache.nbytes() == model.config.num_hidden_layers * tokens.numel() * 24 * 4  # the budget, every token
    measured.set_absorb(True)
    assert (measured(tokens).logits - expanded).abs().max() < 1e-4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rope": "2-norm", "svd": "joint", "kv_elements": 72}, "needs a strategy with one shared rope key"),
        ({"rope": "rorope", "svd": "split", "kv_elements": 72}, "needs svd='joint'"),
        ({"rope": "rorope", "svd": "joint", "kv_elements": 72, "d_kv": 16}, "both size the latent"),
        ({"rope": "rorope", "svd": "joint", "kv_elements": 72, "rope_pairs": 36}, "keeps 1..35 rotated pairs"),
        ({"rope": "rorope", "svd": "joint", "rope_pairs": 8}, "needs kv_elements"),
        ({"rope": "rorope", "svd": "joint", "kv_elements": 2}, "kv_elements must be an integer >= 3"),
        ({"rope": "rorope", "svd": "joint", "d_kv": 16, "key_weight": None}, "key_weight=null .searched. needs"),
        ({"rope": "rorope", "svd": "split", "d_kv": 16, "key_weight": 2.0}, "has no such trade"),
        ({"rope": "rorope", "svd": "joint", "d_kv": 16, "key_weight": 0}, "key_weight must be a positive number"),
        (
            {"rope": "rorope", "svd": "joint", "d_kv": 16, "allocation": "measured"},
            "allocation='measured' needs kv_elements",
        ),
        (
            {"rope": "rorope", "svd": "joint", "kv_elements": 72, "allocation": "global"},
            "spread by the model's measured",
        ),
    ],
)
def test_a_budget_that_cannot_be_met_is_refused_before_any_weight(kwargs, message):
    shape = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=message):
        MLASpec.create(shape, r=4, **kwargs)


def test_budget_range_and_name():
    shape = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
    assert budget_pair_range(shape, 72) == range(1, 36)
    assert budget_pair_range(shape, 120) == range(1, 60)
    spec = MLASpec.create(shape, rope="rorope", r=4, svd="joint", init="bkv", score="rotation", kv_elements=72)
    assert spec.name_parts() == ("rorope-rotation", "joint-kv72-search-bkv")
    fixed = MLASpec.create(shape, rope="rorope", r=4, svd="joint", kv_elements=72, rope_pairs=16)
    assert fixed.name_parts() == ("rorope", "joint-kv72-p16") and fixed.searches is False
    assert spec.searches and "attention_inputs" not in spec.statistics
    weighed = MLASpec.create(
        shape, rope="rorope", r=None, svd="joint", init="bkv", kv_elements=72, rope_pairs=16, key_weight=None
    )
    assert weighed.searches and weighed.name_parts() == ("rorope", "joint-kv72-p16-bkv-kwsearch")
    measured = MLASpec.create(
        shape, rope="rorope", r=None, svd="joint", init="bkv", kv_elements=72, rope_pairs=16, allocation="measured"
    )
    assert measured.searches and measured.name_parts() == ("rorope", "joint-kv72-p16-bkv-measured")
    weighed = MLASpec.create(shape, rope="rorope", r=4, svd="joint", d_kv=16, key_weight=2)
    assert weighed.name_parts()[1] == "joint-dkv16-kw2"


def test_a_budget_conversion_runs_end_to_end_and_its_record_states_the_split(tmp_path):
    from mha2mla_exp.runner import run, run_config
    from tests.test_runner import smoke_cfg

    cfg = smoke_cfg(
        tmp_path,
        "mla_2-norm_joint",
        "rope.strategy=rorope",
        "rope.score=rotation",
        "svd=budget",
        "svd.kv_elements=20",
        "svd.d_kv=null",
        "train.tokens=256",
    )
    record = run(run_config(cfg))
    assert record["status"] == "ok", record["error"]
    assert record["mla"]["kv_elements"] == 20 and record["mla"]["r"] is None
    assert record["kv"]["ratio_measured"] == pytest.approx(record["kv"]["ratio_nominal"]) == pytest.approx(20 / FULL)
    split = record["conversion"]["budget_split"]
    assert [2 * s["rope_pairs"] + s["latent"] for s in split] == [20, 20]
    assert record["conversion"]["budget_search"]["rope_pairs"] == split[0]["rope_pairs"]
    assert "joint-kv20-search-bkv" in record["run_name"]
