"""DeepSeek-V3's config and weights from an MLA model in the 'shared' layout (see plan.py for what qualifies).

Per layer (n_h heads of d_h, n_kv KV heads, K kept pairs, latent L; DeepSeek's names on the left):
- q_proj, per head h: [q_h * a (d_h NoPE rows); q_h at the kept pairs' dims * q_rope_scale[h] * a (2K rope rows,
  interleaved)], a = sqrt((d_h + 2K) / d_h): DeepSeek scales scores by (qk_nope + qk_rope)^-1/2, we by d_h^-1/2
  (or the source's attention scaling).
- kv_a_proj_with_mqa: [kv_down_proj * s (L rows); k_rope_proj (2K rows, interleaved)]; kv_a_layernorm weight
  sqrt(eps)/s (norm.py: the norm is then the identity to its measured residual).
- kv_b_proj, per head h of KV group g: [k_up rows of g (d_h); v_up rows of g (d_h)] over the whole latent (zero
  columns where 'split' keeps K and V apart; the identity where svd='none' keeps values as they are).
- o_proj, MLP (first_k_dense_replace = every layer: the dense Llama MLP), norms, embeddings: as they are;
  lm_head written out (DeepSeek does not tie it).
Our rope dims are rotate_half ([real parts | imaginary parts]); DeepSeek's (rope_interleave, vLLM's
is_neox_style=False) interleave each pair: row 2j <- j, row 2j+1 <- K + j.
"""

from __future__ import annotations

import math

import torch

from .plan import ExportPlan


def interleave(rows: int) -> torch.Tensor:
    """The row order taking [x_0..x_{K-1} | y_0..y_{K-1}] (rotate_half) to [x_0, y_0, x_1, y_1, ...]."""
    half = rows // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def exact_rope_parameters(theta: float, max_positions: int) -> dict:
    """DeepSeek's rope as YaRN at factor 1: the default rope's frequencies and scale, on a path that is exact in
    every vLLM mode. vLLM serves `rope_type: default` with its C++ rotary op in eager mode on the CPU, which rotates
    MLA's 3-D non-contiguous q/k slices wrongly (issue 54); a YaRN config takes its DeepSeek YaRN class, plain
    PyTorch. At factor 1: interpolated = extrapolated frequencies (1/(1*p) = 1/p), every mscale is 1 (YaRN's
    0.1*m*ln(factor)+1 is 1 for factor <= 1), so neither the rope's cos/sin nor DeepSeek's softmax scale (times
    mscale^2) change; beta_fast = beta_slow = max_positions puts YaRN's correction range at dim 0 (L/(2 pi beta)
    < 1 rotation), so its blend weights are exactly 0 or 1 and the blend adds no rounding. `original_max_position_
    embeddings` = max_positions: vLLM builds its cos/sin table that long (times factor 1), and transformers'
    implied factor is 1 (no warning). tests/test_export.py checks all of this against transformers in fp64."""
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 1.0,
        "original_max_position_embeddings": max_positions,
        "beta_fast": max_positions,
        "beta_slow": max_positions,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def deepseek_config(config, plan: ExportPlan) -> dict:
    """The DeepSeek-V3 config.json keys (every key vLLM's deepseek_v2.py and HF's DeepseekV3 read)."""
    n = config.num_hidden_layers
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,  # MLA: every head has its own expanded K/V
        "q_lora_rank": None,
        "kv_lora_rank": plan.latent,
        "qk_rope_head_dim": plan.rope_dim,
        "qk_nope_head_dim": plan.nope_dim,
        "v_head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": exact_rope_parameters(plan.theta_export, config.max_position_embeddings),
        "rope_theta": plan.theta_export,  # older readers (transformers < 5) read it here
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        # every layer dense: no MoE is built (vLLM: n_routed_experts and layer >= first_k_dense_replace)
        "first_k_dense_replace": n,
        "moe_layer_freq": 1,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": config.intermediate_size,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "initializer_range": config.initializer_range,
        "use_cache": True,
    }


def _full(linear, identity_rows: int, latent: int, cols: slice) -> torch.Tensor:
    """[rows, latent]: `linear`'s weight (or the identity when None) placed at the latent columns it reads."""
    w = torch.eye(identity_rows, dtype=torch.float64) if linear is None else linear.weight.double()
    out = torch.zeros(w.shape[0], latent, dtype=torch.float64)
    out[:, cols] = w
    return out


def attention_state(attn, plan: ExportPlan, latent_scale: float) -> dict[str, torch.Tensor]:
    """One layer's DeepSeek attention weights (float64; the caller casts) from an `MLAAttention`."""
    n_h, n_kv, d_h = attn.num_heads, attn.num_kv_heads, attn.head_dim
    d = attn.q_proj.in_features
    perm = interleave(attn.rope_dim)
    a = attn.scaling * math.sqrt(plan.nope_dim + plan.rope_dim)  # our score scale over DeepSeek's
    q = attn.q_proj.weight.double().view(n_h, d_h, d)
    scale = attn.q_rope_scale.double().repeat(1, 2)  # [n_h, 2K]: the same factor on a pair's two dims
    q_rope = (q[:, attn.rope_index[0]] * scale[:, :, None])[:, perm]
    q_proj = torch.cat([q, q_rope], dim=1) * a  # [n_h, d_h + 2K, d]
    kv_a = torch.cat([attn.kv_down_proj.weight.double() * latent_scale, attn.k_rope_proj.weight.double()[perm]])
    latent = attn.latent_dim
    k_up = _full(attn.k_up_proj, latent, latent, attn.k_latent).view(n_kv, attn.nope_dim, latent)
    v_up = _full(attn.v_up_proj, n_kv * d_h, latent, attn.v_latent).view(n_kv, d_h, latent)
    group = torch.arange(n_h) // (n_h // n_kv)
    kv_b = torch.cat([k_up[group], v_up[group]], dim=1)  # [n_h, d_h + d_h, L]
    return {
        "q_proj.weight": q_proj.reshape(-1, d),
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_b_proj.weight": kv_b.reshape(-1, latent),
        "o_proj.weight": attn.o_proj.weight.double(),
    }


def deepseek_state(model, plan: ExportPlan, norm_weights: list[float], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The whole DeepSeek-V3 state dict; `norm_weights[l]` is layer l's kv_a_layernorm weight sqrt(eps)/s_l."""
    eps = model.config.rms_norm_eps
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn." in name or name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to(dtype).clone()
    state["lm_head.weight"] = model.get_output_embeddings().weight.detach().to(dtype).clone()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        s = math.sqrt(eps) / norm_weights[i]
        prefix = f"model.layers.{i}.self_attn."
        state.update({prefix + k: v.to(dtype).contiguous() for k, v in attention_state(attn, plan, s).items()})
        state[prefix + "kv_a_layernorm.weight"] = torch.full((attn.latent_dim,), norm_weights[i], dtype=dtype)
    return state
