"""Attention-only decode microbenchmark at one Llama-2-7B-shaped layer: SDPA over the MHA cache vs
absorbed attention over the MLA cache (plain PyTorch, and the fused Triton kernel on CUDA), with the
bytes-ratio bound 2*d_h/(2r+d_kv) next to the measured speedups."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mla.kernels import absorbed_decode_reference, triton_available
from .timing import measure

LAYER = {"num_heads": 32, "num_kv_heads": 32, "head_dim": 128, "r": 8, "d_kv": 16}


def bound(head_dim: int, r: int, d_kv: int) -> float:
    return 2 * head_dim / (2 * r + d_kv)


@torch.no_grad()
def run_attention(
    batches,
    contexts,
    device: torch.device,
    dtype: torch.dtype,
    *,
    warmup: int,
    repeats: int,
    budget: int,
    layer: dict = LAYER,
) -> list[dict]:
    n_h, n_kv, d_h, r, d_kv = (layer[k] for k in ("num_heads", "num_kv_heads", "head_dim", "r", "d_kv"))
    width, rope = n_kv * d_kv, 2 * r
    nope = d_h - rope
    scale = d_h**-0.5
    elt = torch.finfo(dtype).bits // 8
    rows = []
    for b in batches:
        for s in contexts:
            mha_bytes = 2 * b * s * n_kv * d_h * elt
            mla_bytes = b * s * (width + n_kv * rope) * elt
            if mha_bytes + mla_bytes > budget:
                rows.append({"batch": b, "context": s, "variant": "all", "status": "skipped: over memory budget"})
                continue
            g = torch.Generator(device=device).manual_seed(0)

            def rand(*shape):
                return torch.randn(*shape, generator=g, device=device, dtype=dtype)

            q, k, v = rand(b, n_h, 1, d_h), rand(b, n_kv, s, d_h), rand(b, n_kv, s, d_h)
            q_rope, q_nope, k_rope, latent = (
                rand(b, n_h, rope),
                rand(b, n_h, nope),
                rand(b, n_kv, s, rope),
                rand(b, s, width),
            )
            w_uk, w_uv = rand(n_kv, nope, width) * 0.05, rand(n_kv, d_h, width) * 0.05
            q_latent = rand(b, n_h, width)
            whole = slice(0, width)
            variants = {
                "mha_sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), mha_bytes),
                "absorbed_plain": (
                    lambda: absorbed_decode_reference(q_rope, q_latent, k_rope, latent, whole, whole, scale),
                    mla_bytes,
                ),
            }
            if device.type == "cuda" and triton_available():
                from ..mla.decode_triton import absorbed_decode_triton

                def triton_core():
                    return absorbed_decode_triton(q_rope, q_latent, k_rope, latent, whole, whole, scale)

                def triton_with_projections():  # W_uk folded into the query, W_uv applied after
                    ql = torch.einsum("bkn,knl->bkl", q_nope, w_uk)
                    out = absorbed_decode_triton(q_rope, ql, k_rope, latent, whole, whole, scale)
                    return torch.einsum("bkl,kdl->bkd", out, w_uv)

                variants["absorbed_triton"] = (triton_core, mla_bytes)
                variants["absorbed_triton_with_projections"] = (triton_with_projections, mla_bytes)
            times = {}
            for name, (fn, nbytes) in variants.items():
                stats = measure(fn, device, warmup=warmup, repeats=repeats)
                times[name] = stats["median"]
                rows.append(
                    {
                        "batch": b,
                        "context": s,
                        "variant": name,
                        "status": "ok",
                        "bytes_read": nbytes,
                        **{f"s_{k}": v for k, v in stats.items()},
                        "gb_per_s": nbytes / stats["median"] / 1e9,
                    }
                )
            limit = bound(d_h, r, d_kv)
            for row in rows[-len(variants) :]:
                row["speedup_vs_mha"] = times["mha_sdpa"] / row["s_median"]
                row["bound"] = limit
                row["fraction_of_bound"] = row["speedup_vs_mha"] / limit
            del q, k, v, k_rope, latent
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
