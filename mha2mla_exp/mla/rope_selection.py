"""Step 1 of MHA2MLA: which RoPE frequency pairs each KV head keeps.

Pairs follow the Hugging Face `rotate_half` layout: pair k is dims (k, k + d_h/2) and k = 0 is the
highest frequency. Every function returns, per layer and KV head, the sorted kept pair indices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .spec import MLASpec, ModelShape


def fixed_pairs(strategy: str, r: int, head_dim: int) -> list[int]:
    """The data-free strategies; the same pairs for every layer and head."""
    half = head_dim // 2
    if strategy == "full":
        return list(range(half))
    if strategy == "none" or r == 0:
        return []
    if strategy == "high":
        return list(range(r))
    if strategy == "low":
        return list(range(half - r, half))
    if strategy == "uniform":
        return sorted({(k * head_dim) // (2 * r) for k in range(r)})
    raise ValueError(f"strategy {strategy!r} is not a fixed selection")


def rope_dims(pairs, head_dim: int) -> list[list[int]]:
    """Per KV head, the head dims that keep RoPE: the kept pairs `p` then their partners `p + d_h/2`."""
    return [list(kept) + [k + head_dim // 2 for k in kept] for kept in pairs]


def pair_scores(
    q_norms: torch.Tensor, k_norms: torch.Tensor, num_kv_heads: int, score: str = "product"
) -> torch.Tensor:
    """Per-KV-head pair scores from mean pre-RoPE pair norms.

    q_norms: [n_h, d_h/2], k_norms: [n_kv, d_h/2]. Each query head is scored against its KV head
    (||q||*||k|| as in the paper, or ||q||+||k|| as in the code behind the v1 tables), and the
    query heads of a GQA group are summed, so both scores rank the same as per-group averages.
    """
    n_h, half = q_norms.shape
    group = n_h // num_kv_heads
    k_rep = k_norms.repeat_interleave(group, dim=0)
    per_q_head = q_norms * k_rep if score == "product" else q_norms + k_rep
    return per_q_head.view(num_kv_heads, group, half).sum(dim=1)


def top_pairs(scores: torch.Tensor, r: int) -> list[list[int]]:
    """Sorted indices of the r highest-scoring pairs for each KV head (ties go to lower index)."""
    if r == 0:
        return [[] for _ in range(scores.shape[0])]
    # stable descending sort so that equal scores prefer the higher-frequency (lower) pair
    order = torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices[:, :r]
    return [sorted(row.tolist()) for row in order]


@torch.no_grad()
def calibrate_pair_norms(
    model: nn.Module, calibration: Iterable, shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean pre-RoPE pair norms of every layer's queries and keys over the calibration batches.

    Returns q_norms [L, n_h, d_h/2] and k_norms [L, n_kv, d_h/2]: averaged over tokens within each
    sequence, then over sequences. Hooks read the q/k projections' outputs (bias included).
    """
    layers = _attention_layers(model)
    half = shape.head_dim // 2
    device = next(model.parameters()).device
    q_sum = torch.zeros(shape.num_layers, shape.num_heads, half, dtype=torch.float64)
    k_sum = torch.zeros(shape.num_layers, shape.num_kv_heads, half, dtype=torch.float64)
    n_seqs = 0

    def pair_norm_per_seq(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.float().view(*x.shape[:-1], heads, shape.head_dim)
        norms = torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2)  # [B, T, heads, half]
        return norms.mean(dim=1).sum(dim=0).double().cpu()  # token mean per sequence, summed over batch

    def accumulate(total: torch.Tensor, heads: int):
        def hook(module, args, out):  # returns None: the forward is left as it is
            total.add_(pair_norm_per_seq(out, heads))
        return hook

    hooks = []
    for i, attn in enumerate(layers):
        hooks.append(attn.q_proj.register_forward_hook(accumulate(q_sum[i], shape.num_heads)))
        hooks.append(attn.k_proj.register_forward_hook(accumulate(k_sum[i], shape.num_kv_heads)))
    was_training = model.training
    model.eval()
    try:
        for batch in calibration:
            input_ids = batch["input_ids"] if isinstance(batch, dict) else batch
            input_ids = torch.as_tensor(input_ids)
            if input_ids.dim() == 1:
                input_ids = input_ids.unsqueeze(0)
            model(input_ids=input_ids.to(device), use_cache=False)
            n_seqs += input_ids.shape[0]
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    if n_seqs == 0:
        raise ValueError("rope='2-norm' got an empty calibration iterable")
    return (q_sum / n_seqs).float(), (k_sum / n_seqs).float()


def select_rope_pairs(
    spec: MLASpec,
    shape: ModelShape,
    *,
    model: nn.Module | None = None,
    calibration: Iterable | None = None,
) -> list[list[list[int]]]:
    """Kept pairs per layer and KV head: `[L][n_kv][r]`, each list sorted."""
    if spec.rope != "2-norm":
        pairs = fixed_pairs(spec.rope, spec.r, shape.head_dim)
        return [[list(pairs) for _ in range(shape.num_kv_heads)] for _ in range(shape.num_layers)]
    if calibration is None:
        raise ValueError("rope='2-norm' needs calibration data (an iterable of input_ids batches)")
    q_norms, k_norms = calibrate_pair_norms(model, calibration, shape)
    return [
        top_pairs(pair_scores(q_norms[i], k_norms[i], shape.num_kv_heads, spec.score), spec.r)
        for i in range(shape.num_layers)
    ]


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]
