"""Triton flash-decoding kernel for one absorbed MLA decode step.

Layout: the latent `[B, S, L]` is shared by ALL query heads, so one program takes a block of
BLOCK_H heads and reads each latent tile once for all of them (two tensor-core dots: scores
against the key slice, probabilities times the value slice; under svd='joint' both slices are
the same tile, loaded once). The per-KV-head rope keys `[B, n_kv, S, 2r]` are small and read
per head, one rope dim at a time. Wide latents (2,048) read the key in chunks and spread the value
columns over several programs, so the fp32 accumulator stays in registers. The sequence is split
into NUM_SPLITS chunks (split-K) so that a small batch still fills the GPU, as many as the SMs
hold programs (`LAUNCH_TABLE`, `blocks_per_sm`); each chunk keeps an online softmax, and a second
kernel merges the chunks by their log-sum-exp. Importing this module imports triton
(`decode_dispatch` only does so when it imports).
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
    QR,
    QL,
    KR,
    LAT,
    VSTART,
    VEND,
    OPART,
    LSE,
    s_qr_b,
    s_qr_h,
    s_ql_b,
    s_ql_h,
    s_kr_b,
    s_kr_h,
    s_kr_s,
    s_lat_b,
    s_lat_s,
    s_op_b,
    s_op_h,
    s_op_sp,
    s_lse_b,
    s_lse_h,
    n_heads,
    group,
    seq_len,
    split_len,
    k_start,
    v_start,
    L_K,
    L_V,
    R,
    qk_scale,
    value_chunks,
    HAS_ROPE: tl.constexpr,
    HAS_VALID: tl.constexpr,
    SAME_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_LK: tl.constexpr,
    BLOCK_LC: tl.constexpr,
    BLOCK_LV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # BLOCK_LK: the key width padded; BLOCK_LC: the key chunk a dot reads (== BLOCK_LK: the whole query
    # stays in registers); BLOCK_LV: the value columns this program accumulates (value_chunks programs
    # share a head block: a [BLOCK_H, 2048] fp32 accumulator would spill). SAME_KV: one key chunk and one
    # value chunk over the same slice, so the key tile is the value tile.
    hb = tl.program_id(0) // value_chunks
    vc = tl.program_id(0) % value_chunks
    b = tl.program_id(1).to(tl.int64)  # batch offsets into a large cache overflow int32
    sp = tl.program_id(2)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < n_heads
    offs_lv = vc * BLOCK_LV + tl.arange(0, BLOCK_LV)
    lv_ok = offs_lv < L_V
    ql_base = QL + b * s_ql_b + offs_h[:, None] * s_ql_h
    if BLOCK_LC == BLOCK_LK:
        offs_lk = tl.arange(0, BLOCK_LK)
        lk_ok = offs_lk < L_K
        q_lat = tl.load(ql_base + offs_lk[None, :], mask=h_ok[:, None] & lk_ok[None, :], other=0.0)
    if HAS_ROPE:  # rope scores one rope dim at a time: a [heads, tokens, dims] tile would not fit in registers
        qr_base = QR + b * s_qr_b + offs_h * s_qr_h
        kr_base = KR + b * s_kr_b + (offs_h // group)[:, None] * s_kr_h

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
        if BLOCK_LC == BLOCK_LK:
            k_tile = tl.load(
                lat_base + offs_s[:, None] * s_lat_s + k_start + offs_lk[None, :],
                mask=s_ok[:, None] & lk_ok[None, :],
                other=0.0,
            )
            scores = tl.dot(q_lat, tl.trans(k_tile), input_precision=PRECISION)  # [BLOCK_H, BLOCK_S]
        else:
            scores = tl.zeros([BLOCK_H, BLOCK_S], tl.float32)
            for c0 in range(0, L_K, BLOCK_LC):
                offs_c = c0 + tl.arange(0, BLOCK_LC)
                c_ok = offs_c < L_K
                q_c = tl.load(ql_base + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
                k_c = tl.load(
                    lat_base + offs_s[:, None] * s_lat_s + k_start + offs_c[None, :],
                    mask=s_ok[:, None] & c_ok[None, :],
                    other=0.0,
                )
                scores = tl.dot(q_c, tl.trans(k_c), scores, input_precision=PRECISION)
        if HAS_ROPE:
            for j in range(0, R):
                q_j = tl.load(qr_base + j, mask=h_ok, other=0.0).to(tl.float32)
                k_j = tl.load(kr_base + offs_s[None, :] * s_kr_s + j, mask=h_ok[:, None] & s_ok[None, :], other=0.0)
                scores += q_j[:, None] * k_j.to(tl.float32)
        scores = tl.where(s_ok[None, :], scores * qk_scale, float("-inf"))
        # every tile holds at least one valid position, so m_new is finite and nothing is NaN
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SAME_KV:
            v_tile = k_tile
        else:
            v_tile = tl.load(
                lat_base + offs_s[:, None] * s_lat_s + v_start + offs_lv[None, :],
                mask=s_ok[:, None] & lv_ok[None, :],
                other=0.0,
            )
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        OPART + b * s_op_b + offs_h[:, None] * s_op_h + sp * s_op_sp + offs_lv[None, :],
        acc,
        mask=h_ok[:, None] & lv_ok[None, :],
    )
    if vc == 0:  # the same in every value chunk
        tl.store(LSE + b * s_lse_b + offs_h * s_lse_h + sp, lse, mask=h_ok)


@triton.jit
def _merge_kernel(
    OPART,
    LSE,
    OUT,
    s_op_b,
    s_op_h,
    s_op_sp,
    s_lse_b,
    s_lse_h,
    s_o_b,
    s_o_h,
    num_splits,
    L_V,
    BLOCK_SP: tl.constexpr,
    BLOCK_LV: tl.constexpr,
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


# H100 / H200 (sm_90) per SM: what bounds how many programs of the split kernel run at once
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers are granted per warp in units of 256
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_BYTES_RESERVED_PER_BLOCK = 1024
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32

# The launch table, by latent width (the wider of the key and value slices, padded to a power of two):
# heads per program (at most), tokens per tile, the key chunk of one dot and the value columns of one
# program (None: the whole slice), warps and pipeline stages; then the registers per thread and shared
# bytes the split kernel compiles to for sm_90 (bf16, with or without padding, Triton 3.9's ptxas), with
# keys and values in one slice (svd='joint') or in two (svd='split'/'none'), which fix how many programs
# fit an SM and so the split count. Chosen so that nothing spills: tests/test_kernels.py compiles every
# row and checks both; `python -m mha2mla_exp.mla.kernels.tune` times alternatives on a GPU.
LAUNCH_TABLE = {
    128: dict(
        BLOCK_H=16,
        BLOCK_S=16,
        KEY_CHUNK=None,
        VALUE_CHUNK=None,
        num_warps=4,
        num_stages=2,
        registers={"one_slice": 102, "two_slices": 146},
        shared_bytes={"one_slice": 12288, "two_slices": 8704},
    ),
    256: dict(
        BLOCK_H=32,
        BLOCK_S=32,
        KEY_CHUNK=None,
        VALUE_CHUNK=None,
        num_warps=8,
        num_stages=2,
        registers={"one_slice": 128, "two_slices": 175},
        shared_bytes={"one_slice": 49152, "two_slices": 34816},
    ),
    512: dict(
        BLOCK_H=16,
        BLOCK_S=32,
        KEY_CHUNK=None,
        VALUE_CHUNK=None,
        num_warps=8,
        num_stages=2,
        registers={"one_slice": 128, "two_slices": 208},
        shared_bytes={"one_slice": 65536, "two_slices": 50176},
    ),
    1024: dict(
        BLOCK_H=16,
        BLOCK_S=16,
        KEY_CHUNK=None,
        VALUE_CHUNK=None,
        num_warps=8,
        num_stages=2,
        registers={"one_slice": 205, "two_slices": 236},
        shared_bytes={"one_slice": 73728, "two_slices": 66048},
    ),
    # a [16, 2048] fp32 accumulator spills whatever the warps: four programs take 512 value columns each
    2048: dict(
        BLOCK_H=16,
        BLOCK_S=16,
        KEY_CHUNK=256,
        VALUE_CHUNK=512,
        num_warps=8,
        num_stages=2,
        registers={"one_slice": 165, "two_slices": 165},
        shared_bytes={"one_slice": 32768, "two_slices": 32768},
    ),
}


def launch_row(latent_width: int) -> dict:
    """The launch-table row for a latent width (the narrowest row at least as wide; the widest beyond)."""
    width = triton.next_power_of_2(latent_width)
    fitting = [w for w in LAUNCH_TABLE if w >= width]
    return LAUNCH_TABLE[min(fitting) if fitting else max(LAUNCH_TABLE)]


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int = 0) -> int:
    """How many programs of num_warps warps, each thread holding `registers`, fit one SM at once."""
    per_warp = triton.cdiv(max(registers, 1) * 32, REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes + SHARED_BYTES_RESERVED_PER_BLOCK)
    return max(1, min(by_registers, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM))


def default_config(
    batch: int,
    n_heads: int,
    seq_len: int,
    latent_width: int,
    device: torch.device,
    one_slice: bool = True,
    sm_count: int | None = None,
) -> dict:
    """Launch parameters: the table's row, and enough sequence splits that every SM holds as many programs
    as fit on it (`blocks_per_sm` of the row's registers and shared memory), but no split shorter than 256
    tokens (each split costs a partial-result write and a merge read). `one_slice`: keys and values are one
    slice of the latent; `sm_count`: the GPU's SMs (default: the device's; 4 off CUDA)."""
    row = launch_row(latent_width)
    block_h = min(row["BLOCK_H"], max(16, triton.next_power_of_2(n_heads)))
    value_chunks = 1 if row["VALUE_CHUNK"] is None else triton.cdiv(latent_width, row["VALUE_CHUNK"])
    programs = batch * triton.cdiv(n_heads, block_h) * value_chunks
    if sm_count is None:
        sm_count = _sm_count(device.index or 0) if device.type == "cuda" else 4
    slices = "one_slice" if one_slice else "two_slices"
    resident = blocks_per_sm(row["registers"][slices], row["num_warps"], row["shared_bytes"][slices])
    splits = max(1, min(triton.cdiv(sm_count * resident, programs), triton.cdiv(seq_len, 256), 128))
    return {
        "BLOCK_H": block_h,
        "BLOCK_S": row["BLOCK_S"],
        "KEY_CHUNK": row["KEY_CHUNK"],
        "VALUE_CHUNK": row["VALUE_CHUNK"],
        "num_splits": splits,
        "num_warps": row["num_warps"],
        "num_stages": row["num_stages"],
    }


def kernel_widths(l_k: int, l_v: int, cfg: dict) -> dict:
    """The split kernel's width constexprs for key width l_k, value width l_v and a launch config."""
    block_lk, block_lv = max(16, triton.next_power_of_2(l_k)), max(16, triton.next_power_of_2(l_v))
    return {
        "BLOCK_LK": block_lk,
        "BLOCK_LC": min(block_lk, cfg.get("KEY_CHUNK") or block_lk),
        "BLOCK_LV": min(block_lv, cfg.get("VALUE_CHUNK") or block_lv),
    }


def absorbed_decode_triton(
    q_rope,
    q_latent,
    k_rope,
    latent,
    k_slice: slice,
    v_slice: slice,
    scale: float,
    valid_start=None,
    valid_end=None,
    config: dict | None = None,
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
    q_rope, q_latent, k_rope, latent = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q_rope, q_latent, k_rope, latent)
    )
    cfg = default_config(b, n_h, s, max(l_k, l_v), latent.device, k_slice == v_slice) | (config or {})
    block_h, block_s, splits = cfg["BLOCK_H"], cfg["BLOCK_S"], cfg["num_splits"]
    split_len = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s  # whole tiles per split
    splits = triton.cdiv(s, split_len)
    widths = kernel_widths(l_k, l_v, cfg)
    value_chunks = triton.cdiv(l_v, widths["BLOCK_LV"])

    dev = latent.device
    o_part = torch.empty(b, n_h, splits, l_v, device=dev, dtype=torch.float32)
    lse = torch.empty(b, n_h, splits, device=dev, dtype=torch.float32)
    out = torch.empty(b, n_h, l_v, device=dev, dtype=latent.dtype)
    has_valid = valid_start is not None or valid_end is not None
    if has_valid:
        valid_start = (
            torch.zeros(b, device=dev, dtype=torch.int32)
            if valid_start is None
            else valid_start.to(device=dev, dtype=torch.int32)
        )
        valid_end = (
            torch.full((b,), s, device=dev, dtype=torch.int32)
            if valid_end is None
            else valid_end.to(device=dev, dtype=torch.int32)
        )
    # one key chunk and one value chunk over the same slice: the key tile is the value tile
    same_kv = k_slice == v_slice and widths["BLOCK_LC"] == widths["BLOCK_LK"] and value_chunks == 1
    # fp32 inputs: exact products (tl.dot would use tf32 on the GPU); 16-bit inputs: tensor cores
    precision = "ieee" if latent.dtype == torch.float32 else "tf32"
    if not r:  # NoPE: the rope arguments are never read; pass real tensors, not empty ones
        q_rope, k_rope = q_latent, latent.unsqueeze(1)
    _split_kernel[(triton.cdiv(n_h, block_h) * value_chunks, b, splits)](
        q_rope,
        q_latent,
        k_rope,
        latent,
        valid_start,
        valid_end,
        o_part,
        lse,
        q_rope.stride(0),
        q_rope.stride(1),
        q_latent.stride(0),
        q_latent.stride(1),
        k_rope.stride(0),
        k_rope.stride(1),
        k_rope.stride(2),
        latent.stride(0),
        latent.stride(1),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        n_h,
        n_h // n_kv,
        s,
        split_len,
        k_slice.start,
        v_slice.start,
        l_k,
        l_v,
        r,
        scale * _LOG2E,
        value_chunks,
        HAS_ROPE=r > 0,
        HAS_VALID=has_valid,
        SAME_KV=same_kv,
        BLOCK_H=block_h,
        BLOCK_S=block_s,
        **widths,
        PRECISION=precision,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    _merge_kernel[(b, n_h)](
        o_part,
        lse,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        l_v,
        BLOCK_SP=max(2, triton.next_power_of_2(splits)),
        BLOCK_LV=max(16, triton.next_power_of_2(l_v)),
        num_warps=4,
    )
    return out


def interpreted() -> bool:
    """Whether triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
