"""Per-document results: written with the run, read back unchanged, and consistent with the scores
lm-eval aggregated from them; the evaluation dtype option."""

import copy
import gzip
import json

import pytest
import torch

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.evaluation.commonsense import MMLU
from mha2mla_exp.evaluation.fixtures import commonsense_tree
from mha2mla_exp.evaluation.perplexity import perplexity
from mha2mla_exp.evaluation.run import run_evaluation, suites_dtype
from mha2mla_exp.evaluation.samples import read_samples, samples_frame, write_samples
from mha2mla_exp.evaluation.tasks import sample_indices
from mha2mla_exp.schema.commonsense_suite import suite
from mha2mla_exp.schema.sections import EvalConfig

SUBJECTS = ("anatomy", "astronomy")
COLUMNS = [c for c in suite() if c != MMLU]  # one lm-eval task each


@pytest.fixture(autouse=True)
def _task_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return commonsense_tree(tmp_path_factory.mktemp("olmo") / "hf_datasets", n=12, subjects=SUBJECTS)


def _eval_cfg(data_root, **top) -> EvalConfig:
    return typed_section(
        EvalConfig,
        {
            "perplexity": {"enabled": False},
            **top,
            "commonsense": {
                "enabled": True,
                "limit": 8,
                "mmlu_limit": 5,
                "seed": 3,
                "batch_size": 4,
                "data_root": str(data_root),
                "mmlu_subjects": list(SUBJECTS),
            },
        },
        "eval",
    )


def test_write_read_round_trip_is_exact_and_atomic(tmp_path):
    rows = [
        {
            "suite": "commonsense",
            "column": "piqa",
            "task": "offline_piqa",
            "doc_id": 3,
            "doc_hash": "ab",
            "target": 1,
            "acc": 1.0,
            "ll": [-1.25, -0.1 / 3],
            "pred": 1,
            "response": "naïve ✓",
        },
        {"suite": "long_context", "column": "longdoc@256", "task": "t", "doc_id": 0, "ll": float("-inf")},
    ]
    path = write_samples(rows, tmp_path / "run" / "eval_samples.jsonl.gz")
    assert read_samples(path) == rows
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    with gzip.open(path, "rt") as f:  # plain gzipped JSON lines, readable without this package
        assert [json.loads(line)["doc_id"] for line in f] == [3, 0]
    assert write_samples(rows, path).read_bytes() == path.read_bytes()  # same rows, same bytes (no mtime)


def test_run_writes_one_row_per_evaluated_doc_and_they_give_the_scores(tiny, data_root, tmp_path):
    model, tokenizer = tiny
    path = tmp_path / "eval_samples.jsonl.gz"
    out = run_evaluation(model, tokenizer, _eval_cfg(data_root), samples_path=path)
    frame = samples_frame(path)
    meta = out["meta"]["commonsense"]
    assert out["meta"]["samples"]["rows"] == len(frame) == sum(meta["n_docs"].values())
    assert frame.groupby("column").size().to_dict() == meta["n_docs"]
    assert not frame.duplicated(["task", "doc_id"]).any()
    # the docs are the seeded sample, the same for every model
    piqa = frame[frame["column"] == "piqa"]
    assert sorted(piqa["doc_id"]) == sample_indices(12, 8, "random", 3)
    # each score is the mean of its per-doc metric (MMLU: over all its subjects' docs, size-weighted)
    for column in COLUMNS:
        metric = suite()[column].metric
        assert frame.loc[frame["column"] == column, metric].mean() == pytest.approx(out["commonsense"][column])
    assert frame.loc[frame["column"] == "mmlu", "acc_norm"].mean() == pytest.approx(out["commonsense"]["mmlu"])
    # the raw outputs explain the metrics: acc is argmax ll == target, acc_norm the length-normalised one
    assert ((frame["pred"] == frame["gold"]) == (frame["acc"] == 1.0)).all()
    has_norm = frame["acc_norm"].notna()  # Winogrande reports acc only
    assert ((frame["pred_norm"] == frame["gold"]) == (frame["acc_norm"] == 1.0))[has_norm].all()
    assert (frame["ll"].map(len) == frame["is_greedy"].map(len)).all()


def test_bfloat16_evaluation_casts_after_the_perplexity(tiny, data_root, tmp_path):
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    held_out = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    fp32_ppl = perplexity(model, [held_out])
    cfg = _eval_cfg(data_root, dtype="bfloat16", perplexity={"enabled": True})
    out = run_evaluation(model, tokenizer, cfg, held_out=held_out, samples_path=tmp_path / "s.jsonl.gz")
    assert out["perplexity"]["heldout"] == pytest.approx(fp32_ppl, rel=1e-6)  # in the model's own dtype
    assert out["meta"]["dtype"] == "bfloat16" and model.dtype == torch.bfloat16
    assert all(0.0 <= out["commonsense"][c] <= 1.0 for c in COLUMNS)
    assert all(isinstance(x, float) for lls in samples_frame(tmp_path / "s.jsonl.gz")["ll"] for x in lls)


def test_unknown_eval_dtype_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="eval.dtype: expected one of"):  # the schema's
        typed_section(EvalConfig, {"dtype": "int8"}, "eval")
    assert suites_dtype(EvalConfig(dtype="auto")) is None  # a mode left unresolved: the model's own dtype
    assert suites_dtype(EvalConfig(dtype="bfloat16")) == torch.bfloat16
