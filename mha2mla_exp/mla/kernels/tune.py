"""`python -m mha2mla_exp.mla.kernels.tune`: time the absorbed-decode kernel over launch configs at
one shape (CUDA only) and write them, fastest first, with the speedup over SDPA on the MHA cache.

The defaults in `triton_decode.default_config` were chosen without a GPU; this sweep is how a GPU
session checks or replaces them.
"""

from __future__ import annotations

import argparse
import csv
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F


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
    from ..decode_triton import absorbed_decode_triton, default_config

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
    plain_s = triton.testing.do_bench(
        lambda: absorbed_decode_reference(q_rope, q_latent, k_rope, latent, whole, whole, scale),
        return_mode="median") / 1e3
    nbytes = (latent.numel() + k_rope.numel()) * latent.element_size()
    bound = 2 * d_h / (rope + args.d_kv)

    auto = default_config(b, n_h, s, width, dev)
    rows = []
    for block_h, block_s, warps, stages, split_mul in itertools.product(
            (16, 32), (16, 32, 64), (4, 8), (2, 3), (0.5, 1, 2)):
        cfg = {"BLOCK_H": block_h, "BLOCK_S": block_s, "num_warps": warps, "num_stages": stages,
               "num_splits": max(1, int(auto["num_splits"] * split_mul))}
        try:
            out = absorbed_decode_triton(q_rope, q_latent, k_rope, latent, whole, whole, scale, config=cfg)
            err = (out.float() - ref).abs().max().item()
            sec = triton.testing.do_bench(
                lambda: absorbed_decode_triton(q_rope, q_latent, k_rope, latent, whole, whole, scale, config=cfg),
                return_mode="median") / 1e3
        except Exception as exc:  # e.g. out of shared memory or registers for this tile
            rows.append(cfg | {"error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append(cfg | {"seconds": sec, "gb_per_s": nbytes / sec / 1e9, "speedup_vs_mha": mha_s / sec,
                           "fraction_of_bound": mha_s / sec / bound, "max_abs_err": err,
                           "is_default": all(cfg[k] == auto[k] for k in cfg)})
    rows.sort(key=lambda r: r.get("seconds", float("inf")))
    print(f"batch {b} context {s}: MHA SDPA {mha_s * 1e6:.1f} us, plain absorbed {plain_s * 1e6:.1f} us "
          f"({mha_s / plain_s:.2f}x), bound {bound:.1f}x; default config {auto}")
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
