"""Migrate run records to the typed schema's identity (schema version 1), once; kept for its record of how.

Before the schema, a run's identity hashed whole resolved config groups, so an option added to a group moved every
committed hash (issue 45). For each run folder (a results.json with its config.yaml) under the given roots:

1. the config.yaml is merged onto the schema (mha2mla_exp/schema/sections.py); a key the schema does not know is
   reported and the migration stops (nothing is dropped silently);
2. what the run resolved on its machine, which the old config left as `auto`, is written in from its record: the
   device type, the training precision mode (`train.precision.mode`) and the evaluation dtype (`eval_dtype`);
3. a record the old code could not re-plan (no `setting_hash`: made by code whose behaviour its config no longer
   describes) gets `legacy_run: <its old run hash>`, which keeps it apart from today's runs, as before;
4. the config is re-planned by today's `validate`; the resolved config is written as config.yaml, the new hashes
   into results.json (the first ones under `migrated_from`), and the folder renamed to `<name>-<new run hash>`,
   with every Markdown link to it under the repository rewritten.

Run again, it re-keys migrated records whose identity a later fix changed (a teacher model read as a mapping from
config.yaml but typed when composed) and leaves the others alone.

It refuses to write anything unless the new row keys partition the records exactly as the old ones did (so every
aggregate table keeps its rows). Usage: python scripts/migrate_records.py [--dry-run] [ROOT ...] (default: results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from mha2mla_exp.runner.config import run_config, validate
from mha2mla_exp.runner.record import write_json_atomic
from mha2mla_exp.schema.sections import RunConfig

REPO = Path(__file__).resolve().parents[1]


def _no_probe(*_):
    raise RuntimeError("a migrated config must say what its run resolved; it asked this machine instead")


def recorded_precision(record: dict) -> str | None:
    precision = (record.get("train") or {}).get("precision")
    return precision.get("mode") if isinstance(precision, dict) else precision


def migrated_config(config_path: Path, record: dict):
    cfg = OmegaConf.load(config_path)
    cfg.device = str(record.get("machine", {}).get("device") or "cpu").split(":")[0]
    mode = recorded_precision(record)
    if mode is not None and cfg.train.get("precision") == "auto":
        cfg.train.precision = mode
    cfg.eval.dtype = record.get("eval_dtype") or "float32"  # records without it ran on CPU, where auto is fp32
    if "setting_hash" not in record:
        cfg.legacy_run = record["config_hash"]
    return OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)


def plan_record(results: Path) -> dict:
    """A record's plan under today's code: a record made before the schema from its config as migrated, a migrated
    one from its config as it is (a later fix to the identity re-keys it the same way)."""
    record = json.loads(results.read_text())
    config = results.parent / "config.yaml"
    cfg = OmegaConf.load(config) if "migrated_from" in record else migrated_config(config, record)
    plan = replan(cfg, record)
    done = record["config_hash"] == plan.identity.run_hash and record.get("setting_hash") == plan.identity.setting_hash
    return {"results": results, "record": record, "plan": plan, "name": plan.identity.name, "done": done}


def replan(cfg, record: dict):
    """`validate` as on the run's launch: its process count decides the rows per optimizer step."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(record.get("machine", {}).get("processes") or 1)
    try:
        return validate(run_config(cfg), bf16_pays=_no_probe)
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.__setitem__("WORLD_SIZE", saved)


def same_partition(items: list[dict]) -> list[str]:
    """Records grouped alike by the old row key and the new one; a record without an old row key is grouped with
    the records of its old run hash (the same run by the old code, recorded twice: the DDP twins)."""
    old, new = defaultdict(set), defaultdict(set)
    for item in items:
        run = str(item["results"].parent)
        old[item["record"].get("setting_hash") or f"run:{item['record']['config_hash']}"].add(run)
        new[item["plan"].identity.setting_hash].add(run)
    old_groups, new_groups = {frozenset(g) for g in old.values()}, {frozenset(g) for g in new.values()}
    return [f"now grouped: {sorted(g)}" for g in new_groups - old_groups]


def migrate(item: dict) -> tuple[Path, Path]:
    results, record, plan = item["results"], item["record"], item["plan"]
    folder = results.parent
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(plan.config)))
    record.setdefault(
        "migrated_from",
        {k: record.get(k) for k in ("config_hash", "trained_hash", "eval_hash", "setting_hash") if record.get(k)},
    )
    record.update(
        config_hash=plan.identity.run_hash,
        trained_hash=plan.identity.trained_hash,
        eval_hash=plan.identity.eval_hash,
        setting_hash=plan.identity.setting_hash,
    )
    target = folder.with_name(f"{item['name']}-{plan.identity.run_hash}")
    record["run_name"] = target.name
    if record.get("run_dir"):
        record["run_dir"] = str(Path(record["run_dir"]).with_name(target.name))
    write_json_atomic(results, record)
    if target != folder:
        folder.rename(target)
    return folder, target


def rewrite_links(renamed: list[tuple[Path, Path]]) -> None:
    names = {old.name: new.name for old, new in renamed if old.name != new.name}
    for doc in REPO.rglob("*.md"):
        if ".venv" in doc.parts:
            continue
        text = doc.read_text()
        changed = text
        for old, new in names.items():
            changed = changed.replace(old, new)
        if changed != text:
            doc.write_text(changed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("roots", nargs="*", default=[str(REPO / "results")])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    found = sorted(
        p for root in args.roots for p in Path(root).rglob("results.json") if (p.parent / "config.yaml").is_file()
    )
    items, failed = [], []
    for path in found:
        try:
            items.append(plan_record(path))
        except Exception as err:  # every record's problem at once, then nothing is written
            failed.append(f"{path.parent}: {type(err).__name__}: {err}")
    if failed:
        print("[migrate] refused: these records do not fit the schema:\n  " + "\n  ".join(failed))
        return 1
    todo = [item for item in items if not item["done"]]
    print(f"[migrate] {len(found)} records, {len(todo)} to migrate")
    problems = same_partition(todo)
    if problems:
        print("[migrate] refused: the new row keys group records differently:\n  " + "\n  ".join(problems))
        return 1
    if args.dry_run:
        for item in todo:
            print(f"  {item['results'].parent.name} -> {item['name']}-{item['plan'].run_hash}")
        return 0
    rewrite_links([migrate(item) for item in todo])
    print(f"[migrate] {len(todo)} records migrated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
