"""Tiny random decoders of every family the converter takes (mla/families.py), built from stock transformers
configs, with random non-zero biases, norm weights and gains (random init leaves biases at zero and norms at their
identity, which would hide a bias or a gain that the conversion drops). The tests and the family matrix
(`python -m mha2mla_exp.bench.families`) convert them."""

from __future__ import annotations

import torch
import transformers as tf

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=16,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (config class, model class, extra config); sliding windows shorter than the test rows so they count
FAMILY_MODELS = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(attention_bias=False)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(num_experts=4, **MOE)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0),
    ),
    "gemma3_text": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=2),
    ),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        tf.Qwen2MoeConfig,
        tf.Qwen2MoeForCausalLM,
        dict(num_experts=4, shared_expert_intermediate_size=32, **MOE),
    ),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
}
FAMILIES = tuple(FAMILY_MODELS)


def tiny_family_lm(family: str, *, seed: int = 0, vocab_size: int = 97, **changes) -> torch.nn.Module:
    """A float32 random causal LM of `family` (GQA 4 query / 2 KV heads, head_dim 16, hidden 64, 2 layers)."""
    config_class, model_class, extra = FAMILY_MODELS[family]
    fields = COMMON | extra | {"vocab_size": vocab_size} | changes
    if family == "phi3":  # Phi3Config derives head_dim from hidden/heads
        fields.pop("head_dim")
    torch.manual_seed(seed)
    model = model_class(config_class(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name:  # Gemma's norms scale by 1 + w (zero-initialised), the others by w (ones)
                param.normal_(0, 0.3) if family.startswith("gemma") else param.uniform_(0.5, 1.5)
    return model.eval()
