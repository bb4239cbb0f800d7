"""The latent cache keeps each layer's attention span (mla/cache.py): on a sliding-window layer it holds what
transformers' own sliding layer holds, on the expanded and the absorbed path, in prefill and decode, quantized too;
the bytes formula (`cache_elements_per_sequence`) counts it; and a conversion may turn only the full-attention or
only the sliding layers into MLA (`convert_layers`), the others keeping the family's attention and cache."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_mla_remote_code import load_in_fresh_interpreter
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import mha2mla_exp  # noqa: F401  (registers the model type)
from mha2mla_exp.bench.family_models import COMMON, tiny_family_lm
from mha2mla_exp.mla import (
    LatentCache,
    MLASpec,
    ModelShape,
    attention_windows,
    cache_elements_per_sequence,
    cache_nbytes,
    convert_to_mla,
    max_d_kv,
)
from mha2mla_exp.mla.cache import LatentLayer, QuantizedLatentLayer

WINDOW = 16
PROMPT, NEW = 200, 40
LOW = dict(rope="high", r=2, svd="joint", d_kv=6)  # 2*2*2 + 2*6 = 20 elements per token and layer, the original 64


def windowed_lm(family: str, **changes):
    """A tiny random model of `family` whose sliding window (16) the 200-token prompts exceed many times over."""
    if family == "mistral":  # every layer sliding
        fields = COMMON | dict(sliding_window=WINDOW, max_position_embeddings=512) | changes
        torch.manual_seed(0)
        return tf.MistralForCausalLM(tf.MistralConfig(**fields)).eval()
    return tiny_family_lm(family, sliding_window=WINDOW, max_position_embeddings=512, **changes)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(3))


def full_rank(model, **spec):
    shape = ModelShape.from_config(model.config)
    return convert_to_mla(model, rope="full", svd="joint", d_kv=max_d_kv(shape, shape.head_dim // 2, "joint"), **spec)


@torch.no_grad()
def generate(model, prompt, absorb: bool | None = None, **options):
    if absorb is not None:
        model.set_absorb(absorb)
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **options)
    return out.sequences, out.cache


def held_tokens(layer) -> int:
    return layer.values.shape[-2]


@torch.no_grad()
@pytest.mark.parametrize("family", ["gemma3_text", "gemma2", "mistral"])
@pytest.mark.parametrize("convert_layers", ["all", "global", "sliding"])
def test_a_full_rank_conversion_decodes_the_originals_tokens_with_windowed_caches(family, convert_layers, prompt):
    model = windowed_lm(family)
    windows = attention_windows(model.config)
    if convert_layers != "all" and all(windows):  # Mistral: every layer sliding, no choice to make
        with pytest.raises(ValueError, match="this model has no full-attention layer"):
            full_rank(model, convert_layers=convert_layers)
        return
    mla = full_rank(model, convert_layers=convert_layers)
    assert (mla(prompt).logits - model(prompt).logits).abs().max() < 1e-4  # the prefill attends past the window
    original, original_cache = generate(model, prompt)
    for absorb in (False, True):
        tokens, cache = generate(mla, prompt, absorb)
        assert torch.equal(tokens, original), absorb
        for window, layer, theirs in zip(windows, cache.layers, original_cache.layers):
            assert held_tokens(layer) == held_tokens(theirs) == (PROMPT + NEW - 1 if window is None else WINDOW - 1)
    converted = mla.config.mla_layers or [True] * len(windows)
    for window, mla_layer, layer in zip(windows, converted, cache.layers):
        expected = DynamicSlidingWindowLayer if window else LatentLayer if mla_layer else DynamicLayer
        assert type(layer) is expected
        assert layer.values.shape[1] == (1 if mla_layer else 2)  # one latent, or the values of 2 KV heads


@torch.no_grad()
@pytest.mark.parametrize("convert_layers", ["all", "global", "sliding"])
def test_the_measured_bytes_equal_the_formula_and_stop_growing_at_the_window(convert_layers):
    model = windowed_lm("gemma3_text")
    shape, windows = ModelShape.from_config(model.config), attention_windows(model.config)
    mla = convert_to_mla(model, **LOW, convert_layers=convert_layers)
    spec = MLASpec.recorded(mla.config.mla)
    ids = torch.randint(0, 97, (1, 8 * WINDOW), generator=torch.Generator().manual_seed(5))
    for absorb in (False, True):
        mla.set_absorb(absorb)
        cache = mla.new_cache()
        sliding_bytes = []
        mla(ids[:, :5], cache=cache, use_cache=True)  # a prefill inside the window, then decode past it
        for t in range(5, 3 * WINDOW):
            mla(ids[:, t : t + 1], cache=cache, use_cache=True)
            formula = cache_elements_per_sequence(shape, windows, t + 1, spec)
            assert cache.nbytes() == 4 * formula["total"], (t, absorb)
            sliding_bytes.append(sum(cache_nbytes_of(layer) for w, layer in zip(windows, cache.layers) if w))
        assert sliding_bytes[-1] == sliding_bytes[WINDOW] > sliding_bytes[0]  # flat from the window on
    for length in (5, WINDOW - 1, WINDOW, WINDOW + 1, 8 * WINDOW):  # one prefill longer than the window
        cache = mla.new_cache()
        mla(ids[:, :length], cache=cache, use_cache=True)
        assert cache.nbytes() == 4 * cache_elements_per_sequence(shape, windows, length, spec)["total"], length
        original = DynamicCache(config=model.config)
        model(ids[:, :length], cache=original, use_cache=True)
        assert cache_nbytes(original) == 4 * cache_elements_per_sequence(shape, windows, length)["total"], length


def cache_nbytes_of(layer) -> int:
    return layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()


@torch.no_grad()
def test_the_converted_cache_stays_below_the_originals_at_every_length():
    """Gemma-3's pattern (5 sliding layers to 1 global): a conversion at 20 of 64 elements per token and layer
    holds less than the original at every length from 1x to 8x the window; a cache that kept every token on every
    layer (as before windows) would hold more from a few windows on."""
    model = windowed_lm("gemma3_text", num_hidden_layers=6, sliding_window_pattern=6)
    assert attention_windows(model.config) == [WINDOW] * 5 + [None]
    mla = convert_to_mla(model, **LOW)
    ids = torch.randint(0, 97, (1, 8 * WINDOW), generator=torch.Generator().manual_seed(6))
    unbounded_exceeds = False
    for length in range(WINDOW, 8 * WINDOW + 1, WINDOW):
        original, windowed, unbounded = DynamicCache(config=model.config), mla.new_cache(), LatentCache()
        model(ids[:, :length], cache=original, use_cache=True)
        mla(ids[:, :length], cache=windowed, use_cache=True)
        mla(ids[:, :length], cache=unbounded, use_cache=True)
        assert windowed.nbytes() < cache_nbytes(original), length
        unbounded_exceeds |= unbounded.nbytes() > cache_nbytes(original)
    assert unbounded_exceeds  # what the windows prevent


@torch.no_grad()
@pytest.mark.parametrize("convert_layers", ["global", "sliding"])
def test_a_partly_converted_model_decodes_absorbed_as_expanded(convert_layers, prompt):
    mla = convert_to_mla(windowed_lm("gemma3_text"), **LOW, convert_layers=convert_layers)
    expanded, _ = generate(mla, prompt, absorb=False)
    absorbed, _ = generate(mla, prompt, absorb=True)
    assert torch.equal(absorbed, expanded)


@pytest.mark.parametrize("convert_layers", ["global", "sliding"])
def test_a_partly_converted_folder_loads_with_remote_code(convert_layers, prompt, tmp_path):
    model = windowed_lm("gemma3_text")
    mla = convert_to_mla(model, **LOW, convert_layers=convert_layers)
    mla.save_pretrained(tmp_path / "mla")
    rows = prompt[:, :40]
    out = load_in_fresh_interpreter(tmp_path / "mla", rows, tmp_path)
    with torch.no_grad():
        assert (out["logits"] - mla(rows).logits).abs().max() < 1e-5
        for absorb in (False, True):
            mla.set_absorb(absorb)
            expected = mla.generate(rows, max_new_tokens=6, do_sample=False)
            assert torch.equal(out[f"greedy_absorb={absorb}"], expected)


@pytest.mark.parametrize("convert_layers", ["global", "sliding"])
def test_a_model_without_sliding_layers_refuses_a_layer_choice(convert_layers):
    from conftest import tiny_causal_lm

    with pytest.raises(ValueError, match=f"convert_layers='{convert_layers}': this model has no sliding-window layer"):
        convert_to_mla(tiny_causal_lm("gqa"), **LOW, convert_layers=convert_layers)


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_a_quantized_sliding_layer_keeps_transformers_window(backend):
    """Fed the same states, it returns what DynamicSlidingWindowLayer returns (up to the quantization), with the
    same mask sizes, and holds no more for a long context than for one window."""
    g = torch.Generator().manual_seed(7)
    plain = DynamicSlidingWindowLayer(WINDOW)
    quantized = QuantizedLatentLayer(backend, nbits=4, q_group_size=8, residual_length=4, sliding_window=WINDOW)
    held = []
    for new in [40] + [1] * 60 + [7, 3]:  # a prefill past the window, decode, a chunk
        for layer in (plain, quantized):
            assert layer.get_mask_sizes(new) == plain.get_mask_sizes(new)
        k, v = torch.randn(1, 2, new, 8, generator=g), torch.randn(1, 1, new, 12, generator=g)
        (k0, v0), (k1, v1) = plain.update(k, v), quantized.update(k, v)
        assert k1.shape == k0.shape and v1.shape == v0.shape
        assert (k1 - k0).abs().max() < 0.5 and (v1 - v0).abs().max() < 0.5  # 4-bit error, not another token
        assert torch.equal(k1[..., -new:, :], k)  # the call's own states as they came
        held.append(quantized.nbytes())
    assert max(held[40:]) <= max(held[:40])  # bounded by the window, not the context
    no_window = QuantizedLatentLayer(backend, nbits=4, q_group_size=8, residual_length=4)
    for new in [40] + [1] * 60:
        no_window.update(torch.randn(1, 2, new, 8), torch.randn(1, 1, new, 12))
    assert no_window.nbytes() > 2 * max(held)


@torch.no_grad()
def test_a_quantized_cache_of_a_windowed_model_is_bounded_by_the_window(prompt):
    model = windowed_lm("gemma3_text")
    windows = attention_windows(model.config)
    mla = convert_to_mla(model, **LOW)
    sizes = {}
    for length in (4 * WINDOW, 8 * WINDOW):
        cache = mla.new_cache(dict(backend="hqq", nbits=4, q_group_size=8, residual_length=4))
        mla(prompt[:, :length], cache=cache, use_cache=True)
        for _ in range(9):
            mla(prompt[:, length : length + 1], cache=cache, use_cache=True)
        sizes[length] = [layer.nbytes() for layer in cache.layers]
    sliding, full = windows.index(WINDOW), windows.index(None)
    assert sizes[4 * WINDOW][sliding] == sizes[8 * WINDOW][sliding]
    assert sizes[8 * WINDOW][full] > 1.5 * sizes[4 * WINDOW][full]
    tokens, cache = generate(mla, prompt, cache_implementation="quantized", cache_config={"backend": "hqq"})
    assert [layer.is_sliding for layer in cache.layers] == [w is not None for w in windows]
    assert tokens.shape[-1] == PROMPT + NEW


def _plan(*overrides):
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.confutil import CONF_DIR
    from mha2mla_exp.runner import run_config, validate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        smoke = ["+experiment=smoke", "rope.r=2", "svd.d_kv=8"]
        return validate(run_config(compose(config_name="config", overrides=[*smoke, *overrides])))


def test_the_runner_refuses_a_layer_choice_the_model_lacks_before_loading():
    from mha2mla_exp.runner.config import ConfigError

    with pytest.raises(ConfigError, match="svd.convert_layers: .*this model has no sliding-window layer"):
        _plan("svd.convert_layers=global")  # a random Llama: no sliding layer
    gemma = ["model.family=gemma3_text", "model.shape.key_norm=head", "model.shape.num_layers=6"]
    plan = _plan(*gemma, "svd.convert_layers=global")  # Gemma-3's pattern: 5 sliding layers, 1 global
    assert plan.conversion.spec.convert_layers == "global" and "-global-layers" in plan.conversion.spec.name_parts()[0]
    with pytest.raises(ConfigError, match="svd.convert_layers"):
        _plan("svd.convert_layers=most")


@torch.no_grad()
@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_layer_wise_distillation_replays_each_layers_own_window(family):
    """train/distill.py replays each attention block with the mask the teacher gave that layer: the sliding one
    on a sliding layer, so a full-rank student matches its teacher there, which a plain causal mask would not."""
    from mha2mla_exp.train.distill import _block_error, capture_attention_io

    model = windowed_lm(family)
    student = full_rank(model)
    captured = capture_attention_io(model, [torch.randint(0, 97, (2, 4 * WINDOW), generator=torch.Generator())])
    windows = attention_windows(model.config)
    for i, layer in enumerate(student.model.layers):
        assert _block_error(layer.self_attn, captured, i) < 1e-8, i
    sliding = windows.index(WINDOW)
    causal_only = [[dict(io, attention_mask=None) for io in batch] for batch in captured]
    assert _block_error(student.model.layers[sliding].self_attn, causal_only, sliding) > 1e-4


def test_a_runs_record_states_the_cache_per_sequence_with_windows():
    """The record's `kv.bytes_per_sequence` (and the headline's line): a windowed model's cache by length, the
    conversion's below the original's at each; a model without sliding layers has none."""
    from mha2mla_exp.evaluation.kv import SEQUENCE_LENGTHS, bytes_per_sequence
    from mha2mla_exp.runner.record import headline

    original = windowed_lm("gemma3_text")
    converted = convert_to_mla(original, **LOW)
    per = bytes_per_sequence(converted)
    assert list(per) == [str(t) for t in SEQUENCE_LENGTHS]
    assert per == {
        t: {"model": v["model"], "original": bytes_per_sequence(original)[t]["model"]} for t, v in per.items()
    }
    assert all(v["model"] < v["original"] for v in per.values())
    assert bytes_per_sequence(tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))) is None
    kv = {
        "bytes_per_token_measured": 1.0,
        "bytes_per_token_mha": 2.0,
        "mem_change_pct": -50.0,
        "bytes_per_sequence": per,
    }
    record = {"model": {"name": "tiny"}, "variant": "mla", "kv": kv}
    assert "KV cache per sequence, sliding windows counted: 1,024 tokens" in headline(record)
