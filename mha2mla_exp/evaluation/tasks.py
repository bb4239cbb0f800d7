"""Generated lm-eval task folders, and one call into lm-eval that returns per-task metrics.

Suites describe their tasks as YAML mappings (usually an `include:` of lm-eval's own task file
plus a few overrides such as the local data files). They are written into a content-addressed
folder under the project cache and handed to lm-eval as `TaskManager(include_path=...)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

TASKS_ENV = "MHA2MLA_EVAL_TASKS"  # where generated task folders go (default: <asset cache>/eval_tasks)
SAMPLE_MODES = ("random", "first")
DIR_PLACEHOLDER = "__DIR__"


class Function(str):
    """A `!function module.name` reference in a generated task YAML."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Function, lambda d, v: d.represent_scalar("!function", str(v)))


def lm_eval_tasks_dir() -> Path:
    """lm-eval's own task folder (the files the generated YAMLs include)."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def tasks_root() -> Path:
    env = os.environ.get(TASKS_ENV)
    if env:
        return Path(env).expanduser()
    from ..assets import cache_dir

    return cache_dir() / "eval_tasks"


def write_task_folder(
    suite: str, files: dict[str, dict], extra: dict[str, str] | None = None, root: Path | None = None
) -> Path:
    """Write `files` ({file name: YAML mapping}) and `extra` ({file name: text}) into a folder
    named by their content hash; an existing complete folder is reused. Returns the folder.
    The string `__DIR__` in any file stands for the folder's final path (lm-eval needs absolute
    data paths)."""
    rendered = {
        name: yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10**9)
        for name, cfg in files.items()
    }
    rendered.update(extra or {})
    digest = hashlib.sha256(json.dumps(rendered, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(root) if root is not None else tasks_root()
    final = root / f"{suite}-{digest}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{suite}-", dir=root))
    try:
        for name, text in rendered.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace(DIR_PLACEHOLDER, str(final)))
        try:
            os.rename(tmp, final)  # a folder, atomic: a reader never sees it half-written
        except OSError:
            if not final.is_dir():  # a concurrent writer may have published the same content
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def task_manager(include_path: Path | list[Path] | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(
        include_path=[str(p) for p in ([include_path] if isinstance(include_path, Path) else include_path or [])]
        or None,
        include_defaults=include_defaults,
    )


def sample_indices(n_docs: int, limit: int | None, mode: str, seed: int) -> list[int] | None:
    """The doc indices evaluated for a task with `n_docs` docs: all (None), the first `limit`,
    or a seeded random subset of `limit` (sorted), the same for every model."""
    if mode not in SAMPLE_MODES:
        raise ValueError(f"unknown sample mode {mode!r}; expected one of {SAMPLE_MODES}")
    if limit is None or limit >= n_docs:
        return None
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    if mode == "first":
        return list(range(limit))  # what lm-eval's own `limit` evaluates
    return sorted(random.Random(seed).sample(range(n_docs), limit))


@contextlib.contextmanager
def _global_rng_kept():
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@dataclass
class TaskRun:
    """What lm-eval returned for a list of leaf tasks."""

    metrics: dict[str, dict]  # task -> {"acc": .., "acc_norm": ..} (filter suffix dropped)
    n_docs: dict[str, int]  # task -> docs evaluated
    n_total: dict[str, int]  # task -> docs in the split
    samples: dict[str, list[dict]] = field(default_factory=dict)  # task -> lm-eval's logged samples
    indices: dict[str, list[int] | None] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # per-document rows (samples.rows_from_lm_eval)


def run_tasks(
    lm,
    task_names: list[str],
    *,
    include_path=None,
    include_defaults: bool = True,
    limits: dict[str, int | None] | None = None,
    sample: str = "random",
    seed: int = 1234,
) -> TaskRun | None:
    """Evaluate leaf tasks 0-shot with lm-eval; `limits[task]` docs each (None: all), chosen by `sample`.
    Per-document results are always logged (`TaskRun.samples`, reduced to `TaskRun.rows`), in document order.
    Under several processes (`lm.world_size` > 1) each evaluates its share and rank 0 gets the whole run; the
    other ranks get None."""
    import lm_eval

    from .samples import rows_from_lm_eval

    tm = task_manager(include_path, include_defaults)
    missing = [t for t in task_names if t not in tm.all_subtasks]
    if missing:
        raise KeyError(f"lm-eval does not know the task(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    loaded = tm.load(list(task_names))["tasks"]
    limits = limits or {}
    samples, n_total = {}, {}
    for name, task in loaded.items():
        n_total[name] = len(task.eval_docs)
        samples[name] = sample_indices(n_total[name], limits.get(name), sample, seed)
    use_samples = any(v is not None for v in samples.values())
    if use_samples:  # lm-eval evaluates every doc of a task given None; give it the full range instead
        samples = {k: (list(range(n_total[k])) if v is None else v) for k, v in samples.items()}
    with _global_rng_kept():  # lm-eval seeds python/numpy/torch (as its CLI does); the caller's streams survive
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(loaded.values()),
            task_manager=tm,
            num_fewshot=0,
            samples=samples if use_samples else None,
            bootstrap_iters=0,
            log_samples=True,
        )
    if out is None:  # not rank 0 of a multi-process evaluation: lm-eval gathered this rank's share onto rank 0
        return None
    metrics = {}
    for name in loaded:
        raw = out["results"][name]
        metrics[name] = {
            k.split(",")[0]: v for k, v in raw.items() if "," in k and not k.split(",")[0].endswith("_stderr")
        }
    n_docs = {name: int(out["n-samples"][name]["effective"]) for name in loaded}
    logged = {name: _in_document_order(samples) for name, samples in out.get("samples", {}).items()}
    rows = [row for name, task in loaded.items() for row in rows_from_lm_eval(name, task, logged.get(name, []))]
    return TaskRun(
        metrics=metrics,
        n_docs=n_docs,
        n_total=n_total,
        samples=logged,
        indices={k: (v if use_samples else None) for k, v in samples.items()},
        rows=rows,
    )


def _in_document_order(logged: list[dict]) -> list[dict]:
    """lm-eval's logged samples of one task by filter, then document: the order one process logs them in (several
    processes' shares arrive one rank after another)."""
    filters = {f: i for i, f in enumerate(dict.fromkeys(s.get("filter") for s in logged))}
    return sorted(logged, key=lambda s: (filters[s.get("filter")], s["doc_id"]))
