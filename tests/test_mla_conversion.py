"""Exactness, selection, parameter counts, round trip and input validation of `convert_to_mla`."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from transformers import AutoModelForCausalLM

import mha2mla_exp  # noqa: F401  (registers the model type)
from mha2mla_exp.mla import MLAForCausalLM, MLASpec, ModelShape, convert_to_mla, fixed_pairs, max_d_kv
from mha2mla_exp.mla.rope.two_norm import pair_scores, top_pairs

HALF = 8  # tiny models: head_dim 16


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_full_rope_full_rank_joint_reproduces_logits(tiny_model, tokens):
    ref = tiny_model(tokens).logits
    d_kv = max_d_kv(ModelShape.from_config(tiny_model.config), HALF, "joint")
    mla = convert_to_mla(tiny_model, rope="full", svd="joint", d_kv=d_kv)
    assert isinstance(mla, MLAForCausalLM)
    assert max_diff(mla(tokens).logits, ref) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("sigma", ["up", "sqrt"])
def test_full_rank_svd_equals_partial_rope_alone(tiny_model, tokens, sigma):
    """Below full RoPE, a joint or split SVD whose rank covers the weights equals the partial-RoPE-only model."""
    shape = ModelShape.from_config(tiny_model.config)
    d_kv = max_d_kv(shape, 2, "split")
    with torch.no_grad():  # split gives V only n_kv*d_kv/2 directions: make V's rank fit in them
        for layer in tiny_model.model.layers:
            v = layer.self_attn.v_proj.weight
            u, s, vh = torch.linalg.svd(v, full_matrices=False)
            keep = shape.num_kv_heads * d_kv // 2
            v.copy_((u[:, :keep] * s[:keep]) @ vh[:keep])
    partial = convert_to_mla(tiny_model, rope="uniform", r=2, svd="none")(tokens).logits
    for svd in ("joint", "split"):
        mla = convert_to_mla(tiny_model, rope="uniform", r=2, svd=svd, d_kv=max_d_kv(shape, 2, svd), sigma=sigma)
        assert max_diff(mla(tokens).logits, partial) < 1e-4, svd
    assert max_diff(partial, tiny_model(tokens).logits) > 1e-3  # partial RoPE does change the model


@torch.no_grad()
def test_high_with_all_pairs_equals_full_and_svd_none_equals_original(tiny_model, tokens):
    ref = tiny_model(tokens).logits
    full = convert_to_mla(tiny_model, rope="full", svd="none")(tokens).logits
    high = convert_to_mla(tiny_model, rope="high", r=HALF, svd="none")(tokens).logits
    assert max_diff(full, ref) < 1e-5
    assert max_diff(high, full) < 1e-6


@torch.no_grad()
def test_mistral_is_supported(tokens):
    model = tiny_causal_lm("mistral")
    mla = convert_to_mla(model, rope="full", svd="none")
    assert max_diff(mla(tokens).logits, model(tokens).logits) < 1e-5


def test_original_model_is_left_untouched(tokens):
    model = tiny_causal_lm("gqa", tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mla = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=4)
    with torch.no_grad():
        mla.model.embed_tokens.weight.add_(1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert mla.lm_head.weight is mla.model.embed_tokens.weight  # tying survives conversion


def test_fixed_selections_match_method():
    assert fixed_pairs("high", 4, 64) == [0, 1, 2, 3]
    assert fixed_pairs("low", 4, 64) == [28, 29, 30, 31]
    assert fixed_pairs("uniform", 4, 64) == [0, 8, 16, 24]
    assert fixed_pairs("full", 32, 64) == list(range(32))
    assert fixed_pairs("none", 0, 64) == []


def test_pair_scores_product_vs_sum_and_gqa_grouping():
    # 2 KV heads, 2 query heads each; 3 pairs. Pair 0: big q, tiny k. Pair 1: balanced. Pair 2: small.
    q = torch.tensor([[10.0, 2.0, 1.0], [10.0, 2.0, 1.0], [1.0, 1.0, 5.0], [1.0, 1.0, 5.0]])
    k = torch.tensor([[0.1, 2.0, 1.0], [1.0, 1.0, 1.0]])
    product = pair_scores(q, k, num_kv_heads=2, score="product")
    total = pair_scores(q, k, num_kv_heads=2, score="sum")
    assert torch.allclose(product[0], torch.tensor([2.0, 8.0, 2.0]))  # sum over the group of q*k
    assert torch.allclose(total[0], torch.tensor([20.2, 8.0, 4.0]))
    assert top_pairs(product, 1) == [[1], [2]]
    assert top_pairs(total, 1) == [[0], [2]]


@pytest.mark.parametrize("score", ["product", "sum"])
def test_two_norm_finds_the_planted_pairs(score):
    """Only the planted pairs of each KV head produce non-zero query AND key sub-vectors."""
    model = tiny_causal_lm("gqa")
    planted = {0: [1, 6], 1: [3, 4]}  # kv head -> pairs
    d_h, group = 16, 2
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            qw = attn.q_proj.weight.view(4, d_h, -1)
            kw = attn.k_proj.weight.view(2, d_h, -1)
            for g, pairs in planted.items():
                keep = torch.zeros(d_h, dtype=torch.bool)
                for p in pairs:
                    keep[p] = keep[p + HALF] = True
                kw[g, ~keep] = 0
                kw[g, keep] *= 5
                for h in range(g * group, (g + 1) * group):
                    qw[h, ~keep] *= 0.01
                    qw[h, keep] *= 5
    calib = [torch.randint(0, 97, (2, 16)) for _ in range(2)]
    mla = convert_to_mla(model, rope="2-norm", r=2, svd="none", score=score, calibration=calib)
    assert mla.config.rope_pairs == [[planted[0], planted[1]]] * 2
    assert mla.config.mla["score"] == score


def test_smollm_135m_shape_parameter_counts():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        original = LlamaForCausalLM(config)
    assert sum(p.numel() for p in original.parameters()) == 134_515_008
    original = original.to_empty(device="cpu")
    with torch.no_grad():  # uninitialised storage may hold NaN, which the SVD refuses
        for p in original.parameters():
            p.normal_(0, 0.02)
    expected = {32: 130_989_888, 16: 129_642_048, 8: 128_968_128}  # paper: 130.99M / 129.64M / 128.97M
    for d_kv, count in expected.items():
        mla = convert_to_mla(original, rope="high", r=4, svd="joint", d_kv=d_kv)
        assert sum(p.numel() for p in mla.parameters()) == count, d_kv


@torch.no_grad()
def test_save_pretrained_round_trip(tmp_path, tokens):
    model = tiny_causal_lm("qwen2")
    calib = [tokens]
    mla = convert_to_mla(model, rope="2-norm", r=3, svd="split", d_kv=6, sigma="sqrt", calibration=calib)
    mla.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MLAForCausalLM
    assert loaded.config.rope_pairs == mla.config.rope_pairs
    assert loaded.config.mla == mla.config.mla
    assert loaded.config.mla["source_model_type"] == "qwen2"
    assert max_diff(loaded(tokens).logits, mla(tokens).logits) == 0
    out = loaded.generate(tokens[:1], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, tokens.shape[1] + 5)


# ---- bad input: clear errors before any heavy work ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rope="middle", r=2, svd="none"), "unknown rope='middle'"),
        (dict(rope="high", r=2, svd="cur"), "unknown svd='cur'"),
        (dict(rope="high", r=-1, svd="none"), "outside [0, d_h/2]"),
        (dict(rope="high", r=HALF + 1, svd="none"), "outside [0, d_h/2]"),
        (dict(rope="high", r=None, svd="none"), "r is required"),
        (dict(rope="high", r=2, svd="joint"), "d_kv is required"),
        (dict(rope="high", r=2, svd="joint", d_kv=0), "positive integer"),
        (dict(rope="high", r=2, svd="joint", d_kv=-4), "positive integer"),
        (dict(rope="high", r=2, svd="joint", d_kv=29), "above the attainable rank"),
        (dict(rope="high", r=2, svd="split", d_kv=5), "must be even"),
        (dict(rope="high", r=2, svd="split", d_kv=26), "above the attainable rank"),
        (dict(rope="high", r=2, svd="none", d_kv=8), "svd='none'"),
        (dict(rope="2-norm", r=2, svd="none"), "needs calibration"),
        (dict(rope="high", r=2, svd="none", score="max"), "unknown score"),
        (dict(rope="high", r=2, svd="joint", d_kv=4, sigma="left"), "unknown sigma"),
        (dict(rope="high", r=2, svd="none", score="sum"), "score='sum' has no meaning for rope='high'"),
        (dict(rope="high", r=2, svd="joint", d_kv=4, init="magic"), "unknown init='magic'"),
        (dict(rope="high", r=2, svd="joint", d_kv=4, allocation="greedy"), "unknown allocation='greedy'"),
        (dict(rope="high", r=2, svd="split", d_kv=4, allocation="global"), "needs svd='joint'"),
        (dict(rope="high", r=2, svd="none", allocation="global"), "no latent to allocate"),
        (dict(rope="rorope", r=2, svd="none"), "rope='rorope' needs calibration"),
        (dict(rope="high", r=2, svd="joint", d_kv=4, init="output"), "init='output' needs calibration"),
    ],
)
def test_bad_input_raises_clear_value_error(kwargs, message):
    model = tiny_causal_lm("gqa")
    with pytest.raises(ValueError) as err:
        convert_to_mla(model, **kwargs)
    assert message in str(err.value)


def test_attainable_rank_limits():
    shape = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
    assert max_d_kv(shape, 4, "joint") == 120  # (56 + 64) per head; the 360 rows are below hidden 576
    assert max_d_kv(shape, 4, "split") == 112
    assert MLASpec.create(shape, rope="2-norm", r=4, svd="joint", d_kv=120).d_kv == 120
    with pytest.raises(ValueError, match="above the attainable rank"):
        MLASpec.create(shape, rope="2-norm", r=4, svd="joint", d_kv=121)


def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        convert_to_mla(gpt2, rope="high", r=2, svd="none")
    mla = convert_to_mla(tiny_causal_lm("gqa"), rope="high", r=2, svd="none")
    with pytest.raises(ValueError, match="already an MHA2MLA model"):
        convert_to_mla(mla, rope="high", r=2, svd="none")


def test_calibration_is_not_touched_when_spec_is_invalid():
    def exploding():
        raise AssertionError("calibration consumed before validation")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match="above the attainable rank"):
        convert_to_mla(tiny_causal_lm("gqa"), rope="2-norm", r=2, svd="joint", d_kv=999, calibration=exploding())


# ---- low-rank inits: see test_mla_lowrank_init.py ----


def test_activation_aware_init_needs_calibration_and_a_low_rank():
    with pytest.raises(ValueError, match="init='activation' needs calibration"):
        convert_to_mla(tiny_causal_lm("gqa"), rope="high", r=2, svd="joint", d_kv=4, init="activation")
    with pytest.raises(ValueError, match="nothing to initialise"):
        convert_to_mla(tiny_causal_lm("gqa"), rope="high", r=2, svd="none", init="activation")
