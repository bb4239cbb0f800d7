"""`python -m mha2mla_exp.runner.backfill [PATH ...]`: add to records written by older code what the aggregate now
reads, re-derived from each record's own config.yaml, never guessed:

- `setting_hash` (runner/identity.setting_identity): the aggregate's row key. The record's config is validated
  again with the training precision it recorded; only when that plan reproduces the record's trained_hash and
  eval_hash is its setting hash written (a record the current code cannot reproduce stays apart in the tables).
- which document each held-out row came from, so the intervals resample documents, not rows (data/held_out.py).

Records written before `eval.perplexity.rows` scored the first max_batches x batch_size held-out rows and kept
their NLLs (`eval.perplexity.row_nll`) but not their documents. Those are a pure function of the record's data
config and tokenizer (the split, its document order and the packing are seeded), so this re-derives them and adds
`row_index` (0..n-1), `row_document` and `row_selection: "first"` beside the NLLs, rewriting the file atomically.
Only the run's own held-out set is backfilled (a teacher source's held-out set would need its samples, which are
not regenerated here). Records that already say, or kept no rows, are left alone. Also reads TransMLA's reference
records (results/transmla/*.json: `heldout_row_nll` at the top level, its own `data` block).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .record import write_json_atomic

log = logging.getLogger(__name__)


def _documents(model_cfg: dict, data_cfg: dict, memo: dict):
    """Each held-out row's document for (model's tokenizer, data config), prepared once per pair."""
    key = json.dumps([model_cfg.get("id") or model_cfg.get("name"), data_cfg], sort_keys=True, default=str)
    if key not in memo:
        from ..data import prepare_data
        from ..models import load_tokenizer

        memo[key] = prepare_data(data_cfg, load_tokenizer(model_cfg)).held_out_documents()
    return memo[key]


def _first_rows(documents, n: int) -> dict:
    if documents is None or n > len(documents):
        raise ValueError(f"{n} scored rows but the held-out split has {0 if documents is None else len(documents)}")
    return {"row_index": list(range(n)), "row_document": documents[:n].tolist(), "row_selection": "first",
            "documents": int(documents[:n].unique().numel())}


def backfill_rows(results: Path, memo: dict) -> bool:
    """Add the rows' documents to one run's results.json (its config.yaml beside it); True when it changed."""
    record = json.loads(results.read_text())
    ppl = (record.get("eval") or {}).get("perplexity") or {}
    if not isinstance(ppl.get("row_nll"), list) or not ppl["row_nll"] or "row_document" in ppl:
        return False
    config = results.parent / "config.yaml"
    if not config.is_file():
        log.warning("%s: no config.yaml beside it, left alone", results)
        return False
    cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    if cfg["data"].get("source") == "teacher":
        log.warning("%s: held-out rows of a teacher source, left alone", results)
        return False
    ppl.update(_first_rows(_documents(cfg["model"], cfg["data"], memo), len(ppl["row_nll"])))
    write_json_atomic(results, record)
    return True


def backfill_setting(results: Path) -> bool:
    """Add `setting_hash` to one run's results.json when re-planning its config reproduces its hashes."""
    record = json.loads(results.read_text())
    config = results.parent / "config.yaml"
    if "setting_hash" in record or not record.get("trained_hash") or not config.is_file():
        return False
    from .config import ConfigError, validate

    recorded = ((record.get("train") or {}).get("precision") or {}).get("mode")
    try:  # `auto` as it chose then, not as this machine would
        plan = validate(OmegaConf.load(config), auto_precision=recorded)
    except ConfigError as err:
        log.warning("%s: its config no longer validates (%s), left apart", results, err)
        return False
    if (plan.trained_hash, plan.eval_hash) != (record["trained_hash"], record.get("eval_hash")):
        log.warning("%s: re-planned hashes %s/%s differ from the recorded %s/%s, left apart", results,
                    plan.trained_hash, plan.eval_hash, record["trained_hash"], record.get("eval_hash"))
        return False
    record["setting_hash"] = plan.setting_hash
    write_json_atomic(results, record)
    return True


def backfill_reference(path: Path, memo: dict) -> bool:
    """The same for one of TransMLA's reference records (scripts/transmla_reference.py)."""
    record = json.loads(path.read_text())
    if not isinstance(record.get("heldout_row_nll"), list) or "heldout_row_document" in record:
        return False
    if record.get("held_out", {}).get("selection", "first") != "first":
        raise ValueError(f"{path}: rows selected by {record['held_out']['selection']!r} but no documents kept")
    rows = _first_rows(_documents(record["model"], record["data"], memo), len(record["heldout_row_nll"]))
    record.update(heldout_row_index=rows["row_index"], heldout_row_document=rows["row_document"])
    record["held_out"]["selection"] = "first"
    write_json_atomic(path, record)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("results/runs"), Path("results/transmla")])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    memo: dict = {}
    rows = settings = 0
    for root in args.paths:
        for path in sorted(root.rglob("results.json")):
            rows += backfill_rows(path, memo)
            settings += backfill_setting(path)
        for path in sorted(root.glob("qk*_kv*.json")):
            rows += backfill_reference(path, memo)
    print(f"[backfill] {rows} record(s) now say which document each held-out row came from; "
          f"{settings} now carry their setting hash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
