"""Shared fixtures: tiny random Llama-family models for mechanics tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_causal_lm(kind: str = "gqa", *, seed: int = 0, layers: int = 2, tie: bool = False):
    """A float32 random model: 'mha' (4 heads), 'gqa' (4 query / 2 KV heads), 'qwen2' (GQA with q/k/v biases)
    or 'mistral' (GQA). head_dim 16, hidden 64."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4 if kind == "mha" else 2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    if kind in ("mha", "gqa"):
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random init zeroes biases; make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(kind)
    return model.eval()


@pytest.fixture(params=["mha", "gqa", "qwen2"])
def tiny_model(request):
    return tiny_causal_lm(request.param)


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2, 24), generator=g)


def tiny_byte_lm():
    """The model section of a tiny random Llama with the byte-level tokenizer."""
    from mha2mla_exp.schema.sections import ModelConfig, ShapeConfig

    shape = ShapeConfig(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rope_base=10000, context_length=512
    )
    return ModelConfig(
        name="tiny-random", source="random", dtype="float32", shape=shape, vocab_size=320, intermediate_size=128, seed=0
    )


TINY_BYTE_LM = tiny_byte_lm()


@pytest.fixture(scope="module")
def tiny():
    """(model, byte tokenizer): a tiny random Llama with a real tokenizer, for the evaluation tests;
    one thread, so that lm-eval's batching is deterministic."""
    from mha2mla_exp.models import build_random_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = build_random_model(TINY_BYTE_LM)
    yield model.eval(), tokenizer
    torch.set_num_threads(threads)
