"""Offline long-context suite: passkey docs are deterministic with the answer in the prompt and fit the
length; long-document perplexity through lm-eval equals our own perplexity; held-out perplexity."""

import math

import pytest
import torch

from mha2mla_exp.evaluation.fixtures import text_files
from mha2mla_exp.evaluation.lm import EvalLM
from mha2mla_exp.evaluation.long_context import (
    NEEDLE,
    PREFIX,
    QUESTION,
    evaluate_long_context,
    load_texts,
    passkey_docs,
    ppl_docs,
)
from mha2mla_exp.evaluation.perplexity import perplexity
from mha2mla_exp.schema.sections import LongContextConfig, ModelConfig


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return load_texts(text_files(tmp_path_factory.mktemp("texts"), n_docs=4, sentences=60))


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))


def test_passkey_docs_are_deterministic_and_hold_the_answer(tiny, texts):
    _, tokenizer = tiny
    cfg = LongContextConfig(lengths=(480,), depths=(0.0, 0.5, 1.0), samples_per_depth=3, ppl_lengths=())
    docs = passkey_docs(tokenizer, texts, 480, cfg)
    assert docs == passkey_docs(tokenizer, texts, 480, cfg)
    assert len(docs) == 9 and len({d["answer"] for d in docs}) == 9
    for d in docs:
        assert d["answer"].isdigit() and len(d["answer"]) == 5
        assert NEEDLE.format(key=d["answer"]) in d["input"]
        assert d["input"].startswith(PREFIX) and d["input"].endswith(QUESTION)
        n = len(tokenizer(d["input"]).input_ids)
        assert n == d["n_tokens"] and 480 - cfg.max_gen_toks - 40 <= n <= 480 - cfg.max_gen_toks
    first, last = docs[0], docs[-1]  # depth 0: right after the instruction; depth 1: right before the question
    assert first["input"][len(PREFIX) :].startswith(NEEDLE.format(key=first["answer"]))
    assert last["input"][: -len(QUESTION)].endswith(NEEDLE.format(key=last["answer"]))
    other = passkey_docs(
        tokenizer, texts, 480, LongContextConfig(lengths=(480,), depths=(0.0,), seed=7, ppl_lengths=())
    )
    assert other[0]["answer"] != first["answer"]


def test_passkey_scoring_and_record(tiny, texts):
    model, tokenizer = tiny
    cfg = LongContextConfig(lengths=(400, 480), depths=(0.0, 1.0), samples_per_depth=1, ppl_lengths=(256,), ppl_docs=2)
    lm = EvalLM(model, tokenizer, window=512)
    rng = torch.random.get_rng_state()
    scores, ppl, meta, _ = evaluate_long_context(lm, tokenizer, cfg, texts=texts)
    assert torch.equal(rng, torch.random.get_rng_state())  # lm-eval's seeding does not leak into training
    assert set(scores) == {"passkey@400", "passkey@480", "avg"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert set(meta["by_depth"]["passkey@400"]) == {"0.0", "1.0"}
    assert math.isfinite(ppl["longdoc@256"]) and ppl["longdoc@256"] > 1 and len(meta["ppl_sources"]) == 2
    assert lm.kv_meter.calls == 4
    with pytest.raises(ValueError, match="exceeds the evaluation window"):
        evaluate_long_context(EvalLM(model, tokenizer, window=256), tokenizer, cfg, texts=texts)


def test_longdoc_perplexity_equals_ours(tiny, texts):
    """lm-eval's rolling loglikelihood (BOS, then the document) gives the same token perplexity as ours."""
    model, tokenizer = tiny
    cfg = LongContextConfig(lengths=(), ppl_lengths=(300,), ppl_docs=2)
    _, ppl, _, _ = evaluate_long_context(EvalLM(model, tokenizer, window=512), tokenizer, cfg, texts=texts)
    docs = ppl_docs(tokenizer, texts, 300, 2)
    assert all(d["n_tokens"] <= 299 for d in docs)
    nll = 0.0
    for d in docs:
        ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer.encode(d["text"])])
        nll += math.log(perplexity(model, [ids])) * d["n_tokens"]
    assert ppl["longdoc@300"] == pytest.approx(math.exp(nll / sum(d["n_tokens"] for d in docs)), rel=1e-4)


def test_perplexity_matches_the_model_loss_and_skips_padding(tiny):
    model, _ = tiny
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (2, 40), generator=g)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert perplexity(model, [ids]) == pytest.approx(math.exp(loss), rel=1e-5)
    assert perplexity(model, [ids[:1], ids[1:]]) == pytest.approx(math.exp(loss), rel=1e-5)  # token-weighted
    # a right-padded row: its padding is not predicted
    short = ids[1, :25]
    padded = torch.cat([short, torch.zeros(15, dtype=torch.long)]).unsqueeze(0)
    mask = torch.cat([torch.ones(25), torch.zeros(15)]).long().unsqueeze(0)
    assert perplexity(model, [{"input_ids": padded, "attention_mask": mask}]) == pytest.approx(
        perplexity(model, [short.unsqueeze(0)]), rel=1e-5
    )
    rows = []
    assert perplexity(model, [{"input_ids": padded, "attention_mask": mask}, ids], rows=rows) == pytest.approx(
        math.exp(sum(nll for nll, _ in rows) / sum(n for _, n in rows)), rel=1e-6
    )  # the rows make the whole
    assert [n for _, n in rows] == [24, 39, 39]
    assert rows[0][0] / 24 == pytest.approx(math.log(perplexity(model, [short.unsqueeze(0)])), rel=1e-5)
    with pytest.raises(ValueError):
        perplexity(model, [])


@pytest.mark.integration
def test_smollm2_retrieves_the_passkey_and_nope_does_worse():
    """The real model finds the key at 512 tokens; the same model converted to NoPE without fine-tuning does not."""
    from mha2mla_exp.mla import convert_to_mla
    from mha2mla_exp.models import load_model

    model, tokenizer = load_model(ModelConfig(source="asset", id="smollm2-135m", name="smollm2-135m", dtype="float32"))
    cfg = LongContextConfig(lengths=(512,), depths=(0.0, 0.25, 0.5, 0.75), samples_per_depth=1, ppl_lengths=())
    original, _, _, _ = evaluate_long_context(EvalLM(model, tokenizer, window=2048), tokenizer, cfg)
    nope = convert_to_mla(model, rope="none", svd="none")
    converted, _, _, _ = evaluate_long_context(EvalLM(nope, tokenizer, window=2048), tokenizer, cfg)
    assert original["passkey@512"] >= 0.75
    assert converted["passkey@512"] < original["passkey@512"]


def test_lengths_beyond_the_evaluation_window_are_refused_before_the_fine_tune():
    """The suite refused them only when it ran, after the fine-tune; validation now does, naming the field."""
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.confutil import CONF_DIR
    from mha2mla_exp.runner import run_config, validate
    from mha2mla_exp.runner.config import ConfigError

    def plan(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return validate(
                run_config(
                    compose(
                        config_name="config",
                        overrides=[
                            "model=tiny_random",
                            "rope.r=2",
                            "svd.d_kv=8",
                            "eval=long_context",
                            "model.finetune_length=512",
                            *overrides,
                        ],
                    )
                )
            )

    with pytest.raises(ConfigError, match=r"eval\.long_context: its longest sequence \(1024 tokens.*window of 512"):
        plan("eval.long_context.lengths=[512,1024]", "eval.long_context.ppl_lengths=[]")
    assert plan("eval.long_context.lengths=[512]", "eval.long_context.ppl_lengths=[256]").training.fine_tune
