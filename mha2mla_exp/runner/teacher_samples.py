"""`python -m mha2mla_exp.runner.teacher_samples [--publish DIR] [--show N] [overrides]`: write the teacher's
samples ahead of the runs that train on them, and publish what they look like.

Composes the app's config (conf/config.yaml with `data=teacher_samples` first, so `data.generation.count=4096`
and any other override work as for a run), generates every missing batch into the cache (a progress bar; a
relaunch continues where it stopped), tokenizes and splits the set as a run would, then writes to `--publish`
(default results/teacher_samples/): `generation.json` (the settings, the teacher, the split and what the
generation cost in CPU- and wall seconds, per machine), `sample.jsonl` (the first N samples, decoded) and
`shards/<teacher>-<key>/` (the set itself, ~2 MB per 2,048 x 256 tokens; with --no-shards, not). Shards
published in results/teacher_samples/shards/ are what a run on a fresh clone reads instead of generating.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from hydra import compose, initialize_config_dir

from .. import atomic
from ..confutil import CONF_DIR, typed_section
from ..data import prepare_data
from ..data.teacher import generation_cost, publish_shards, shard_dir, teacher_documents, teacher_model
from ..models import load_tokenizer
from ..schema.sections import RunConfig
from .record import write_json_atomic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--publish", type=Path, default=Path("results/teacher_samples"))
    parser.add_argument("--show", type=int, default=16, help="samples decoded into sample.jsonl")
    parser.add_argument("--no-shards", action="store_true", help="publish the summary and sample, not the set")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.generation.count=4096")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=["data=teacher_samples", *args.overrides])
    config = typed_section(RunConfig, composed)
    data = config.data
    tokenizer = load_tokenizer(config.model)
    prepared = prepare_data(data, tokenizer)  # generates what is missing, then splits and packs
    shown = []
    for i, ids in enumerate(teacher_documents(data, tokenizer)):
        if i >= args.show:
            break
        shown.append({"sample": i, "tokens": len(ids), "text": tokenizer.decode(ids)})
    args.publish.mkdir(parents=True, exist_ok=True)
    atomic.write_text(args.publish / "sample.jsonl", "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in shown))
    summary = {
        "command": "python -m mha2mla_exp.runner.teacher_samples " + " ".join(args.overrides),
        "data": asdict(data) | {"teacher": {k: getattr(teacher_model(data), k) for k in ("name", "source", "id")}},
        "cache": str(shard_dir(data)),
        "split": {k: prepared.stats[k] for k in ("documents", "tokens", "rows")},
        "cost": generation_cost(data),
    }
    if not args.no_shards:
        summary["published_shards"] = str(publish_shards(data, args.publish / "shards"))
    write_json_atomic(args.publish / "generation.json", summary)
    cost = summary["cost"]
    print(
        f"[teacher_samples] {data.generation.count} samples, {cost['tokens']:,} tokens, "
        f"{cost['wall_s']:.0f} s wall / {cost['cpu_s']:.0f} CPU-s on {', '.join(cost['machines'])}; "
        f"published {len(shown)} in {args.publish}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
