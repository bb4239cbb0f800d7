"""Trained models, kept: `<results_dir>/_trained/<name>-<trained hash>/`, shared by every evaluation of them.

    model/         the weights as a Hugging Face folder (safetensors, config, tokenizer; an MLA model carries
                   its modeling code and auto_map, so `from_pretrained(..., trust_remote_code=True)` loads it
                   anywhere); saved BEFORE any evaluation runs
    checkpoint/    the fine-tune's resume point while it runs (removed once model/ is complete)
    metrics.jsonl  the training curve
    trained.json   what the runner learnt while making it (train / distill blocks, parameter counts, kept RoPE
                   pairs); written last, so its presence means the folder is complete
    .lock          held while the model is made or reused (runner/lock.py), so two evaluations of one model never
                   train it twice and `prune` never deletes weights another process is loading

Weights are never deleted by a run; `python -m mha2mla_exp.runner.trained prune` is the explicit way, and it skips
a model whose lock another process holds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..faults import fault_point
from ..train.memory import SAVE_SHARD_BYTES
from .lock import FolderLock, describe_holder
from .record import write_json_atomic

TRAINED_DIR = "_trained"
COMPLETE = "trained.json"


class TrainedModel:
    def __init__(self, results_dir: Path, name: str, trained_hash: str):
        self.dir = Path(results_dir) / TRAINED_DIR / f"{name}-{trained_hash}"

    @property
    def model_dir(self) -> Path:
        return self.dir / "model"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    def complete(self) -> bool:
        return (self.dir / COMPLETE).is_file() and (self.model_dir / "config.json").is_file()

    def info(self) -> dict:
        return json.loads((self.dir / COMPLETE).read_text())

    def lock(self) -> FolderLock:
        return FolderLock(self.dir)

    def save(self, model, tokenizer, info: dict) -> None:
        """Weights first (into a temp folder, then renamed), `trained.json` last. The caller holds `lock()` and
        found the model incomplete under it; a complete one is never replaced."""
        if self.complete():
            raise FileExistsError(f"{self.dir} is already complete: a kept model is never overwritten")
        tmp = self.dir / "model.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp, max_shard_size=SAVE_SHARD_BYTES)  # the host holds one shard off a GPU at a time
        tokenizer.save_pretrained(tmp)
        if self.model_dir.exists():  # an earlier save cut before trained.json: incomplete, never read
            shutil.rmtree(self.model_dir)
        tmp.rename(self.model_dir)
        fault_point("kept.weights_saved")
        write_json_atomic(self.dir / COMPLETE, info)


def list_trained(results_dir: Path) -> list[Path]:
    root = Path(results_dir) / TRAINED_DIR
    return sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    """`python -m mha2mla_exp.runner.trained list|prune ...`: the kept trained models and their explicit pruning."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.runner.trained", description=main.__doc__)
    parser.add_argument("action", choices=("list", "prune"))
    parser.add_argument("names", nargs="*", help="trained-model folder names or their hashes (prune)")
    parser.add_argument("--results-dir", default="runs", help="the runner's results_dir (default: runs)")
    parser.add_argument("--all", action="store_true", help="prune every kept model's weights")
    args = parser.parse_args(argv)
    folders = list_trained(Path(args.results_dir))
    if args.action == "list":
        for folder in folders:
            weights = folder / "model"
            state = "complete" if (folder / COMPLETE).is_file() and weights.is_dir() else "incomplete/pruned"
            print(f"{folder.name}  {state}  {_size(folder) / 2**20:,.1f} MiB")
        return 0
    chosen = (
        folders if args.all else [f for f in folders if f.name in args.names or f.name.rsplit("-", 1)[-1] in args.names]
    )
    if not chosen:
        parser.error("name the models to prune (see `list`), or --all")
    busy = []
    for folder in chosen:
        lock = FolderLock(folder)
        if not lock.try_acquire():  # another process makes or loads these weights now
            busy.append(folder.name)
            print(f"skipped {folder.name}: in use ({describe_holder(lock.holder() or {})})")
            continue
        try:
            for part in ("model", "model.tmp", "checkpoint", "checkpoint.tmp", "checkpoint.old"):
                if (folder / part).exists():
                    shutil.rmtree(folder / part)
        finally:
            lock.release()
        print(f"pruned the weights of {folder.name} (trained.json and metrics.jsonl are kept)")
    return 1 if busy else 0


if __name__ == "__main__":
    raise SystemExit(main())
