"""The absorbed prefill (query length > 1, or a padded decode step) never materialises the whole
[B, n_h, T, S] score matrix: it takes the query rows in chunks whose fp32 scores fit a byte budget,
and keeps the softmax logits in fp32 as SDPA and the decode kernel do. Chunked, it equals one chunk
and the expanded path; in bf16 it is at least as close to the fp32 model as the expanded SDPA path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from torch.utils._python_dispatch import TorchDispatchMode

from mha2mla_exp.mla import LatentCache, convert_to_mla, modeling

SPECS = [
    ("gqa", dict(rope="uniform", r=2, svd="joint", d_kv=8)),
    ("mha", dict(rope="uniform", r=3, svd="split", d_kv=10)),
    ("qwen2", dict(rope="rorope", r=2, svd="joint", d_kv=8)),  # one shared rope key, k/v biases
    ("gqa", dict(rope="rorope", r=3, svd="none")),  # values cached as they are
    ("gqa", dict(rope="none", svd="joint", d_kv=6)),  # NoPE: no rope scores at all
]
IDS = [f"{kind}-{spec['rope']}-{spec['svd']}" for kind, spec in SPECS]


def convert(kind, spec, seed=0):
    calibration = [torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(seed))]
    return convert_to_mla(tiny_causal_lm(kind), **spec, calibration=calibration)


def budget_for_rows(rows: int, batch: int, heads: int, keys: int) -> int:
    """A score budget that lets `rows` query rows through per chunk (fp32 scores and probabilities)."""
    return rows * 2 * 4 * batch * heads * keys


class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an op produces while `recording` is set."""

    def __init__(self):
        super().__init__()
        self.recording, self.largest = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


@torch.no_grad()
def test_absorbed_prefill_never_materialises_the_score_matrix(monkeypatch):
    """Inside the attention modules no tensor reaches B*n_h*T*S/8 elements; today's code built the
    whole [B, 1, n_h*T, S] score matrix (at 7B and a 16k prompt, ~86 GB a layer)."""
    mla = convert("gqa", SPECS[0][1]).set_absorb(True)
    b, t = 2, 192
    n_h = mla.config.num_attention_heads
    monkeypatch.setattr(modeling, "ABSORBED_SCORE_BUDGET_BYTES", budget_for_rows(8, b, n_h, t), raising=False)
    ids = torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(2))
    mode = LargestTensor()

    def start(*_):
        mode.recording = True

    def stop(*_):
        mode.recording = False

    for layer in mla.model.layers:
        layer.self_attn.register_forward_pre_hook(start)
        layer.self_attn.register_forward_hook(stop)
    with mode:
        mla(ids)
    assert mode.largest > 0
    assert mode.largest < b * n_h * t * t / 8, f"largest attention tensor {mode.largest} elements"


@torch.no_grad()
@pytest.mark.parametrize("kind,spec", SPECS, ids=IDS)
def test_chunked_absorbed_prefill_equals_expanded_with_padding_and_cache(kind, spec, monkeypatch):
    """Prefill lengths of several chunks (uneven last chunk), a left-padded row, then decode steps
    through the cache: absorbed == expanded, causal and padding masks included."""
    mla = convert(kind, spec)
    b, t = 2, 40
    ids = torch.randint(0, 97, (b, t + 4), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding in the first row
    n_h = mla.config.num_attention_heads
    monkeypatch.setattr(modeling, "ABSORBED_SCORE_BUDGET_BYTES", budget_for_rows(3, b, n_h, t), raising=False)
    logits = {}
    for absorb in (False, True):
        mla.set_absorb(absorb)
        cache = LatentCache()
        steps = [mla(ids[:, :t], attention_mask=mask[:, :t], cache=cache, use_cache=True).logits]
        for i in range(t, t + 4):  # each decode step carries the padding mask, so it is a masked 'prefill' of one
            steps.append(mla(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache, use_cache=True).logits)
        logits[absorb] = torch.cat(steps, dim=1)
    valid = mask.bool()  # padded query rows attend to nothing real; their outputs are not compared
    torch.testing.assert_close(logits[True][valid], logits[False][valid], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_chunked_absorbed_prefill_equals_one_chunk(monkeypatch):
    """Bit-for-bit the same maths whatever the chunk size (one row at a time versus all rows at once)."""
    mla = convert("gqa", SPECS[0][1]).set_absorb(True)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    whole = mla(ids).logits
    monkeypatch.setattr(modeling, "ABSORBED_SCORE_BUDGET_BYTES", 1, raising=False)  # one query row per chunk
    torch.testing.assert_close(mla(ids).logits, whole, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("kind,spec", SPECS[:3], ids=IDS[:3])
def test_bf16_absorbed_prefill_is_as_close_to_fp32_as_expanded_sdpa(kind, spec):
    """In a bf16 model the absorbed prefill keeps its logits in fp32, so its attention output is at
    least as close to the fp32 model's as the expanded path through SDPA (which keeps fp32 logits)."""
    mla = convert(kind, spec)
    mla.config._attn_implementation = "sdpa"
    b, t = 2, 96
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(b, t, mla.config.hidden_size, generator=g) * 16  # large scores: rounding matters
    positions = torch.arange(t).expand(b, -1)
    attn = mla.model.layers[0].self_attn
    cos, sin = mla.model.rotary_emb(hidden, positions)
    reference = attn(hidden, (cos, sin))[0].double()  # fp32, expanded
    attn.to(torch.bfloat16)
    low = (hidden.bfloat16(), (cos.bfloat16(), sin.bfloat16()))
    errors = {}
    for absorb in (False, True):
        mla.set_absorb(absorb)
        errors[absorb] = (attn(*low)[0].double() - reference).abs().max().item()
    assert errors[True] <= errors[False], errors
