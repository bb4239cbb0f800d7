"""Held-out perplexity over documents (data/held_out.py): each row's document, a capped sample that reaches every
document, records that keep both, intervals that resample documents, and old records backfilled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mha2mla_exp.aggregate import build_aggregate
from mha2mla_exp.aggregate.perplexity_pairs import (
    HeldOutRows,
    held_out_rows,
    per_document_ratios,
    perplexity_pairs,
    ratio_interval,
    resampling_unit,
)
from mha2mla_exp.confutil import typed_section
from mha2mla_exp.data.held_out import row_documents, select_rows
from mha2mla_exp.evaluation import run_evaluation
from mha2mla_exp.schema.sections import EvalConfig
from tests.conftest import tiny_causal_lm

FIXTURES = Path(__file__).parent / "fixtures" / "runs"


def test_a_row_belongs_to_the_document_holding_most_of_its_tokens():
    # documents of 5, 3 and 10 tokens (separators included) cut into rows of 4: the second row holds one token
    # of the first document and three of the second
    assert row_documents(torch.tensor([5, 3, 10]), 4, 4).tolist() == [0, 1, 2, 2]
    assert row_documents(torch.tensor([2, 2]), 4, 1).tolist() == [0]  # a tie: the earlier document
    with pytest.raises(ValueError, match="do not fit"):
        row_documents(torch.tensor([5, 3]), 4, 3)


def _documents(counts) -> torch.Tensor:
    return torch.cat([torch.full((c,), d) for d, c in enumerate(counts)])


def test_a_capped_sample_reaches_every_document_and_keeps_their_weight():
    counts = [4, 18, 10, 40, 2, 1, 25, 7]
    documents = _documents(counts)
    picked = select_rows(documents, 32, "stratified", seed=0)
    assert len(picked) == 32 and len(set(picked.tolist())) == 32 and picked.tolist() == sorted(picked.tolist())
    per_doc = torch.bincount(documents[picked], minlength=len(counts))
    assert (per_doc >= 1).all()  # every document represented
    assert (per_doc <= torch.tensor(counts)).all()
    expected = 1 + (32 - len(counts)) * (torch.tensor(counts) - 1) / (sum(counts) - len(counts))
    assert (per_doc - expected).abs().max() < 1  # the rest shared in proportion
    assert torch.equal(select_rows(documents, 32, "stratified", seed=0), picked)  # a pure function of the seed
    assert not torch.equal(select_rows(documents, 32, "stratified", seed=1), picked)
    assert select_rows(documents, 32, "first").tolist() == list(range(32))
    assert select_rows(documents, None).tolist() == list(range(len(documents)))
    fewer = select_rows(documents, 3, "stratified", seed=0)  # fewer rows than documents: one row each
    assert len(set(documents[fewer].tolist())) == 3
    with pytest.raises(ValueError, match="eval.perplexity.rows"):
        select_rows(documents, 4, "random")


def test_the_record_says_which_rows_of_which_documents_were_scored():
    model = tiny_causal_lm("gqa", seed=0)
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (12, 16), generator=torch.Generator().manual_seed(0))
    documents = _documents([6, 2, 4])

    def evaluation(**perplexity) -> EvalConfig:
        return typed_section(EvalConfig, {"perplexity": {"enabled": True} | perplexity}, "eval")

    cfg = evaluation(batch_size=2, max_batches=2, rows="stratified", row_seed=0)
    out = run_evaluation(model, None, cfg, held_out=rows, held_out_documents=documents)["perplexity"]
    assert out["row_selection"] == "stratified" and len(out["row_nll"]) == 4
    assert sorted(set(out["row_document"])) == [0, 1, 2]
    assert out["row_document"] == documents[out["row_index"]].tolist()
    # the same four rows scored alone give the same perplexity: the record's index names what was scored
    alone = run_evaluation(model, None, evaluation(batch_size=4), held_out=rows[out["row_index"]])["perplexity"]
    assert math.isclose(alone["heldout"], out["heldout"], rel_tol=1e-6)
    first = run_evaluation(
        model, None, evaluation(batch_size=2, max_batches=2, rows="first"), held_out=rows, held_out_documents=documents
    )["perplexity"]
    assert first["row_index"] == [0, 1, 2, 3] and set(first["row_document"]) == {0}
    with pytest.raises(ValueError, match="eval.perplexity.rows: expected one of"):  # the schema's
        run_evaluation(model, None, evaluation(rows="random"), held_out=rows)


def _split_effect() -> tuple[HeldOutRows, HeldOutRows]:
    """B 0.1 nats better on 20 rows of one document, 0.05 worse on the 10 rows of two others."""
    rng = np.random.default_rng(0)
    documents = np.array([0] * 20 + [1] * 5 + [2] * 5)
    a = 4.0 + rng.normal(0, 0.05, 30)
    b = a + np.where(documents == 0, -0.1, 0.05)
    tokens = np.full(30, 511.0)
    return HeldOutRows(a, tokens, documents, tuple(range(30))), HeldOutRows(b, tokens, documents, tuple(range(30)))


def test_the_interval_resamples_documents_not_rows():
    a, b = _split_effect()
    estimate, low, high = ratio_interval(a, b)
    rows_only = HeldOutRows(a.nll, a.tokens)
    _, row_low, row_high = ratio_interval(rows_only, HeldOutRows(b.nll, b.tokens))
    assert row_high < 1  # resampling rows calls B better ...
    assert low < 1 < high  # ... three documents do not
    assert (high - low) > 2 * (row_high - row_low)
    assert estimate < 1
    ratios = per_document_ratios(a, b)
    assert ratios[0] < 1 < ratios[1] and len(ratios) == 3
    assert resampling_unit(a) == "3 documents" and resampling_unit(rows_only) == "30 rows (documents unknown)"


def _run(root: Path, name: str, *, rope: str, row_nll, documents=None, index=None) -> None:
    base = json.loads((FIXTURES / "table3/smollm2-135m__2-norm-r4__split-dkv16/results.json").read_text())
    base.update(run_name=name, experiment="cpu10x_table3", status="ok")
    base["mla"].update(rope=rope, d_kv=16, r=4)
    ppl = {
        "heldout": math.exp(float(np.mean(row_nll))),
        "row_nll": list(map(float, row_nll)),
        "row_tokens": [511] * len(row_nll),
    }
    if documents is not None:
        ppl |= {"row_document": list(map(int, documents)), "row_index": list(index)}
    base["eval"] = {"perplexity": ppl}
    (root / name).mkdir(parents=True)
    (root / name / "results.json").write_text(json.dumps(base))
    (root / name / "config.yaml").write_text(json.dumps({"seed": 0}))


def test_a_verdict_needs_every_document_and_the_same_rows(tmp_path):
    a, b = _split_effect()
    runs = tmp_path / "runs"
    _run(runs, "2norm", rope="2-norm", row_nll=a.nll, documents=a.documents, index=range(30))
    _run(runs, "high", rope="high", row_nll=b.nll, documents=a.documents, index=range(30))
    _run(runs, "uniform", rope="uniform", row_nll=a.nll - 0.1, documents=a.documents, index=range(1, 31))
    pairs = perplexity_pairs(build_aggregate([runs]).runs, ["cpu10x_table3"])

    def pair(x: str, y: str) -> list[dict]:
        return [p for p in pairs.to_dict("records") if x in p["A"] + p["B"] and y in p["A"] + p["B"]]

    (split,) = pair("high", "2-norm")
    assert split["verdict"] == "not resolved" and split["resampled"] == "3 documents"
    assert len(split["B/A per document"]) == 3
    other_rows = pair("uniform", "2-norm") + pair("uniform", "high")  # scored other rows: not paired
    assert len(other_rows) == 2 and all(p["verdict"] == "not comparable: other held-out rows" for p in other_rows)


def test_a_record_without_row_indices_scored_the_first_rows():
    """TransMLA's reference runs and records older than the stratified sample keep no indices: they pair with a
    record of the first rows, never with a sampled one."""
    nll, tokens = [3.0, 3.1, 3.2, 3.3], [511] * 4
    old = held_out_rows(nll, tokens)
    assert old.same_rows(held_out_rows(nll, tokens, index=[0, 1, 2, 3]))
    assert not old.same_rows(held_out_rows(nll, tokens, index=[0, 7, 14, 21]))
    assert not held_out_rows(nll, tokens, index=[0, 7, 14, 21]).same_rows(old)
