"""`python -m mha2mla_exp.mla.kernels.tune`: time the absorbed-decode kernel over launch configs at
one shape (CUDA only) and write them, fastest first, with the speedup over SDPA on the MHA cache and
each config's registers, spills and programs per SM.

The defaults (`decode_triton.LAUNCH_TABLE`, read by `default_config`) were chosen by compiling for
sm_90 without a GPU (`compile_split_kernel`, `resources`: no spills, the split count from the
registers); this sweep is how a GPU session checks or replaces them.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F


def compile_split_kernel(
    config: dict,
    key_width: int,
    value_width: int,
    rope_dim: int = 16,
    dtype: str = "bf16",
    same_slice: bool = True,
    padded: bool = False,
    arch: int = 90,
):
    """The split kernel compiled for sm_<arch> as `absorbed_decode_triton` would launch it with `config`
    (a `default_config` dict), without a GPU: ptxas ships in the triton wheel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..decode_triton import _split_kernel, kernel_widths

    widths = kernel_widths(key_width, value_width, config)
    value_chunks = triton.cdiv(value_width, widths["BLOCK_LV"])
    constexprs = dict(
        HAS_ROPE=rope_dim > 0,
        HAS_VALID=padded,
        SAME_KV=same_slice and widths["BLOCK_LC"] == widths["BLOCK_LK"] and value_chunks == 1,
        BLOCK_H=config["BLOCK_H"],
        BLOCK_S=config["BLOCK_S"],
        **widths,
        PRECISION="ieee" if dtype == "fp32" else "tf32",
    )
    if not padded:
        constexprs |= dict(VSTART=None, VEND=None)
    pointers = {n: f"*{dtype}" for n in ("QR", "QL", "KR", "LAT")} | {
        "OPART": "*fp32",
        "LSE": "*fp32",
        "VSTART": "*i32",
        "VEND": "*i32",
    }
    names = _split_kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n) or ("fp32" if n == "qk_scale" else "i32") for n in names
    }
    src = ASTSource(
        fn=_split_kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]),
    )


def resources(compiled) -> dict:
    """Registers per thread, spilled bytes per thread (stack + local memory) and shared bytes of a
    compiled kernel. Triton's `n_regs`/`n_spills` are only filled in when a driver loads the kernel, so
    this reads the cubin's resource table with the cuobjdump that ships in the triton wheel."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", dump)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{dump}")
    registers, stack, local = map(int, match.groups())
    return {"registers": registers, "spill_bytes": stack + local, "shared_bytes": compiled.metadata.shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mha2mla_exp.mla.kernels.tune", description=__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--d-kv", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the launch-config sweep needs CUDA")
    import triton.testing

    from ..decode_reference import absorbed_decode_reference
    from ..decode_triton import absorbed_decode_triton, blocks_per_sm, default_config

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, s, n_h, n_kv, d_h = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    width, rope = n_kv * args.d_kv, 2 * args.r
    q_rope, q_latent = torch.randn(b, n_h, rope, device=dev, dtype=dt), torch.randn(b, n_h, width, device=dev, dtype=dt)
    k_rope, latent = torch.randn(b, n_kv, s, rope, device=dev, dtype=dt), torch.randn(b, s, width, device=dev, dtype=dt)
    whole, scale = slice(0, width), d_h**-0.5
    ref = absorbed_decode_reference(q_rope, q_latent, k_rope, latent, whole, whole, scale).float()
    q, k, v = (torch.randn(b, n_kv if i else n_h, 1 if i == 0 else s, d_h, device=dev, dtype=dt) for i in range(3))
    mha_s = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v), return_mode="median") / 1e3
    del k, v
    plain_s = (
        triton.testing.do_bench(
            lambda: absorbed_decode_reference(q_rope, q_latent, k_rope, latent, whole, whole, scale),
            return_mode="median",
        )
        / 1e3
    )
    nbytes = (latent.numel() + k_rope.numel()) * latent.element_size()
    bound = 2 * d_h / (rope + args.d_kv)

    auto = default_config(b, n_h, s, width, dev)
    rows = []
    chunks = (None, 256, 512) if width > 512 else (None,)  # narrower latents fit a program whole
    for block_h, block_s, warps, stages, key_chunk, value_chunk, split_mul in itertools.product(
        (16, 32), (16, 32, 64), (4, 8), (1, 2), chunks, chunks, (0.5, 1, 2)
    ):
        cfg = {
            "BLOCK_H": block_h,
            "BLOCK_S": block_s,
            "KEY_CHUNK": key_chunk,
            "VALUE_CHUNK": value_chunk,
            "num_warps": warps,
            "num_stages": stages,
            "num_splits": max(1, int(auto["num_splits"] * split_mul)),
        }
        if (key_chunk or width) >= width and (value_chunk or width) >= width and (key_chunk or value_chunk):
            continue  # a chunk as wide as the latent is the whole-slice config
        try:
            used = resources(compile_split_kernel(cfg, width, width, rope, "bf16"))
            used["programs_per_sm"] = blocks_per_sm(used["registers"], warps, used["shared_bytes"])
            out = absorbed_decode_triton(q_rope, q_latent, k_rope, latent, whole, whole, scale, config=cfg)
            err = (out.float() - ref).abs().max().item()
            sec = (
                triton.testing.do_bench(
                    lambda: absorbed_decode_triton(q_rope, q_latent, k_rope, latent, whole, whole, scale, config=cfg),
                    return_mode="median",
                )
                / 1e3
            )
        except Exception as exc:  # e.g. out of shared memory or registers for this tile
            rows.append(cfg | {"error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append(
            cfg
            | used
            | {
                "seconds": sec,
                "gb_per_s": nbytes / sec / 1e9,
                "speedup_vs_mha": mha_s / sec,
                "fraction_of_bound": mha_s / sec / bound,
                "max_abs_err": err,
                "is_default": all(cfg[k] == auto[k] for k in cfg),
            }
        )
    rows.sort(key=lambda r: r.get("seconds", float("inf")))
    print(
        f"batch {b} context {s}: MHA SDPA {mha_s * 1e6:.1f} us, plain absorbed {plain_s * 1e6:.1f} us "
        f"({mha_s / plain_s:.2f}x), bound {bound:.1f}x; default config {auto}"
    )
    for r in rows[:8] + [r for r in rows if r.get("is_default")]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if args.out:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with args.out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
