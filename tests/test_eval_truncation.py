"""Middle truncation (the paper's LongBench protocol): head and tail kept, in EvalLM's generation path."""

import pytest
import torch
from lm_eval.api.instance import Instance

from mha2mla_exp.evaluation.lm import EvalLM, middle_truncate


def test_middle_truncate_keeps_head_and_tail():
    ids = list(range(10))
    assert middle_truncate(ids, 5) == [0, 1, 2, 8, 9]  # head = 5 - 5 // 2, tail = 5 // 2 (as the MHA2MLA code)
    assert middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert middle_truncate(ids, 10) == ids and middle_truncate(ids, 50) == ids
    t = torch.arange(10)
    assert middle_truncate(t, 3).tolist() == [0, 1, 9]
    with pytest.raises(ValueError):
        middle_truncate(ids, 0)


def _prompt():
    middle = " ".join(f"filler{i}" for i in range(200))
    return "BEGIN: the instruction at the head. " + middle + " END: the question at the tail?"


def test_long_prompt_is_cut_in_the_middle(tiny):
    model, tokenizer = tiny
    lm = EvalLM(model, tokenizer, window=256)
    prompt = _prompt()
    full = tokenizer(prompt).input_ids
    assert len(full) > 1000
    ids, mask = lm.tok_batch_encode([prompt], left_truncate_len=200)
    assert ids.shape == (1, 200) and mask.all()
    assert ids[0].tolist() == full[:100] + full[-100:]
    text = tokenizer.decode(ids[0])
    assert text.startswith("BEGIN: the instruction at the head.") and text.endswith("END: the question at the tail?")
    # lm-eval's own HFLM keeps only the tail
    plain = EvalLM(model, tokenizer, window=256, middle_truncation=False)
    assert plain.tok_batch_encode([prompt], left_truncate_len=200)[0][0].tolist() == full[-200:]


def test_batch_mixes_cut_and_short_prompts_with_left_padding(tiny):
    model, tokenizer = tiny
    lm = EvalLM(model, tokenizer, window=256)
    short = "A short prompt."
    ids, mask = lm.tok_batch_encode([_prompt(), short], left_truncate_len=200)
    n = len(tokenizer(short).input_ids)
    assert ids.shape == (2, 200)
    assert mask[1].tolist() == [0] * (200 - n) + [1] * n
    assert ids[1, -n:].tolist() == tokenizer(short).input_ids
    assert (ids[1, : 200 - n] == tokenizer.pad_token_id).all()


def test_generate_until_sees_window_minus_generation(tiny, monkeypatch):
    """Through HFLM's generate_until: the model receives the middle-cut prompt of window - max_gen tokens."""
    model, tokenizer = tiny
    lm = EvalLM(model, tokenizer, window=256)
    seen = []
    real = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["input_ids"].clone())
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    req = Instance(
        request_type="generate_until",
        doc={},
        idx=0,
        arguments=(_prompt(), {"until": ["\n"], "max_gen_toks": 16, "do_sample": False}),
    )
    out = lm.generate_until([req])
    full = tokenizer(_prompt()).input_ids
    assert len(out) == 1 and lm.truncated_prompts == 1
    assert seen[0].shape == (1, 240)
    assert seen[0][0].tolist() == full[:120] + full[-120:]
    assert lm.kv_meter.calls == 1  # the cache was built here and measured
