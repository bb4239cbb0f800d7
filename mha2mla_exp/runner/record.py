"""Run directories and their records (docs/RUN_RECORD.md): atomic, append-only, resumable."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..atomic import write_text
from ..machine import cpu_model, machine_info  # noqa: F401  (re-exported: the record's machine block)

FINAL_STATUSES = ("ok", "diverged")  # a relaunch skips these; failed or interrupted runs resume
# a run that ended without a result; only a process that died unannounced (SIGKILL, power) leaves "running"
STOPPED_STATUSES = ("failed", "interrupted", "deferred")
BUSY = "busy"  # a second launch of a setting another live process is running: it ends at once (runner/lock.py)

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: dict) -> None:
    """`data` as a record's JSON (no trailing newline: the committed records' bytes), atomically."""
    write_text(path, json.dumps(data, indent=2, default=_jsonable))


def read_results(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


class MetricsLog:
    """metrics.jsonl: one JSON line per logged training step, appended as the step ends. On resume, lines past
    the checkpoint step are dropped so the curve has no duplicates, and a last line cut by a crash (a full disk,
    a power loss) is dropped with a warning: only the last line can be cut, since lines are only appended."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line, row in self._rows() if row.get("step", 0) <= step]
        write_text(self.path, "".join(line + "\n" for line in kept))

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()

    def read(self) -> list[dict]:
        return [row for _, row in self._rows()] if self.path.exists() else []

    def _rows(self) -> list[tuple[str, dict]]:
        lines = self.path.read_text().splitlines()
        rows = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                rows.append((line, json.loads(line)))
            except ValueError:
                if number < len(lines):  # not the last: the file was damaged, not cut by a crash
                    raise ValueError(f"{self.path}: line {number} is not JSON ({line[:80]!r})") from None
                log.warning("%s: dropped its last line, cut by a crash (%r)", self.path, line[:80])
        return rows


def headline(record: dict) -> str:
    """The numbers a run exists for, in a few lines (printed at the end of the main job)."""
    lines = [
        f"  model: {record['model']['name']} ({record['variant']}), {record['model'].get('params', 0):,} parameters"
    ]
    train = record.get("train") or {}
    probes = train.get("heldout_ppl_probe") or {}
    if probes:
        steps = sorted(probes, key=int)
        lines.append(
            f"  held-out ppl (probe rows): {probes[steps[0]]:.1f} before fine-tuning -> "
            f"{probes[steps[-1]]:.1f} after {train['tokens']:,} tokens "
            f"({train['seconds']:.0f} s, {train['tokens_per_s']:.0f} tok/s, {train['precision']['mode']})"
        )
    ppl = ((record.get("eval") or {}).get("perplexity") or {}).get("heldout")
    if ppl is not None:
        dtype = record["eval"].get("meta", {}).get("perplexity_dtype", "float32")
        lines.append(f"  held-out ppl (the evaluation's held-out rows, {dtype}): {ppl:.2f}")
    cs = (record.get("eval") or {}).get("commonsense") or {}
    if "avg" in cs:
        se = commonsense_avg_se(record["eval"])
        n = cs.get("limit")
        lines.append(
            f"  commonsense Avg: {100 * cs['avg']:.1f} +- {196 * se:.1f} (95% CI, binomial; "
            f"{n if n else 'all'} docs per task)"
            if se is not None
            else f"  commonsense Avg: {100 * cs['avg']:.1f}"
        )
    kv = record.get("kv") or {}
    if kv.get("bytes_per_token_measured"):
        lines.append(
            f"  KV cache: {kv['bytes_per_token_measured']:,.0f} B/token measured vs "
            f"{kv['bytes_per_token_mha']:,.0f} for MHA ({kv['mem_change_pct']:+.2f} %)"
        )
    if kv.get("bytes_per_sequence"):
        per = kv["bytes_per_sequence"]
        lines.append(
            "  KV cache per sequence, sliding windows counted: "
            + ", ".join(
                f"{int(t):,} tokens {per[t]['model'] / 2**20:,.1f} MiB vs {per[t]['original'] / 2**20:,.1f}"
                for t in per
            )
        )
    return "\n".join(lines)


def commonsense_avg_se(eval_block: dict) -> float | None:
    """Binomial standard error of the Avg from a record's eval block (aggregate/paired.binomial_se)."""
    from ..aggregate.paired import binomial_se, commonsense_spec

    scores = eval_block.get("commonsense") or {}
    n_docs = ((eval_block.get("meta") or {}).get("commonsense") or {}).get("n_docs") or {}
    return binomial_se(scores, n_docs, commonsense_spec()).get("avg")


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
