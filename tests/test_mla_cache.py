"""The latent cache holds exactly k_rope + c_kv; quantized variants are small and faithful;
absorbed decoding equals the expanded path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import (
    LatentCache,
    MLASpec,
    ModelShape,
    QuantizedLatentCache,
    convert_to_mla,
    kv_elements_per_token,
)
from mha2mla_exp.mla.cache import QuantizedLatentLayer

VARIANTS = [
    dict(rope="2-norm", r=2, svd="joint", d_kv=8),
    dict(rope="uniform", r=3, svd="split", d_kv=10),
    dict(rope="none", svd="joint", d_kv=6),
    dict(rope="full", svd="joint", d_kv=16),
    dict(rope="rorope", r=2, svd="joint", d_kv=8),  # one shared rope key (mla/layouts.py)
    dict(rope="rorope", r=3, svd="split", d_kv=10),
    dict(rope="rorope", r=3, svd="none"),  # NoPE keys re-embedded by a k_up, values as cached
]
IDS = [f"{s['rope']}-{s['svd']}" for s in VARIANTS]


def convert(kind, spec, tokens):
    model = tiny_causal_lm(kind)
    return convert_to_mla(model, **spec, calibration=[tokens])


@torch.no_grad()
@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
@pytest.mark.parametrize("kind", ["mha", "gqa", "qwen2"])
def test_cache_bytes_equal_formula_after_generate(kind, spec, tokens):
    mla = convert(kind, spec, tokens)
    prompt, new = tokens[:1, :20], 7
    cache = LatentCache()
    mla.generate(prompt, max_new_tokens=new, do_sample=False, cache=cache)
    t = prompt.shape[1] + new - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == t
    cfg = mla.config
    r, n_kv, d_h = cfg.mla["r"], cfg.num_key_value_heads, cfg.head_dim
    latent = spec["d_kv"] if spec["svd"] != "none" else 2 * d_h - 2 * r  # per KV head; 'none': the MHA cache
    expected = cfg.num_hidden_layers * t * n_kv * (2 * r + latent) * 4  # fp32
    assert cache.nbytes() == expected
    spec = MLASpec(**{k: cfg.mla[k] for k in MLASpec.__dataclass_fields__})
    assert cache.nbytes() == cfg.num_hidden_layers * t * kv_elements_per_token(ModelShape.from_config(cfg), spec) * 4


@torch.no_grad()
def test_default_generate_uses_latent_cache(tokens):
    mla = convert("gqa", VARIANTS[0], tokens)
    out = mla.generate(tokens[:1], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out.get("cache", out.get("past_key_values"))
    assert isinstance(cache, LatentCache)


@torch.no_grad()
@pytest.mark.parametrize("spec", VARIANTS, ids=IDS)
@pytest.mark.parametrize("kind", ["mha", "gqa", "qwen2"])
def test_absorbed_equals_expanded(kind, spec, tokens):
    mla = convert(kind, spec, tokens)
    expanded = mla(tokens).logits
    mla.set_absorb(True)
    absorbed = mla(tokens).logits
    assert (absorbed - expanded).abs().max().item() < 1e-4

    # step by step through the cache: prefill then single-token decode
    prompt = tokens[:, :16]
    logits = {}
    for absorb in (False, True):
        mla.set_absorb(absorb)
        cache = LatentCache()
        steps = [mla(prompt, cache=cache, use_cache=True).logits[:, -1]]
        for i in range(16, tokens.shape[1]):
            steps.append(mla(tokens[:, i : i + 1], cache=cache, use_cache=True).logits[:, -1])
        logits[absorb] = torch.stack(steps)
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4

    greedy = {}
    for absorb in (False, True):
        mla.set_absorb(absorb)
        greedy[absorb] = mla.generate(tokens[:1], max_new_tokens=12, do_sample=False)
    assert torch.equal(greedy[True], greedy[False])


@torch.no_grad()
def test_absorbed_handles_left_padding(tokens):
    mla = convert("gqa", VARIANTS[0], tokens)
    ids = tokens.clone()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in the first row
    outs = {}
    for absorb in (False, True):
        mla.set_absorb(absorb)
        outs[absorb] = mla.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(outs[True], outs[False])


# ---- quantized latent cache ----


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
@pytest.mark.parametrize("nbits, bound", [(4, 1 / 3), (2, 1 / 5)])
@torch.no_grad()
def test_quantized_cache_bytes_bound(backend, nbits, bound, tokens):
    """Past the residual window the quantized part holds at most 1/3 (4-bit) or 1/5 (2-bit) of the
    plain bytes of the same tokens, scales and zero-points included."""
    mla = convert("gqa", VARIANTS[0], tokens)
    prompt = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(3))
    plain = LatentCache()
    mla(prompt, cache=plain, use_cache=True)
    quantized = QuantizedLatentCache(mla.config.num_hidden_layers, backend=backend, nbits=nbits, residual_length=32)
    mla(prompt, cache=quantized, use_cache=True)
    for i in range(5):  # a few decode steps land in the full-precision residual window
        mla(prompt[:, i : i + 1], cache=quantized, use_cache=True)
    assert quantized.get_seq_length() == 305
    quantized_part = quantized.nbytes() - quantized.residual_nbytes()
    assert quantized.residual_nbytes() == plain.nbytes() // 300 * 5
    assert 0 < quantized_part <= bound * plain.nbytes()


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_layer_round_trip_is_faithful(backend):
    """The layout code (transpose, pad, group) must give back the right values in the right places."""
    torch.manual_seed(0)
    layer = QuantizedLatentLayer(backend, nbits=4, q_group_size=16, residual_length=8)
    k = torch.randn(2, 3, 37, 4)
    c = torch.randn(2, 1, 37, 24) * torch.linspace(0.1, 10, 24)  # channels of very different scale
    layer.update(k, c)
    k_all, c_all = layer.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 1, 1, 24))
    assert k_all.shape == (2, 3, 38, 4) and c_all.shape == (2, 1, 38, 24)
    rel = ((c_all[:, :, :37] - c).norm(dim=2) / c.norm(dim=2)).max().item()  # per channel
    assert rel < 0.15
    assert ((k_all[:, :, :37] - k).norm() / k.norm()).item() < 0.15
    assert torch.equal(c_all[:, :, 37:], torch.zeros(2, 1, 1, 24))  # the new token is exact (residual)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
@pytest.mark.parametrize("spec", [VARIANTS[0], VARIANTS[4]], ids=[IDS[0], IDS[4]])
def test_generate_with_quantized_latent_cache(backend, spec, tokens):
    mla = convert("gqa", spec, tokens)
    out = mla.generate(
        tokens[:1],
        max_new_tokens=4,
        do_sample=False,
        cache_implementation="quantized",
        cache_config={"backend": backend, "nbits": 4, "residual_length": 4},
        return_dict_in_generate=True,
    )
    cache = out.get("cache", out.get("past_key_values"))
    assert isinstance(cache, QuantizedLatentCache)
    assert cache.get_seq_length() == tokens.shape[1] + 3


def test_quantized_cache_rejects_bad_options():
    with pytest.raises(ValueError, match="kv_quant.backend: unknown 'bnb'"):
        QuantizedLatentLayer("bnb")
    with pytest.raises(ValueError, match="kv_quant.nbits: 3 is not supported by quanto"):
        QuantizedLatentLayer("quanto", nbits=3)
