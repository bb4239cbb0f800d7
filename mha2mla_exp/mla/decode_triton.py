"""Triton flash-decoding kernel for one absorbed MLA decode step.

Layout: the latent `[B, S, L]` is shared by ALL query heads, so one program takes a block of
BLOCK_H heads and reads each latent tile once for all of them (two tensor-core dots: scores
against the key slice, probabilities times the value slice; under svd='joint' both slices are
the same tile, loaded once). The per-KV-head rope keys `[B, n_kv, S, 2r]` are small and read
per head. The sequence is split into NUM_SPLITS chunks (split-K) so that a small batch still
fills the GPU; each chunk keeps an online softmax, and a second kernel merges the chunks by
their log-sum-exp. Importing this module imports triton (`decode_dispatch` only does so when it imports).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # an optional dependency: transformers scans a checkpoint's code for imports, but not inside `try`
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("the Triton decode kernel needs triton: pip install 'mha2mla_exp[kernels]'") from err

_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    QR, QL, KR, LAT, VSTART, VEND, OPART, LSE,
    s_qr_b, s_qr_h, s_ql_b, s_ql_h,
    s_kr_b, s_kr_h, s_kr_s,
    s_lat_b, s_lat_s,
    s_op_b, s_op_h, s_op_sp,
    s_lse_b, s_lse_h,
    n_heads, group, seq_len, split_len, k_start, v_start, L_K, L_V, R, qk_scale,
    HAS_ROPE: tl.constexpr, HAS_VALID: tl.constexpr, SAME_KV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_LK: tl.constexpr, BLOCK_LV: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # batch offsets into a large cache overflow int32
    sp = tl.program_id(2)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < n_heads
    offs_lk = tl.arange(0, BLOCK_LK)
    offs_lv = tl.arange(0, BLOCK_LV)
    lk_ok = offs_lk < L_K
    lv_ok = offs_lv < L_V

    q_lat = tl.load(QL + b * s_ql_b + offs_h[:, None] * s_ql_h + offs_lk[None, :],
                    mask=h_ok[:, None] & lk_ok[None, :], other=0.0)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        q_rope = tl.load(QR + b * s_qr_b + offs_h[:, None] * s_qr_h + offs_r[None, :],
                         mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        kr_base = KR + b * s_kr_b + (offs_h // group)[:, None, None] * s_kr_h + offs_r[None, None, :]
        kr_ok = h_ok[:, None, None] & r_ok[None, None, :]

    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if HAS_VALID:
        lo = tl.maximum(lo, tl.load(VSTART + b))
        hi = tl.minimum(hi, tl.load(VEND + b))

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_LV], tl.float32)
    lat_base = LAT + b * s_lat_b
    for s0 in range(lo, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < hi
        k_tile = tl.load(lat_base + offs_s[:, None] * s_lat_s + k_start + offs_lk[None, :],
                         mask=s_ok[:, None] & lk_ok[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(k_tile), input_precision=PRECISION)  # [BLOCK_H, BLOCK_S]
        if HAS_ROPE:
            k_r = tl.load(kr_base + offs_s[None, :, None] * s_kr_s, mask=kr_ok & s_ok[None, :, None], other=0.0)
            scores += tl.sum(k_r.to(tl.float32) * q_rope[:, None, :], axis=2)
        scores = tl.where(s_ok[None, :], scores * qk_scale, float("-inf"))
        # every tile holds at least one valid position, so m_new is finite and nothing is NaN
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SAME_KV:
            v_tile = k_tile
        else:
            v_tile = tl.load(lat_base + offs_s[:, None] * s_lat_s + v_start + offs_lv[None, :],
                             mask=s_ok[:, None] & lv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(OPART + b * s_op_b + offs_h[:, None] * s_op_h + sp * s_op_sp + offs_lv[None, :], acc,
             mask=h_ok[:, None] & lv_ok[None, :])
    tl.store(LSE + b * s_lse_b + offs_h * s_lse_h + sp, lse, mask=h_ok)


@triton.jit
def _merge_kernel(
    OPART, LSE, OUT,
    s_op_b, s_op_h, s_op_sp, s_lse_b, s_lse_h, s_o_b, s_o_h,
    num_splits, L_V,
    BLOCK_SP: tl.constexpr, BLOCK_LV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_sp = tl.arange(0, BLOCK_SP)
    offs_lv = tl.arange(0, BLOCK_LV)
    lv_ok = offs_lv < L_V
    lse_base = LSE + b * s_lse_b + h * s_lse_h
    lse = tl.load(lse_base + offs_sp, mask=offs_sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no valid position at all: the output is zero
    denom = tl.sum(tl.exp2(lse - m), axis=0)
    # one split's row at a time: a [splits, L_V] tile would not fit in registers at L_V=512
    acc = tl.zeros([BLOCK_LV], tl.float32)
    part_base = OPART + b * s_op_b + h * s_op_h + offs_lv
    for sp in range(0, num_splits):
        w = tl.exp2(tl.load(lse_base + sp) - m)
        acc += w * tl.load(part_base + sp * s_op_sp, mask=lv_ok, other=0.0)
    out = acc / tl.maximum(denom, 1e-30)
    tl.store(OUT + b * s_o_b + h * s_o_h + offs_lv, out.to(OUT.dtype.element_ty), mask=lv_ok)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(batch: int, n_heads: int, seq_len: int, latent_width: int, device: torch.device) -> dict:
    """Launch parameters: heads per program, tile length, number of sequence splits, warps.

    Chosen without a GPU at hand (see `tune.py` for the sweep that checks them): the fp32
    accumulator [BLOCK_H, L_v] must stay in registers, so wide latents get 16 heads per program
    and 8 warps. Enough splits that about two programs per SM are in flight, but no split shorter
    than 256 tokens (each split costs a partial-result write and a merge read).
    """
    width = triton.next_power_of_2(latent_width)
    block_h = min(max(16, triton.next_power_of_2(n_heads)), 32 if width <= 256 else 16)
    warps = 8 if block_h * width >= 16 * 512 else 4
    block_s = 32 if width <= 512 else 16
    head_blocks = triton.cdiv(n_heads, block_h)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    splits = triton.cdiv(2 * sms, batch * head_blocks)
    splits = max(1, min(splits, triton.cdiv(seq_len, 256), 128))
    return {"BLOCK_H": block_h, "BLOCK_S": block_s, "num_splits": splits, "num_warps": warps, "num_stages": 2}


def absorbed_decode_triton(
    q_rope, q_latent, k_rope, latent, k_slice: slice, v_slice: slice, scale: float,
    valid_start=None, valid_end=None, config: dict | None = None,
) -> torch.Tensor:
    """The Triton version of `absorbed_decode_reference` (same arguments, same result)."""
    b, n_h, l_k = q_latent.shape
    n_kv, s, r = k_rope.shape[1], latent.shape[1], q_rope.shape[-1]
    l_v = v_slice.stop - v_slice.start
    if l_k != k_slice.stop - k_slice.start:
        raise ValueError(f"q_latent width {l_k} does not match the key slice {k_slice}")
    if n_h % n_kv:
        raise ValueError(f"{n_h} query heads are not a multiple of {n_kv} KV heads")
    # the kernels index the last dim with unit stride
    q_rope, q_latent, k_rope, latent = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q_rope, q_latent, k_rope, latent))
    cfg = default_config(b, n_h, s, max(l_k, l_v), latent.device) | (config or {})
    block_h, block_s, splits = cfg["BLOCK_H"], cfg["BLOCK_S"], cfg["num_splits"]
    split_len = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s  # whole tiles per split
    splits = triton.cdiv(s, split_len)

    dev = latent.device
    o_part = torch.empty(b, n_h, splits, l_v, device=dev, dtype=torch.float32)
    lse = torch.empty(b, n_h, splits, device=dev, dtype=torch.float32)
    out = torch.empty(b, n_h, l_v, device=dev, dtype=latent.dtype)
    has_valid = valid_start is not None or valid_end is not None
    if has_valid:
        valid_start = (torch.zeros(b, device=dev, dtype=torch.int32) if valid_start is None
                       else valid_start.to(device=dev, dtype=torch.int32))
        valid_end = (torch.full((b,), s, device=dev, dtype=torch.int32) if valid_end is None
                     else valid_end.to(device=dev, dtype=torch.int32))
    same_kv = k_slice == v_slice
    # fp32 inputs: exact products (tl.dot would use tf32 on the GPU); 16-bit inputs: tensor cores
    precision = "ieee" if latent.dtype == torch.float32 else "tf32"
    if not r:  # NoPE: the rope arguments are never read; pass real tensors, not empty ones
        q_rope, k_rope = q_latent, latent.unsqueeze(1)
    _split_kernel[(triton.cdiv(n_h, block_h), b, splits)](
        q_rope, q_latent, k_rope, latent, valid_start, valid_end, o_part, lse,
        q_rope.stride(0), q_rope.stride(1), q_latent.stride(0), q_latent.stride(1),
        k_rope.stride(0), k_rope.stride(1), k_rope.stride(2),
        latent.stride(0), latent.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        n_h, n_h // n_kv, s, split_len, k_slice.start, v_slice.start, l_k, l_v, r, scale * _LOG2E,
        HAS_ROPE=r > 0, HAS_VALID=has_valid, SAME_KV=same_kv,
        BLOCK_H=block_h, BLOCK_S=block_s,
        BLOCK_LK=max(16, triton.next_power_of_2(l_k)), BLOCK_LV=max(16, triton.next_power_of_2(l_v)),
        BLOCK_R=max(2, triton.next_power_of_2(max(r, 1))), PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    _merge_kernel[(b, n_h)](
        o_part, lse, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), splits, l_v,
        BLOCK_SP=max(2, triton.next_power_of_2(splits)), BLOCK_LV=max(16, triton.next_power_of_2(l_v)),
        num_warps=4,
    )
    return out


def interpreted() -> bool:
    """Whether triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
