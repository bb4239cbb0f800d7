"""Evaluation on every rank: two processes (torchrun, gloo on CPU) split the lm-eval suites' documents and give the
one-process results, document by document; batched generation (left padding, middle truncation, the MLA latent
cache) gives the answers of one prompt at a time."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from mha2mla_exp.evaluation.fixtures import commonsense_tree, longbench_dir, text_files
from mha2mla_exp.evaluation.lm import EvalLM
from mha2mla_exp.evaluation.long_context import evaluate_long_context
from mha2mla_exp.evaluation.longbench import evaluate_longbench
from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.schema.sections import EvalConfig, LongBenchConfig, LongContextConfig
from tests.conftest import TINY_BYTE_LM
from tests.launches import launch

# a converted tiny model, not fine-tuned (so both launches evaluate the same weights), on passkey generation and
# long-document perplexity (generate_until and loglikelihood_rolling requests, 9 documents) and an offline
# commonsense slice (multiple-choice loglikelihood, a seeded sample of documents per task)
SUITE = [
    "train=none",
    "eval=long_context",
    "model.finetune_length=512",
    "eval.long_context.lengths=[400]",
    "eval.long_context.depths=[0.0,0.5,1.0]",
    "eval.long_context.ppl_lengths=[256]",
    "eval.long_context.ppl_docs=3",
    "eval.long_context.batch_size=2",
    "eval.commonsense.enabled=true",
    "eval.commonsense.offline=true",  # declared by the schema: set, not `+`
    "eval.commonsense.tasks=[arc_easy,piqa,mmlu]",
    "eval.commonsense.mmlu_subjects=[anatomy,astronomy]",
    "eval.commonsense.limit=7",
    "eval.commonsense.batch_size=4",
]


def evaluated(results_dir):
    [run_dir] = [p.parent for p in (results_dir / "default").glob("*/results.json")]
    record = json.loads((run_dir / "results.json").read_text())
    with gzip.open(run_dir / "eval_samples.jsonl.gz", "rt") as f:
        return record, [json.loads(line) for line in f]


def test_two_ranks_share_the_suites_and_give_the_one_process_results(tmp_path):
    data_root = commonsense_tree(tmp_path / "hf_datasets", n=24, subjects=("anatomy", "astronomy"))
    suite = [*SUITE, f"eval.commonsense.data_root={data_root}"]
    one = launch(tmp_path / "one", 1, *suite)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(tmp_path / "two", 2, *suite)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("[mha2mla_exp] ok:") == 1  # one record, written by the main process
    (single, single_rows), (double, double_rows) = evaluated(tmp_path / "one"), evaluated(tmp_path / "two")
    assert double["status"] == single["status"] == "ok"
    # both ranks took part, about half each (lm-eval pads the shorter share of a task by a request or so)
    ranks = double["eval"]["meta"]["ranks"]
    assert ranks["processes"] == 2 and all(n > 0 for n in ranks["requests"])
    assert abs(ranks["requests"][0] - ranks["requests"][1]) <= 4
    assert "ranks" not in single["eval"]["meta"]
    assert double["placement"]["evaluating_processes"] == 2
    # every document, scored the same, in the same order: 9 long-context ones, 7 per commonsense task; the
    # log-likelihoods to float rounding (a rank's loglikelihood batches pad to other lengths), the rest exactly
    assert len(single_rows) == 9 + 4 * 7 and len(double_rows) == len(single_rows)
    for ours, theirs in zip(double_rows, single_rows):
        assert {k: v for k, v in ours.items() if k != "ll"} == {k: v for k, v in theirs.items() if k != "ll"}
        if "ll" in theirs:
            assert ours["ll"] == pytest.approx(theirs["ll"], rel=1e-5)
    assert double["eval"]["commonsense"] == single["eval"]["commonsense"]
    assert double["eval"]["meta"]["commonsense"]["n_docs"] == single["eval"]["meta"]["commonsense"]["n_docs"]
    assert double["eval"]["long_context"] == single["eval"]["long_context"]
    assert double["eval"]["perplexity"] == single["eval"]["perplexity"]
    assert double["eval"]["meta"]["long_context"]["by_depth"] == single["eval"]["meta"]["long_context"]["by_depth"]
    # the cache bytes of both ranks' generate calls (their batches differ, so their number of calls)
    for key in ("bytes_per_token_measured", "ratio_measured", "ratio_nominal"):
        assert double["eval"]["kv_cache"][key] == single["eval"]["kv_cache"][key]


@pytest.fixture(scope="module")
def models():
    from mha2mla_exp.models import build_random_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # lm-eval's batches deterministic
    original, tokenizer = build_random_model(TINY_BYTE_LM)
    converted = convert_to_mla(original, rope="high", r=2, svd="joint", d_kv=16)
    absorbed = convert_to_mla(original, rope="high", r=2, svd="joint", d_kv=16).set_absorb(True)
    yield {"original": original.eval(), "mla": converted.eval(), "mla_absorbed": absorbed.eval()}, tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))


@pytest.mark.parametrize("which", ["original", "mla", "mla_absorbed"])  # the latent cache, both attention paths
def test_batched_passkey_generation_equals_one_prompt_at_a_time(models, which, tmp_path):
    by_name, tokenizer = models
    texts = [str(p) for p in text_files(tmp_path / "texts", n_docs=3, sentences=60)]
    # prompts of two lengths in one batch: the shorter ones left-padded
    cfg = LongContextConfig(lengths=(300, 480), depths=(0.0, 1.0), samples_per_depth=2, ppl_lengths=(), texts=texts)
    answers = {}
    for batch_size in (1, 4):
        lm = EvalLM(by_name[which], tokenizer, batch_size=batch_size, window=512)
        _, _, _, rows = evaluate_long_context(lm, tokenizer, cfg)
        answers[batch_size] = [(row["task"], row["doc_id"], row["response"]) for row in rows]
        assert lm.kv_meter.calls == (8 if batch_size == 1 else 2)  # 8 prompts of both lengths, 4 a batch
    assert len(answers[1]) == 8 and answers[4] == answers[1]


def test_batched_longbench_equals_batch_one_with_prompts_cut_in_the_middle(models, tmp_path):
    by_name, tokenizer = models
    filler = " ".join(f"Paragraph {i}: the {i}th record of the union." for i in range(40))  # ~1,800 bytes
    records = {
        "passage_retrieval_en": [
            {"input": f"Q{i} which paragraph?", "context": filler[: 300 + 400 * i], "answers": [f"Paragraph {i}"]}
            for i in range(4)
        ],
        "trec": [
            {
                "input": f"Q-trec-{i} Where?",
                "context": filler[: 200 + 500 * i],
                "answers": ["Location"],
                "all_classes": ["Location", "Number"],
            }
            for i in range(3)
        ],
    }
    data = longbench_dir(tmp_path / "longbench", records)
    results = {}
    for batch_size in (1, 3):
        cfg = LongBenchConfig(subsets=tuple(records), data_dir=str(data), batch_size=batch_size)
        lm = EvalLM(by_name["mla"], tokenizer, batch_size=cfg.batch_size, window=256)
        scores, meta, rows = evaluate_longbench(lm, cfg)
        results[batch_size] = (scores, [(r["task"], r["doc_id"], r["response"]) for r in rows])
        assert meta["truncated_prompts"] >= 4  # the long prompts were cut to the window, in the middle
    assert len(results[1][1]) == 7 and results[3] == results[1]


def test_the_longbench_config_generates_in_batches():
    from pathlib import Path

    from omegaconf import OmegaConf

    # the group file as a run composes it: onto the schema's EvalConfig (the file holds only what differs from it)
    path = Path(__file__).resolve().parents[1] / "conf" / "eval" / "longbench.yaml"
    conf = OmegaConf.merge(OmegaConf.structured(EvalConfig), OmegaConf.load(path))
    assert conf.longbench.batch_size > 1 and LongBenchConfig().batch_size > 1
