"""The absorbed-MLA decode kernel equals the PyTorch reference; the reference equals the model's
absorbed attention; the dispatcher picks the right path.

The Triton kernel runs on the CPU through Triton's interpreter. TRITON_INTERPRET must be set
before triton is imported and would leak into every later test, so the interpreted cases run
in one subprocess: this file executed as a script (see the bottom), which prints the errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.mla.kernels import (
    absorbed_decode,
    absorbed_decode_reference,
    get_backend,
    set_backend,
    triton_available,
    triton_calls,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

# (name, batch, n_h, n_kv, S, 2r, latent width L, svd, dtype, padding, launch config)
CASES = [
    ("gqa-joint-splits", 2, 9, 3, 50, 8, 96, "joint", "float32", False, {"num_splits": 3, "BLOCK_S": 16}),
    ("mha-split-padded", 2, 4, 4, 37, 4, 32, "split", "float32", True, {"num_splits": 2}),
    ("gqa-joint-padded-b3", 3, 9, 3, 70, 8, 96, "joint", "float32", True, {"num_splits": 3, "BLOCK_S": 16}),
    ("nope", 1, 4, 2, 20, 0, 32, "joint", "float32", False, None),
    ("odd-rope-width", 2, 6, 2, 33, 6, 40, "split", "float32", False, {"num_splits": 2, "BLOCK_S": 16}),
    ("two-head-blocks", 2, 20, 4, 45, 8, 64, "joint", "float32", False, {"BLOCK_H": 16, "num_splits": 2}),
    ("fp16", 2, 9, 3, 50, 8, 96, "joint", "float16", False, {"num_splits": 2, "BLOCK_S": 16}),
    ("default-config", 2, 8, 8, 300, 16, 128, "joint", "float32", False, None),
    ("shared-rope-key", 2, 9, 1, 50, 24, 96, "joint", "float32", True, {"num_splits": 2, "BLOCK_S": 16}),  # RoRoPE
    # the key in chunks and the value columns over several programs (how the 2048-wide row launches)
    (
        "key-value-chunks",
        2,
        9,
        3,
        50,
        8,
        96,
        "joint",
        "float32",
        True,
        {"num_splits": 2, "BLOCK_S": 16, "KEY_CHUNK": 32, "VALUE_CHUNK": 32},
    ),
    (
        "key-value-chunks-split",
        2,
        6,
        2,
        45,
        6,
        80,
        "split",
        "float32",
        False,
        {"num_splits": 3, "BLOCK_S": 16, "KEY_CHUNK": 16, "VALUE_CHUNK": 16},
    ),
    ("default-config-2048", 1, 4, 2, 40, 8, 2048, "joint", "float32", False, None),
]
# every case again in bf16: bf16 inputs, fp32 accumulation, against the float64 reference of the same inputs
CASES += [(f"{c[0]}-bf16", *c[1:8], "bfloat16", *c[9:]) for c in CASES if c[8] == "float32"]
TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}


def make_inputs(case, device="cpu", seed=0):
    _, b, n_h, n_kv, s, r2, width, svd, dtype, padded, _ = case
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    ks, vs = (slice(0, width // 2), slice(width // 2, width)) if svd == "split" else (slice(0, width),) * 2
    inputs = dict(
        q_rope=rand(b, n_h, r2),
        q_latent=rand(b, n_h, ks.stop - ks.start),
        k_rope=rand(b, n_kv, s, r2),
        latent=rand(b, s, width),
        k_slice=ks,
        v_slice=vs,
        scale=0.2,
    )
    if padded:  # left and right padding, one row with a single valid position
        start = torch.randint(0, s // 3, (b,), generator=g)
        end = torch.randint(s // 2, s + 1, (b,), generator=g)
        start[0], end[0] = 5, 6
        inputs.update(valid_start=start.to(device), valid_end=end.to(device))
    return inputs


def max_error(case, device) -> float:
    """Max |Triton - float64 reference| on one case."""
    from mha2mla_exp.mla.decode_triton import absorbed_decode_triton

    x = make_inputs(case, device)
    out = absorbed_decode_triton(**x, config=case[-1])
    wide = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
    ref = absorbed_decode_reference(**wide)
    assert out.shape == ref.shape and out.dtype == x["latent"].dtype
    return (out.double() - ref).abs().max().item()


@pytest.fixture(scope="module")
def interpreted_errors():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (it belongs in the dev extras so CI runs these)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's package, not another's
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(__file__)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_interpreter_matches_reference(case, interpreted_errors):
    assert interpreted_errors[case[0]] < TOL[case[8]]


CUDA_CASES = CASES + [
    ("bf16-llama7b-layer", 2, 32, 32, 1000, 16, 512, "joint", "bfloat16", False, None),
    ("bf16-smollm-split-padded", 4, 9, 3, 777, 8, 96, "split", "bfloat16", True, None),
    ("bf16-latent-2048", 2, 32, 32, 1000, 16, 2048, "joint", "bfloat16", False, None),
    ("bf16-latent-1024-split-padded", 2, 32, 8, 1000, 16, 2048, "split", "bfloat16", True, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_triton_cuda_matches_reference(case):
    assert max_error(case, "cuda") < TOL[case[8]]


def compile_for_hopper(kernel, pointers: dict, constexprs: dict, floats=(), **options):
    """Compile a Triton kernel for sm_90 without a GPU (ptxas ships in the triton wheel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n) or ("fp32" if n in floats else "i32") for n in names
    }
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_merge_kernel_compiles_for_hopper_at_the_widest_latent():
    from mha2mla_exp.mla.decode_triton import _merge_kernel

    merge = compile_for_hopper(
        _merge_kernel,
        {"OPART": "*fp32", "LSE": "*fp32", "OUT": "*bf16"},
        dict(BLOCK_SP=128, BLOCK_LV=2048),
        num_warps=4,
    )
    assert merge.asm["cubin"]


def test_programs_per_sm_follow_registers_threads_and_shared_memory():
    """H100/H200: 65,536 registers per SM, granted per warp in units of 256."""
    from mha2mla_exp.mla.decode_triton import blocks_per_sm

    assert blocks_per_sm(254, 8) == 1  # the old 512-wide config: 254 x 256 threads leaves room for one
    assert blocks_per_sm(128, 8) == 2
    assert blocks_per_sm(100, 4) == 4  # 104 registers x 32 lanes = 3,328, rounded up to 3,584 a warp
    assert blocks_per_sm(32, 4) == 16  # then 64 warps an SM bound it
    assert blocks_per_sm(64, 8, shared_bytes=100_000) == 2  # 228 KiB of shared memory an SM


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("slices", ["one_slice", "two_slices"])
@pytest.mark.parametrize("width", [128, 256, 512, 1024, 2048])
def test_launch_table_compiles_for_hopper_without_spills_at_the_occupancy_it_assumes(width, slices):
    """Each launch-table row, compiled for sm_90 as it launches (bf16, with and without padding): no
    register spills, no more registers or shared bytes than the table says, and as many programs per SM
    as the split count assumes (the table's numbers are the compiled ones with the bundled ptxas; another
    ptxas may move them a little, which is fine while the programs per SM stay the same). The previous
    defaults failed this: 254 registers x 256 threads at latent 512 (one program an SM where the split
    count assumed two) and 1,608 spilled bytes at latent 2,048."""
    from mha2mla_exp.mla.decode_triton import LAUNCH_TABLE, blocks_per_sm, default_config
    from mha2mla_exp.mla.kernels.tune import compile_split_kernel, resources

    row = LAUNCH_TABLE[width]
    cfg = default_config(16, 32, 16384, width, torch.device("cpu"), slices == "one_slice", sm_count=132)
    assumed = blocks_per_sm(row["registers"][slices], cfg["num_warps"], row["shared_bytes"][slices])
    used = [
        resources(compile_split_kernel(cfg, width, width, 16, "bf16", slices == "one_slice", padded))
        for padded in (False, True)
    ]
    assert all(u["spill_bytes"] == 0 for u in used), used
    assert max(u["registers"] for u in used) <= row["registers"][slices], used
    assert max(u["shared_bytes"] for u in used) <= row["shared_bytes"][slices], used
    assert min(blocks_per_sm(u["registers"], cfg["num_warps"], u["shared_bytes"]) for u in used) == assumed
    value_chunks = 1 if cfg["VALUE_CHUNK"] is None else width // cfg["VALUE_CHUNK"]
    programs = 16 * -(-32 // cfg["BLOCK_H"]) * value_chunks
    assert cfg["num_splits"] == min(-(-132 * assumed // programs), 64)  # 64: no split under 256 tokens


def naive_decode(q_rope, q_latent, k_rope, latent, k_slice, v_slice, scale, valid_start=None, valid_end=None):
    """Head by head, sequence by sequence, in float64: an independent statement of the maths."""
    b, n_h, _ = q_latent.shape
    g = n_h // k_rope.shape[1]
    out = torch.zeros(b, n_h, v_slice.stop - v_slice.start, dtype=torch.float64)
    for i in range(b):
        lo = 0 if valid_start is None else int(valid_start[i])
        hi = latent.shape[1] if valid_end is None else int(valid_end[i])
        c = latent[i, lo:hi].double()
        for h in range(n_h):
            s = c[:, k_slice] @ q_latent[i, h].double() + k_rope[i, h // g, lo:hi].double() @ q_rope[i, h].double()
            out[i, h] = torch.softmax(s * scale, 0) @ c[:, v_slice]
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_naive(case):
    x = make_inputs(case)
    ref = absorbed_decode_reference(**x)
    assert ref.dtype == x["latent"].dtype
    assert (ref.double() - naive_decode(**x)).abs().max().item() < TOL[case[8]]


def test_fully_masked_row_is_zero():
    x = make_inputs(CASES[1])
    x["valid_start"][1], x["valid_end"][1] = 4, 4
    out = absorbed_decode_reference(**x)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


def test_dispatcher_uses_reference_on_cpu():
    x = make_inputs(CASES[0])
    before = triton_calls()
    assert get_backend() == "auto"
    torch.testing.assert_close(absorbed_decode(**x), absorbed_decode_reference(**x), rtol=0, atol=0)
    torch.testing.assert_close(absorbed_decode(**x, backend="torch"), absorbed_decode_reference(**x), rtol=0, atol=0)
    assert triton_calls() == before
    with pytest.raises(ValueError, match="backend"):
        absorbed_decode(**x, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        set_backend("fast")
    assert isinstance(triton_available(), bool)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_dispatcher_picks_triton_on_cuda():
    x = make_inputs(next(c for c in CUDA_CASES if c[0] == "bf16-llama7b-layer"), "cuda")
    before = triton_calls()
    out = absorbed_decode(**x)
    assert triton_calls() == before + 1
    assert (out.float() - absorbed_decode_reference(**x).float()).abs().max().item() < 5e-2


@torch.no_grad()
@pytest.mark.parametrize(
    "rope,svd,kind",
    [
        ("uniform", "joint", "gqa"),
        ("uniform", "split", "mha"),
        ("uniform", "joint", "qwen2"),
        ("rorope", "joint", "qwen2"),
        ("rorope", "split", "gqa"),
    ],
)
def test_absorbed_decode_equals_attention_over_the_expanded_keys_and_values(rope, svd, kind):
    """One decode token after a prefill: the W_uk fold + absorbed_decode + W_uv recipe, and the model's own
    absorbed attention (which calls it), both equal softmax attention written out over the keys and values
    expanded from the latent (k/v biases included; RoRoPE's one shared rope key). The expected side never goes
    through absorbed_decode, so a wrong kernel, fold or dispatcher fails here."""
    torch.manual_seed(0)
    calibration = [torch.randint(0, 97, (2, 16))]
    mla = convert_to_mla(tiny_causal_lm(kind), rope=rope, r=2, svd=svd, d_kv=8, calibration=calibration)
    attn = mla.model.layers[0].self_attn
    b, s = 3, 11
    hidden = torch.randn(b, s + 1, mla.config.hidden_size)
    positions = torch.arange(s + 1).expand(b, -1)
    cos, sin = mla.model.rotary_emb(hidden, positions)
    q = attn.q_proj(hidden).view(b, s + 1, attn.num_heads, attn.head_dim).transpose(1, 2)
    q_rope, q_nope = attn._split_query(q)
    k_rope = attn.k_rope_proj(hidden).view(b, s + 1, attn.rope_heads, attn.rope_dim).transpose(1, 2)
    q_rope, k_rope = attn._rotate(q_rope, k_rope, cos, sin)
    latent = attn.kv_down_proj(hidden).unsqueeze(1)
    q_rope, q_nope = q_rope[:, :, -1:], q_nope[:, :, -1:]  # the decode token attends to all s+1

    n_kv, g, d_h = attn.num_kv_heads, attn.num_key_value_groups, attn.head_dim
    k_nope, v = attn.expand_latent(latent)  # [B, n_kv, S, *]: the unabsorbed keys and values
    keys = torch.cat([k_rope.expand(-1, n_kv, -1, -1) if attn.shared_rope else k_rope, k_nope], dim=-1)
    query = torch.cat([q_rope, q_nope], dim=-1).view(b, n_kv, g, -1)
    probs = torch.softmax(torch.einsum("bkgd,bksd->bkgs", query, keys) * attn.scaling, dim=-1)
    expected = torch.einsum("bkgs,bksd->bkgd", probs, v).reshape(b, 1, n_kv * g, d_h)

    w_uk = attn.k_up_proj.weight.view(n_kv, attn.nope_dim, -1)
    q_latent = torch.einsum("bkgn,knl->bkgl", q_nope.reshape(b, n_kv, g, -1), w_uk).reshape(b, n_kv * g, -1)
    attended = absorbed_decode(
        q_rope[:, :, 0], q_latent, k_rope, latent[:, 0], attn.k_latent, attn.v_latent, attn.scaling
    )
    w_uv = attn.v_up_proj.weight.view(n_kv, d_h, -1)
    out = torch.einsum("bkgl,kdl->bkgd", attended.view(b, n_kv, g, -1), w_uv)
    if attn.v_up_proj.bias is not None:
        out = out + attn.v_up_proj.bias.view(1, n_kv, 1, d_h)
    torch.testing.assert_close(out.reshape(b, 1, n_kv * g, d_h), expected, rtol=1e-5, atol=1e-5)
    model_path = attn._absorbed_attention(q_rope, q_nope, k_rope, latent, None)  # [B, 1, n_h, d_h]
    torch.testing.assert_close(model_path, expected, rtol=1e-5, atol=1e-5)


def interpret_bf16_dots_as_the_gpu_does():
    """Triton 3.9's interpreter keeps bf16 as raw uint16 bits and its `tl.dot` multiplies those bits
    (a 16x16 bf16 dot comes out ~1e10 off). Patch the interpreter, not the kernel: widen bf16 operands to
    fp32 first, which is what the tensor cores compute (exact bf16 products, fp32 accumulation)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot_widening_bf16


if __name__ == "__main__":  # the interpreted run: TRITON_INTERPRET=1 is set by the fixture above
    interpret_bf16_dots_as_the_gpu_does()
    torch.manual_seed(0)
    print(json.dumps({case[0]: max_error(case, "cpu") for case in CASES}))
