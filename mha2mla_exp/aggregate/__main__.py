"""`python -m mha2mla_exp.aggregate [RUN_DIRS...] [--out DIR] [--wandb-project ENTITY/PROJECT] [--gallery MD]`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .pipeline import build_aggregate, results_root, write_aggregate, write_gallery


def main(argv: list[str] | None = None) -> int:
    root = results_root()
    parser = argparse.ArgumentParser(
        prog="python -m mha2mla_exp.aggregate",
        description="Aggregate run records into the paper's Tables 1, 2, 3, 5 and plots.",
    )
    parser.add_argument("run_dirs", nargs="*", help=f"directories searched for results.json (default: {root}/runs)")
    parser.add_argument("--out", default=str(root / "aggregate"), help="output directory (default: %(default)s)")
    parser.add_argument("--wandb-project", help="also read this W&B project's runs (needs network)")
    parser.add_argument("--gallery", help="also write the figure gallery (Markdown) here, e.g. docs/FIGURES.md")
    args = parser.parse_args(argv)

    aggregate = build_aggregate(args.run_dirs or None, args.wandb_project)
    written = write_aggregate(aggregate, args.out)
    statuses = aggregate.runs["status"].value_counts().to_dict() if len(aggregate.runs) else {}
    if not len(aggregate.runs):
        print(
            f"no run records found under {', '.join(args.run_dirs) or str(root / 'runs')}: "
            "the tables hold the paper's numbers only (our columns are empty)"
        )
    else:
        print(
            f"{len(aggregate.runs)} runs ({', '.join(f'{n} {s}' for s, n in statuses.items())}); "
            f"only status ok enters the tables, all are listed in runs.csv"
        )
    for name, reason in written.skipped.items():
        print(f"figure {name} not drawn: {reason}")
    if args.gallery:
        written.append(write_gallery(written, Path(args.out) / "plots", args.gallery))
    print(f"wrote {len(written)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
