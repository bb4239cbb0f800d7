"""`python -m mha2mla_exp.export SRC OUT [--target vllm-cpu|vllm-gpu|transformers] [--approximate] [--margin M]`:
a converted folder -> stock DeepSeek-V3."""

from __future__ import annotations

import argparse
import json
import sys

from .plan import ExportError
from .run import export
from .targets import TARGETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.export", description=__doc__)
    parser.add_argument("src", help="a converted model folder (runs/_trained/<name>/model, or save_pretrained's)")
    parser.add_argument(
        "out", help="the DeepSeek-V3 folder to write: new, empty, or an earlier export (replaced once complete)"
    )
    parser.add_argument(
        "--target",
        choices=TARGETS,
        help="refuse (before writing) widths this target's MLA backends cannot serve; warn where only some can",
    )
    parser.add_argument(
        "--approximate",
        action="store_true",
        help="accept kept frequencies that are not a geometric set: move them to the nearest one (recorded, measured)",
    )
    parser.add_argument("--margin", type=float, default=1e-6, help="latent norm: mean((s c)^2)/eps on calibration")
    args = parser.parse_args(argv)
    try:
        record = export(args.src, args.out, target=args.target, approximate=args.approximate, margin=args.margin)
    except ExportError as e:
        print(f"cannot export {args.src}: {e}", file=sys.stderr)
        return 2
    summary = {k: record[k] for k in ("plan", "targets", "verification")}
    print(json.dumps(summary | {"norm_residual": record["norm"]["residual"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
