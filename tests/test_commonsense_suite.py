"""The commonsense suite is declared once (schema/commonsense_suite.py): a task column added there, with its data,
reaches the evaluation, the aggregate's tables, their rendering and the paired statistics, with no other edit."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from mha2mla_exp.aggregate import TABLES, build_aggregate, paired
from mha2mla_exp.aggregate.pipeline import write_artifact
from mha2mla_exp.aggregate.reference import paper_commonsense
from mha2mla_exp.evaluation.commonsense import evaluate_commonsense
from mha2mla_exp.evaluation.fixtures import commonsense_tree
from mha2mla_exp.evaluation.lm import EvalLM
from mha2mla_exp.evaluation.samples import SAMPLES_FILE, samples_frame, write_samples
from mha2mla_exp.schema import commonsense_suite
from mha2mla_exp.schema.commonsense_suite import TaskColumn
from mha2mla_exp.schema.sections import CommonsenseConfig

# a throwaway column: ARC-Easy's lm-eval task file over data of its own (the fixtures write it in that format)
THROWAWAY = TaskColumn("tiny_qa", "tiny_qa", "arc/arc_easy.yaml", "acc_norm", "tiny_qa/validation", "tiny_qa", "TQA", 1)
SUBJECTS = ("anatomy",)


def test_the_papers_suite():
    """The declaration gives what the paper prints: six columns, ARC the mean of its parts, each 1/6 of the Avg."""
    assert commonsense_suite.paper_columns() == ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande")
    assert commonsense_suite.avg_weights() == {
        "mmlu": 1 / 6,
        "arc_easy": 1 / 12,
        "arc_challenge": 1 / 12,
        "piqa": 1 / 6,
        "hellaswag": 1 / 6,
        "openbookqa": 1 / 6,
        "winogrande": 1 / 6,
    }
    assert commonsense_suite.paper_parts() == {"arc": {"arc_easy": 0.5, "arc_challenge": 0.5}}
    assert CommonsenseConfig().tasks == list(commonsense_suite.task_columns())
    scores = {"mmlu": 0.3, "arc_easy": 0.6, "arc_challenge": 0.2, "piqa": 0.7, "hellaswag": 0.4}
    assert commonsense_suite.paper_scores(scores) == {"arc": pytest.approx(0.4)}  # no Avg without every column
    scores |= {"openbookqa": 0.3, "winogrande": 0.5}
    assert commonsense_suite.paper_scores(scores)["avg"] == pytest.approx((0.3 + 0.4 + 0.7 + 0.4 + 0.3 + 0.5) / 6)


def test_a_label_is_one_per_table_column(monkeypatch):
    other = TaskColumn("arc_more", "arc_more", "arc/arc_easy.yaml", "acc_norm", "x/validation", "arc", "Arc", 0.5)
    monkeypatch.setattr(commonsense_suite, "SUITE", commonsense_suite.SUITE + (other,))
    with pytest.raises(ValueError, match="two labels"):
        commonsense_suite.column_labels()


@pytest.fixture
def with_throwaway(monkeypatch, tmp_path):
    monkeypatch.setattr(commonsense_suite, "SUITE", commonsense_suite.SUITE + (THROWAWAY,))
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _run(root, name, variant, tokens, evaluated, seed=0):
    """A run directory in the runner's format around one evaluation's scores, metadata and per-document rows."""
    scores, meta, rows = evaluated
    folder = root / name
    folder.mkdir(parents=True)
    record = {
        "run_name": name,
        "experiment": "suite",
        "status": "ok",
        "setting_hash": name,
        "model": {"name": "smollm2-135m", "paper_name": "135M SmolLM"},
        "variant": variant,
        "mla": None,
        "kv_quant": None,
        "kv": {"dtype": "float32"},
        "train": {"tokens": tokens, "objective": "ce"} if tokens else None,
        "eval": {"commonsense": scores, "meta": {"commonsense": meta, "dtype": "float32"}},
    }
    (folder / "results.json").write_text(json.dumps(record))
    (folder / "config.yaml").write_text(f"model: {{paper_name: 135M SmolLM}}\nseed: {seed}\ndata: {{name: sotu}}\n")
    write_samples(rows, folder / SAMPLES_FILE)


def test_a_new_task_column_is_one_row_and_its_data(with_throwaway, tiny, tmp_path):
    model, tokenizer = tiny
    cfg = CommonsenseConfig(limit=6, mmlu_limit=3, mmlu_subjects=SUBJECTS, batch_size=8)
    assert cfg.tasks[-1] == "tiny_qa"  # the schema's default task list
    cfg.data_root = str(commonsense_tree(tmp_path / "hf_datasets", n=10, subjects=SUBJECTS))
    assert (tmp_path / "hf_datasets" / "tiny_qa" / "validation").is_dir()  # the fixture's data, in ARC's format

    # the evaluation: its score, its docs, its per-document rows, and the Avg over seven columns
    original = evaluate_commonsense(EvalLM(model, tokenizer, batch_size=8), cfg)
    scores, meta, rows = original
    assert meta["n_docs"]["tiny_qa"] == 6 and meta["metrics"]["tiny_qa"] == "acc_norm"
    assert {r["column"] for r in rows} == set(commonsense_suite.task_columns())
    seven = [scores[c] for c in ("mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande", "tiny_qa")]
    assert scores["avg"] == pytest.approx(sum(seven) / 7)

    with torch.no_grad():  # another model on the same documents
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tuned = evaluate_commonsense(EvalLM(model, tokenizer, batch_size=8), cfg)
    runs = tmp_path / "runs"
    _run(runs, "original", "original", 0, original)
    _run(runs, "ft", "finetuned_full_attention", 4096, tuned)

    # the paired statistics weigh it as the evaluation does: the same Avg from the per-document rows
    spec = paired.commonsense_spec()
    assert spec.weights["tiny_qa"] == pytest.approx(1 / 7)
    values = paired.doc_values([samples_frame(runs / "original" / SAMPLES_FILE)], spec)
    assert paired.point_scores(values, spec)["avg"] == pytest.approx(scores["avg"], abs=1e-12)

    # the aggregate: a column of the canonical frame and of Table 1, its delta paired on the same documents
    agg = build_aggregate([runs])
    assert agg.runs["tiny_qa"].notna().all()
    assert "tiny_qa" in paper_commonsense()  # the paper has no such column: empty beside ours
    t1 = agg.tables["table1"]
    ft = t1[t1["method"] == "finetuned_full_attention"].dropna(subset=["n_seeds"])
    ft = ft[ft["n_seeds"] > 0].iloc[0]
    assert ft["tiny_qa"] == pytest.approx(100 * tuned[0]["tiny_qa"], abs=1e-4)
    assert ft["tiny_qa_delta"] == pytest.approx(100 * (tuned[0]["tiny_qa"] - scores["tiny_qa"]), abs=1e-4)
    assert ft["tiny_qa_delta_low"] <= ft["tiny_qa_delta"] <= ft["tiny_qa_delta_high"]
    assert ft["avg_delta"] == pytest.approx(100 * (tuned[0]["avg"] - scores["avg"]), abs=1e-4)
    assert ft["ci"] == "paired bootstrap" and pd.isna(ft["tiny_qa_paper"])

    # rendered under its label
    out = tmp_path / "aggregate"
    table1 = next(e for e in TABLES if e.name == "table1")
    for artifact in table1.build(agg.inputs(table1)):
        write_artifact(artifact, out)
    tasks_md = (out / "tables" / "table1_tasks.md").read_text()
    header = next(line for line in tasks_md.splitlines() if line.startswith("| row"))
    assert [c.strip() for c in header.split("|")][-2] == "TQA"
