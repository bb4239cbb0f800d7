"""The hub model configs of the decoder families the converter takes (issue 46: conf/model/<family>.yaml): each
one's shape facts agree with its config.json as transformers reads it, and each composes into a conversion plan
that validates offline, whose KV cache counts the family's key norm (n_kv scales per token and layer for a per-head
QK-norm, one for a norm over the whole key projection). No weight and no hub file is read."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from omegaconf import OmegaConf

from mha2mla_exp.mla.families import FAMILIES, family_of, unsupported_features
from mha2mla_exp.mla.spec import kv_elements_per_token, kv_ratio
from mha2mla_exp.models import check_shape
from mha2mla_exp.runner import ConfigError, run_config, validate
from mha2mla_exp.schema.sections import ShapeConfig
from tests.test_configs import compose_cfg

# The config.json entries each yaml's shape and sizes come from, transcribed from the copies its comment names;
# keys a config.json leaves out (Gemma's tie_word_embeddings, head_dim where it is hidden/heads) take the
# transformers config class's defaults, as loading the real file does.
CONFIG_JSON = {
    "qwen3_0_6b": dict(
        model_type="qwen3",
        num_hidden_layers=28,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1000000,
        max_position_embeddings=32768,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3_moe_30b_a3b": dict(
        model_type="qwen3_moe",
        num_hidden_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1000000,
        max_position_embeddings=32768,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "olmo2_1b": dict(
        model_type="olmo2",
        num_hidden_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=16,
        rope_theta=500000,
        max_position_embeddings=4096,
        intermediate_size=8192,
        vocab_size=100352,
        tie_word_embeddings=False,
    ),
    "gemma2_2b": dict(
        model_type="gemma2",
        num_hidden_layers=26,
        hidden_size=2304,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        intermediate_size=9216,
        vocab_size=256000,
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
    "gemma3_1b": dict(  # the pre-5.0 keys: transformers builds rope_parameters per layer type from them
        model_type="gemma3_text",
        num_hidden_layers=26,
        hidden_size=1152,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        rope_theta=1000000,
        rope_local_base_freq=10000,
        max_position_embeddings=32768,
        intermediate_size=6912,
        vocab_size=262144,
        query_pre_attn_scalar=256,
        sliding_window=512,
    ),
    "mixtral_8x7b": dict(
        model_type="mixtral",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "qwen2_moe_a2_7b": dict(
        model_type="qwen2_moe",
        num_hidden_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=16,
        rope_theta=1000000.0,
        max_position_embeddings=8192,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts=60,
        num_experts_per_tok=4,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "phi3_mini": dict(
        model_type="phi3",
        num_hidden_layers=32,
        hidden_size=3072,
        num_attention_heads=32,
        num_key_value_heads=32,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        intermediate_size=8192,
        vocab_size=32064,
        tie_word_embeddings=False,
        sliding_window=2047,
    ),
    "llama3_2_1b": dict(
        model_type="llama",
        num_hidden_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        max_position_embeddings=131072,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "mistral_7b": dict(
        model_type="mistral",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=10000.0,
        max_position_embeddings=32768,
        sliding_window=4096,
        intermediate_size=14336,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "qwen2_5_0_5b": dict(
        model_type="qwen2",
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
HUB_IDS = {
    "qwen3_0_6b": "Qwen/Qwen3-0.6B-Base",
    "qwen3_moe_30b_a3b": "Qwen/Qwen3-30B-A3B-Base",
    "olmo2_1b": "allenai/OLMo-2-0425-1B",
    "gemma2_2b": "google/gemma-2-2b",
    "gemma3_1b": "google/gemma-3-1b-pt",
    "mixtral_8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2_moe_a2_7b": "Qwen/Qwen1.5-MoE-A2.7B",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
    "llama3_2_1b": "meta-llama/Llama-3.2-1B",
    "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B",
}
NAMES = sorted(CONFIG_JSON)
MLA = ["variant=mla", "svd=joint", "svd.d_kv=32"]


def plan(name: str, rope: str = "2-norm"):
    """The validated plan of `name` converted (no CPU bf16 timing: `auto` precision pinned to fp32, as in
    tests/test_configs.py)."""
    pinned = lambda *_: (False, "pinned by the test")  # noqa: E731
    return validate(run_config(compose_cfg([f"model={name}", f"rope={rope}", *MLA])), bf16_pays=pinned)


def config_json(name: str):
    """The transformers config the hub's config.json of `name` loads into (built from the transcription)."""
    fields = dict(CONFIG_JSON[name])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def test_every_family_has_a_config():
    assert {config_json(name).model_type for name in NAMES} == set(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_shape_facts_are_the_config_json_s(name):
    """What `check_shape` compares after the download holds, and the memory estimate's sizes are the file's."""
    model = compose_cfg([f"model={name}"]).model
    assert (model.source, model.id, model.revision, model.dtype) == ("hub", HUB_IDS[name], None, "auto")
    assert model.finetune_length is None and model.paper_name is None
    config = config_json(name)
    check_shape(config, ShapeConfig(**OmegaConf.to_container(model.shape)), name)  # raises on any mismatch
    assert model.shape.key_norm == family_of(config).qk_norm  # stated by the yaml, not left to the download
    sizes = model.sizes
    assert (sizes.intermediate_size, sizes.vocab_size, sizes.tied_embeddings) == (
        config.intermediate_size,
        config.vocab_size,
        config.tie_word_embeddings,
    )
    assert unsupported_features(config) == []  # Phi-3-mini-4k: no partial_rotary_factor


@pytest.mark.parametrize("name", NAMES)
def test_conversion_plan_validates_and_caches_the_key_norm(name):
    """The paper's default conversion (2-norm, r = d_h/16, joint SVD of d_kv 32) plans offline; its cache per token
    and layer is the rope keys, the latent and, under a key norm, one 1/rms per norm group."""
    planned = plan(name)
    shape, spec = planned.conversion.shape, planned.conversion.spec
    facts = compose_cfg([f"model={name}"]).model.shape
    assert shape.key_norm == facts.key_norm
    assert (shape.num_kv_heads, shape.head_dim) == (facts.num_kv_heads, facts.head_dim)
    n_kv, d_h = shape.num_kv_heads, shape.head_dim
    assert (spec.rope, spec.r, spec.svd, spec.d_kv) == ("2-norm", d_h // 16, "joint", 32)
    scales = {None: 0, "head": n_kv, "projection": 1}[facts.key_norm]
    elements = n_kv * 2 * spec.r + n_kv * 32 + scales
    assert kv_elements_per_token(shape, spec) == elements
    assert kv_ratio(shape, spec) == pytest.approx(elements / (2 * n_kv * d_h))
    plain = dataclasses.replace(shape, key_norm=None)  # the same shape without the family's key norm
    assert kv_elements_per_token(shape, spec) - kv_elements_per_token(plain, spec) == scales
    # offline (tests/conftest.py), the hub's config.json is not read: the architecture is said to be unchecked
    notes = planned.launch.notes
    assert any(HUB_IDS[name] in note and "unknown until download" in note for note in notes), notes


def test_qwen3_plan_caches_one_scale_per_kv_head():
    """Qwen3-0.6B-Base: 8 KV heads of 128 dims, r 8, d_kv 32: 8*16 rope + 8*32 latent + 8 scales of 2*8*128."""
    planned = plan("qwen3_0_6b")
    assert kv_elements_per_token(planned.conversion.shape, planned.conversion.spec) == 8 * 16 + 8 * 32 + 8
    assert kv_ratio(planned.conversion.shape, planned.conversion.spec) == pytest.approx(392 / 2048)


@pytest.mark.parametrize("name, refused", [("qwen3_0_6b", True), ("gemma3_1b", False), ("olmo2_1b", False)])
def test_a_shared_rope_key_is_refused_under_a_per_head_key_norm(name, refused):
    """RoRoPE mixes the KV heads into one rope key: with a 1/rms per KV head (Qwen3's 8) that is not exact, so the
    plan refuses it before loading; one KV head (Gemma-3-1B) or a norm over the whole projection (OLMo-2) is."""
    if refused:
        with pytest.raises(ConfigError, match="rms"):
            plan(name, rope="rorope")
    else:
        assert plan(name, rope="rorope").conversion.spec.rope == "rorope"
