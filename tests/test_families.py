"""Every supported family converts exactly at full rank, decodes absorbed as expanded, caches the bytes the
formula says, keeps its base architecture, and refuses clearly what it cannot convert (mla/families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mla_remote_code import greedy, lm_eval_matches_ours, load_in_fresh_interpreter

import mha2mla_exp  # noqa: F401  (registers the model type)
from mha2mla_exp.bench.family_models import FAMILIES, tiny_family_lm
from mha2mla_exp.mla import (
    LOWRANK_INITS,
    ROPE_STRATEGIES,
    MLAForCausalLM,
    ModelShape,
    attention_windows,
    cache_elements_per_sequence,
    convert_to_mla,
    kv_elements_per_token,
    max_d_kv,
)
from mha2mla_exp.mla.calibration import Calibration
from mha2mla_exp.mla.spec import MLASpec

ROOT = Path(__file__).resolve().parents[1]
HALF = 8  # head_dim 16
QK_NORM = {"qwen3", "qwen3_moe", "olmo2", "gemma3_text"}


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def models():
    return {family: tiny_family_lm(family) for family in FAMILIES}


@pytest.fixture
def rows():  # longer than the tiny Gemmas' sliding window of 8
    return torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_full_rope_and_a_full_rank_latent_reproduce_the_original(models, rows, family):
    model = models[family]
    d_kv = max_d_kv(ModelShape.from_config(model.config), HALF, "joint")
    mla = convert_to_mla(model, rope="full", svd="joint", d_kv=d_kv)
    assert isinstance(mla, MLAForCausalLM)
    assert max_diff(mla(rows).logits, model(rows).logits) < 1e-4
    # decoding through the family's own masks (sliding windows) and our latent cache, absorbed too
    original = model.generate(rows[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy(mla, rows, absorb=False), original)
    assert torch.equal(greedy(mla, rows, absorb=True), original)


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_a_full_rank_latent_equals_partial_rope_alone(models, rows, family):
    model = models[family]
    shape = ModelShape.from_config(model.config)
    partial = convert_to_mla(model, rope="high", r=2, svd="none")(rows).logits
    joint = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=max_d_kv(shape, 2, "joint"))(rows).logits
    assert max_diff(joint, partial) < 1e-4
    assert max_diff(partial, model(rows).logits) > 1e-4  # partial RoPE does change the model


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_absorbed_decoding_equals_expanded_and_the_cache_holds_the_formulas_bytes(models, rows, family):
    model = models[family]
    shape = ModelShape.from_config(model.config)
    spec = dict(rope="high", r=2, svd="joint", d_kv=6)
    mla = convert_to_mla(model, **spec)
    expanded = mla(rows).logits
    absorbed = mla.set_absorb(True)(rows).logits
    assert max_diff(absorbed, expanded) < 1e-4

    cache = mla.new_cache()  # prefill 16 tokens, then decode the rest one by one, absorbed
    out = mla(rows[:, :16], cache=cache, use_cache=True)
    steps = [out.logits[:, -1]]
    for t in range(16, rows.shape[1]):
        steps.append(mla(rows[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
    assert max_diff(torch.stack(steps[:-1], 1), expanded[:, 15:-1]) < 1e-4
    held = cache_elements_per_sequence(
        shape, attention_windows(model.config), rows.shape[1], MLASpec.create(shape, **spec)
    )
    assert cache.nbytes() == rows.shape[0] * held["total"] * 4  # the tiny Gemmas' sliding layers: 7 of 24 tokens
    assert torch.equal(greedy(mla, rows, absorb=True), greedy(mla, rows, absorb=False))


def test_the_key_norm_costs_one_scalar_per_norm_group(models):
    per_head, whole = ModelShape.from_config(models["qwen3"].config), ModelShape.from_config(models["olmo2"].config)
    plain = ModelShape.from_config(models["mixtral"].config)
    spec = MLASpec.create(plain, rope="high", r=2, svd="joint", d_kv=6)
    assert (per_head.key_norm_scales, whole.key_norm_scales, plain.key_norm_scales) == (2, 1, 0)
    base = kv_elements_per_token(plain, spec)
    assert kv_elements_per_token(per_head, spec) == base + 2 and kv_elements_per_token(whole, spec) == base + 1


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_the_base_architecture_stays_the_familys_own(models, family):
    model = models[family]
    mla = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=6)
    assert type(mla.model) is type(model.model)
    for ours, theirs in zip(mla.model.layers, model.model.layers):
        assert type(ours) is type(theirs)
        assert type(ours.mlp) is type(theirs.mlp)  # MoE blocks included
    kept = {n for n in model.state_dict() if ".self_attn." not in n}
    assert kept <= set(mla.state_dict())


def _applies(strategy, family: str, model) -> bool:
    """RoRoPE's shared rope key mixes KV heads, which a per-head key norm forbids."""
    return not (strategy.layout == "shared" and family in ("qwen3", "qwen3_moe", "gemma3_text"))


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_and_init_converts_or_is_refused_naming_why(models, rows, family):
    model = models[family]
    for name in ROPE_STRATEGIES:
        strategy = ROPE_STRATEGIES.get(name)
        r = None if name in ("full", "none") else 2
        spec = dict(rope=name, r=r, svd="joint", d_kv=6, score=strategy.scores[0])
        if name == "full":
            spec["d_kv"] = 8
        if not _applies(strategy, family, model):
            with pytest.raises(ValueError, match="normalises each KV head's key by its own rms"):
                convert_to_mla(model, **spec, calibration=[rows])
            continue
        mla = convert_to_mla(model, **spec, calibration=[rows])
        assert max_diff(mla.set_absorb(True)(rows).logits, mla.set_absorb(False)(rows).logits) < 1e-4, name
    for init in LOWRANK_INITS:
        mla = convert_to_mla(model, rope="2-norm", r=2, svd="joint", d_kv=6, init=init, calibration=[rows])
        assert torch.isfinite(mla(rows).logits).all(), init


@torch.no_grad()
@pytest.mark.parametrize("family", ["olmo2", "mixtral", "phi3"])
def test_rorope_keeping_every_pair_is_exact(models, rows, family):
    """A norm over the whole key projection (OLMo-2) has one rms per token: RoRoPE's mixed keys keep it."""
    model = models[family]
    mla = convert_to_mla(model, rope="rorope", r=HALF, svd="none", calibration=[rows])
    assert max_diff(mla(rows).logits, model(rows).logits) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3", "olmo2", "gemma3_text"])
def test_calibration_reads_the_keys_after_the_norm(models, rows, family):
    """2-norm's key pair norms are those of the keys RoPE rotates: after the family's QK-norm."""
    model = models[family]
    shape = ModelShape.from_config(model.config)
    seen = []

    def capture(module, args, out):  # the norm's output, in whichever layout the family keeps it
        seen.append(out)

    layer = model.model.layers[0].self_attn
    handle = layer.k_norm.register_forward_hook(capture)
    model(rows)
    handle.remove()
    keys = seen[0]
    if family == "gemma3_text":  # normed after the head transpose: [B, n_kv, T, d_h]
        keys = keys.transpose(1, 2)
    keys = keys.reshape(*rows.shape, shape.num_kv_heads, shape.head_dim)
    pair = torch.sqrt(keys[..., :HALF] ** 2 + keys[..., HALF:] ** 2).mean(dim=1).mean(dim=0)  # [n_kv, half]
    _, k_norms = Calibration(model, [rows], shape).get("pair_norms")
    assert torch.allclose(k_norms[0], pair.float(), atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_loads_with_remote_code_without_the_package(models, rows, family, tmp_path):
    model = models[family]
    mla = convert_to_mla(model, rope="2-norm", r=2, svd="joint", d_kv=6, calibration=[rows])
    folder = tmp_path / "mla"
    mla.save_pretrained(folder)
    out = load_in_fresh_interpreter(folder, rows, tmp_path)
    with torch.no_grad():
        assert max_diff(out["logits"], mla(rows).logits) < 1e-5
        assert torch.equal(out["greedy_absorb=False"], greedy(mla, rows, absorb=False))
        assert torch.equal(out["greedy_absorb=True"], greedy(mla, rows, absorb=True))


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("qwen3", dict(attention_bias=True), "a key projection with both a bias and a key norm"),
        ("phi3", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ],
)
def test_what_cannot_be_exact_is_refused_naming_why(family, changes, message, rows):
    model = tiny_family_lm(family, **changes)
    with pytest.raises(ValueError, match=message):
        convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=6)


def test_an_unsupported_architecture_is_named():
    import transformers as tf

    model = tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(
            vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96
        )
    )
    with pytest.raises(ValueError, match="unsupported architecture 'gpt_neox'.*qwen3.*phi3"):
        convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=6)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
def test_lm_eval_runs_on_the_saved_folder_of_a_family(family, tmp_path, monkeypatch):
    """QK-norm, soft cap with sliding windows, MoE: lm-eval's hf model loads each with remote code."""
    from mha2mla_exp.models import byte_tokenizer

    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # lm-eval's batching must be deterministic for the exact comparison
    try:
        model = tiny_family_lm(family, vocab_size=320, max_position_embeddings=512)
        mla = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=4)
        lm_eval_matches_ours(mla, byte_tokenizer(model_max_length=512), tmp_path)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def test_a_folder_saved_before_families_loads_as_a_llama(tmp_path, rows):
    """Folders saved before `base_config` existed have none: they are Llamas, built as before."""
    from conftest import tiny_causal_lm
    from transformers import AutoModelForCausalLM

    mla = convert_to_mla(tiny_causal_lm("gqa"), rope="high", r=2, svd="joint", d_kv=6)
    mla.config.base_config = None
    mla.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.model).__name__ == "LlamaModel"
    assert max_diff(loaded(rows).logits, mla(rows).logits) == 0


@pytest.mark.parametrize("family, key_norm", [("qwen3", "head"), ("olmo2", "projection"), ("gemma2", "null")])
def test_the_runner_converts_trains_and_measures_a_random_model_of_a_family(tmp_path, family, key_norm):
    """model.family builds a tiny random model of any family: conversion, fine-tuning and the measured cache
    run through the runner as for a Llama; the cache holds what the formula (key-norm scalars included) says."""
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.runner import run, run_config, validate

    overrides = ["+experiment=smoke", "rope.r=2", "svd.d_kv=8", f"results_dir={tmp_path}"]
    overrides += [f"model.family={family}", f"model.shape.key_norm={key_norm}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    plan = validate(run_config(cfg))
    assert plan.conversion.shape.key_norm_scales == {"head": 2, "projection": 1, "null": 0}[key_norm]
    record = run(run_config(cfg))
    assert record["status"] == "ok", record["error"]
    assert record["kv"]["ratio_measured"] == pytest.approx(record["kv"]["ratio_nominal"], rel=1e-9)


def test_a_random_model_whose_key_norm_disagrees_with_its_family_is_refused_before_loading(tmp_path):
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.runner import run_config, validate
    from mha2mla_exp.runner.config import ConfigError

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=smoke", "model.family=qwen3"])
    with pytest.raises(ConfigError, match="model.shape.key_norm: family 'qwen3' normalises its keys per head"):
        validate(run_config(cfg))


def test_a_local_model_the_conversion_cannot_keep_exactly_is_refused_before_loading(tmp_path):
    """Read from config.json alone: a Phi-3 with partial rotary (Phi-4-mini's kind) is refused by validate."""
    import transformers as tf
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.runner import run_config, validate
    from mha2mla_exp.runner.config import ConfigError

    tf.Phi3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=320,
        partial_rotary_factor=0.75,
        pad_token_id=None,
    ).save_pretrained(tmp_path / "phi")
    overrides = ["+experiment=smoke", "model=local", f"model.id={tmp_path / 'phi'}", "rope.r=2", "svd.d_kv=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ConfigError, match=r"\(phi3\) cannot be converted exactly: partial_rotary_factor=0.75"):
        validate(run_config(cfg))
