"""Run directories and their records (docs/RUN_RECORD.md): atomic, append-only, resumable."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import torch

FINAL_STATUSES = ("ok", "diverged")  # a relaunch skips these; failed or interrupted runs resume


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_results(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


class MetricsLog:
    """metrics.jsonl: one JSON line per logged training step. On resume, lines past the checkpoint
    step are dropped so the curve has no duplicates."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def machine_info(device: torch.device) -> dict:
    info = {"device": device.type, "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    else:
        info["name"] = f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})"
    return info


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
