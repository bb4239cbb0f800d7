"""LongBench the paper's way, on a local fixture in LongBench's own format: scores through lm-eval's
LongBench tasks match hand-computed values; generation settings; middle truncation end to end."""

import pytest
import torch
from lm_eval.api.model import LM

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.evaluation.fixtures import longbench_dir
from mha2mla_exp.evaluation.lm import EvalLM
from mha2mla_exp.evaluation.longbench import SUBSETS, evaluate_longbench
from mha2mla_exp.evaluation.run import check_eval_config
from mha2mla_exp.schema.sections import EvalConfig, LongBenchConfig

CLASSES = ["Description", "Entity", "Abbreviation", "Human being", "Location", "Number"]
# subset -> [(record, canned model output, hand-computed score)]
CASES = {
    "narrativeqa": [  # qa F1 over normalised tokens (articles and punctuation dropped)
        ({"input": "Q-nar-1 Who ran?", "context": "A red fox ran.", "answers": ["a red fox"]}, " The red fox.", 1.0),
        # pred {red, dog} vs gold {red, fox, jumped, high}: P = 1/2, R = 1/4, F1 = 1/3
        ({"input": "Q-nar-2 What?", "context": "...", "answers": ["red fox jumped high"]}, "the red dog", 1 / 3),
    ],
    "passage_count": [  # share of the numbers in the answer that are right
        ({"context": "C-cnt-1 paragraphs", "answers": ["3"]}, " There are 3 unique paragraphs, not 4.", 0.5),
        ({"context": "C-cnt-2 paragraphs", "answers": ["5"]}, "5", 1.0),
    ],
    "passage_retrieval_en": [
        ({"input": "Q-ret-1 abstract", "context": "...", "answers": ["Paragraph 7"]}, "Paragraph 7", 1.0),
        (
            {"input": "Q-ret-2 abstract", "context": "...", "answers": ["Paragraph 12"]},
            "Paragraph 2 or Paragraph 12",
            0.5,
        ),
    ],
    "trec": [  # LongBench keeps the first line after leading newlines (lm-eval alone would score "")
        (
            {
                "input": "Q-trec-1 Where is Paris?",
                "context": "examples",
                "answers": ["Location"],
                "all_classes": CLASSES,
            },
            "\nLocation\nNumber",
            1.0,
        ),
        (
            {"input": "Q-trec-2 How many?", "context": "examples", "answers": ["Number"], "all_classes": CLASSES},
            "Number or Location",
            0.5,
        ),
    ],
    # ROUGE-L F of the `rouge` package LongBench uses: LCS "cat on mat", 3 of 4 tokens both ways,
    # F = 2PR / (P + R + 1e-8)
    "gov_report": [
        (
            {"context": "R-gov-1 report", "answers": ["cat lay on mat"]},
            "cat sat on mat",
            2 * 0.75 * 0.75 / (1.5 + 1e-8),
        ),
        ({"context": "R-gov-2 report", "answers": ["something"]}, "   ", 0.0),  # empty summary
    ],
    "lcc": [  # first non-empty line without comment marks, fuzz.ratio: 2*13/28 -> 93 -> 0.93
        ({"context": "L-lcc-1 def f():\n", "answers": ["    x = foo(2)"]}, "\n    x = foo(1)\n# next", 0.93),
        ({"context": "L-lcc-2 def g():\n", "answers": ["return 1"]}, "return 1", 1.0),
    ],
}


class CannedLM(LM):
    """Answers each prompt with the canned output whose marker it contains; records what it was asked."""

    def __init__(self, answers: dict[str, str]):
        super().__init__()
        self.answers, self.requests = answers, []

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for r in requests:
            context, kwargs = r.args
            self.requests.append((context, kwargs))
            out.append(next(a for marker, a in self.answers.items() if marker in context))
        return out

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


def _marker(record):
    return (record.get("input") or record["context"]).split()[0]


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def data_dir(tmp_path):
    return longbench_dir(tmp_path / "longbench", {s: [rec for rec, _, _ in cases] for s, cases in CASES.items()})


def test_scores_match_hand_computed_values(data_dir):
    lm = CannedLM({_marker(rec): out for cases in CASES.values() for rec, out, _ in cases})
    scores, meta, _ = evaluate_longbench(lm, LongBenchConfig(subsets=tuple(CASES), data_dir=str(data_dir)))
    expected = {s: sum(score for _, _, score in cases) / len(cases) for s, cases in CASES.items()}
    for subset, value in expected.items():
        assert scores[subset] == pytest.approx(value, abs=1e-9), subset
    assert scores["avg"] == pytest.approx(sum(expected.values()) / len(expected), abs=1e-9)
    assert meta["n_docs"] == {s: 2 for s in CASES}

    # LongBench's generation lengths, greedy; first-line tasks generate to max_gen like LongBench
    kwargs = {s: next(kw for ctx, kw in lm.requests if _marker(cases[0][0]) in ctx) for s, cases in CASES.items()}
    assert kwargs["narrativeqa"]["max_gen_toks"] == 128 and kwargs["gov_report"]["max_gen_toks"] == 512
    assert kwargs["trec"]["max_gen_toks"] == 64 and kwargs["trec"]["until"] == []
    assert all(kw["do_sample"] is False for kw in kwargs.values())
    # LongBench's `input` field reaches lm-eval's prompt as its `question`
    nar = next(ctx for ctx, _ in lm.requests if "Q-nar-1" in ctx)
    assert nar.rstrip().endswith("Question: Q-nar-1 Who ran?\n\nAnswer:")


def test_lm_eval_postprocessing_differs_where_longbench_does(data_dir):
    lm = CannedLM({"Q-trec-1": "\nLocation\nNumber", "Q-trec-2": "Number or Location"})
    scores, _, _ = evaluate_longbench(
        lm, LongBenchConfig(subsets=("trec",), data_dir=str(data_dir), official_postprocess=False)
    )
    assert scores["trec"] == pytest.approx((0.5 + 0.5) / 2)  # "Location\nNumber" matches two classes


def test_tiny_model_end_to_end_with_middle_truncation(tmp_path):
    from mha2mla_exp.models import build_random_model
    from tests.conftest import tiny_byte_lm

    model, tokenizer = build_random_model(tiny_byte_lm())
    long = " ".join(f"sentence {i} of a long story." for i in range(100))
    data = longbench_dir(
        tmp_path / "lb",
        {
            "passage_count": [{"context": long, "answers": ["2"]}],
            "hotpotqa": [{"input": "Who?", "context": long, "answers": ["nobody"]}],
        },
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = EvalLM(model.eval(), tokenizer, window=256)
        scores, meta, _ = evaluate_longbench(
            lm, LongBenchConfig(subsets=("passage_count", "hotpotqa"), data_dir=str(data))
        )
    finally:
        torch.set_num_threads(threads)
    assert meta["truncated_prompts"] == 2 and meta["window"] == 256
    assert all(0.0 <= scores[k] <= 1.0 for k in ("passage_count", "hotpotqa", "avg"))
    assert lm.kv_meter.calls == 2


def test_clear_errors_before_any_work(tmp_path):
    def check(longbench: dict):
        check_eval_config(typed_section(EvalConfig, {"longbench": {"enabled": True} | longbench}, "eval"))

    with pytest.raises(ValueError, match="unknown LongBench subset"):
        check({"subsets": ["narrativeqa", "lsht"]})
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        check({"subsets": ["qasper"], "data_dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match="data_dir"):  # the hub is off (HF_HUB_OFFLINE=1) and no local data
        check({})
    assert len(SUBSETS) == 16
