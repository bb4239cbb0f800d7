"""LongBench (v1) the paper's way, on lm-eval's LongBench tasks.

lm-eval supplies the 16 English subsets' prompts, per-task generation lengths (LongBench's
dataset2maxlen) and metrics (LongBench's own code). The paper's protocol adds:
- window = the fine-tuning length; prompts longer than window - max_gen are cut in the MIDDLE
  (head and tail kept), done by `EvalLM` where lm-eval would keep only the tail;
- greedy decoding (lm-eval's LongBench tasks already set do_sample: false);
- LongBench's post-processing for trec / triviaqa / samsum: leading newlines stripped, first line
  kept (lm-eval instead stops at the first newline, which scores an answer that starts with a
  newline as empty); generation there runs to max_gen like the official code;
- Avg = unweighted mean of the subset scores.
Data: lm-eval's hub copy (Xnhyacinth/LongBench), or `data_dir` with one `<subset>.jsonl` per
subset in LongBench's own format (`input` is renamed to lm-eval's `question`).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from ..schema.sections import PAPER_LONGBENCH_SUBSETS, LongBenchConfig
from .tasks import Function, lm_eval_tasks_dir, run_tasks, write_task_folder

SUBSETS = PAPER_LONGBENCH_SUBSETS
FIRST_LINE = ("trec", "triviaqa", "samsum")  # LongBench's pred.lstrip('\n').split('\n')[0] (lsht is Chinese)
PREFIX = "mla_longbench_"


def _safe(subset: str) -> str:
    return subset.replace("-", "_")


def _metric_name(subset: str) -> str:
    """The name of the scoring function lm-eval's task file declares (e.g. get_qa_f1_with_score)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(lm_eval_tasks_dir() / "longbench" / f"{subset}.yaml", resolve_func=False)
    return str(cfg["process_results"]).rsplit(".", 1)[1]


@functools.cache
def _lm_eval_metrics():
    """lm-eval's LongBench metrics module, loaded the way lm-eval loads it (needs lm_eval[longbench])."""
    from lm_eval.tasks._yaml_loader import _load_module_with_cache

    try:
        return _load_module_with_cache(lm_eval_tasks_dir() / "longbench" / "metrics.py")
    except ImportError as e:
        raise ImportError(
            "LongBench scoring needs lm-eval's longbench extra: pip install 'lm-eval[longbench]' "
            "(jieba, fuzzywuzzy, rouge)"
        ) from e


def postprocess(subset: str, prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0] if subset in FIRST_LINE else prediction


def process_results(subset: str, doc, results):
    score = getattr(_lm_eval_metrics(), _metric_name(subset))
    return score(doc, [postprocess(subset, results[0])])


def process_docs(dataset):
    """LongBench's own files name the question `input`; lm-eval's prompts read `question`."""
    if "question" not in dataset.column_names and "input" in dataset.column_names:
        dataset = dataset.rename_column("input", "question")
    return dataset


# one module-level hook per subset, for `!function` references in the generated YAMLs
for _s in SUBSETS:
    setattr(sys.modules[__name__], f"process_results_{_safe(_s)}", functools.partial(process_results, _s))


def task_folder(cfg: LongBenchConfig) -> Path:
    lm_tasks = lm_eval_tasks_dir() / "longbench"
    files = {}
    for subset in cfg.subsets:
        task = {
            "include": str(lm_tasks / f"{subset}.yaml"),
            "task": PREFIX + _safe(subset),
            "tag": [],
            "process_docs": Function(f"{__name__}.process_docs"),
        }
        if cfg.data_dir is not None:
            task.update(
                {
                    "dataset_path": "json",
                    "dataset_name": None,
                    "test_split": "test",
                    "dataset_kwargs": {"data_files": {"test": str(Path(cfg.data_dir) / f"{subset}.jsonl")}},
                }
            )
        if cfg.official_postprocess:
            task["process_results"] = Function(f"{__name__}.process_results_{_safe(subset)}")
            if subset in FIRST_LINE:
                from lm_eval.tasks._yaml_loader import load_yaml

                gen = dict(load_yaml(lm_tasks / f"{subset}.yaml", resolve_func=False)["generation_kwargs"])
                task["generation_kwargs"] = gen | {"until": []}
        files[f"{PREFIX}{_safe(subset)}.yaml"] = task
    return write_task_folder("longbench", files)


def check(cfg: LongBenchConfig) -> None:
    """Fail before any model work: unknown subsets, missing files, no data source, missing extra."""
    unknown = [s for s in cfg.subsets if s not in SUBSETS]
    if unknown:
        raise ValueError(f"unknown LongBench subset(s) {unknown}; the paper's 16 are {list(SUBSETS)}")
    if cfg.data_dir is not None:
        missing = [s for s in cfg.subsets if not (Path(cfg.data_dir) / f"{s}.jsonl").is_file()]
        if missing:
            raise FileNotFoundError(f"LongBench data_dir {cfg.data_dir} lacks {[m + '.jsonl' for m in missing]}")
    elif os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise RuntimeError(
            "LongBench needs its data: the hub is off (HF_HUB_OFFLINE) and no longbench.data_dir "
            "(one <subset>.jsonl per subset, LongBench format) was given"
        )
    _lm_eval_metrics()


def evaluate_longbench(lm, cfg: LongBenchConfig) -> tuple[dict, dict, list[dict]] | None:
    """Returns (scores per subset + avg, metadata, per-document rows); None on a rank other than 0 of a
    multi-process evaluation (each rank generates for its share of the documents)."""
    check(cfg)
    folder = task_folder(cfg)
    names = {s: PREFIX + _safe(s) for s in cfg.subsets}
    run = run_tasks(
        lm,
        list(names.values()),
        include_path=folder,
        include_defaults=False,
        limits={n: cfg.limit for n in names.values()},
        sample=cfg.sample,
        seed=cfg.seed,
    )
    truncated = getattr(lm, "truncated_prompts", None)
    if truncated is not None and hasattr(lm, "sum_over_ranks"):  # every rank cut its own prompts
        (truncated,) = lm.sum_over_ranks(truncated)
    if run is None:
        return None
    scores = {s: run.metrics[n]["score"] for s, n in names.items()}
    scores["avg"] = sum(scores[s] for s in cfg.subsets) / len(cfg.subsets)
    scores["limit"] = cfg.limit  # as in the commonsense block: the record states what ran
    meta = {
        "limit": cfg.limit,
        "sample": cfg.sample,
        "seed": cfg.seed,
        "n_docs": {s: run.n_docs[n] for s, n in names.items()},
        "data": cfg.data_dir or "hub (lm-eval's Xnhyacinth/LongBench)",
        "window": getattr(lm, "max_length", None),
        "truncated_prompts": truncated,
        "official_postprocess": cfg.official_postprocess,
        "task_dir": str(folder),
    }
    subset_of = {n: s for s, n in names.items()}
    rows = [{"suite": "longbench", "column": subset_of[row["task"]], **row} for row in run.rows]
    return scores, meta, rows
