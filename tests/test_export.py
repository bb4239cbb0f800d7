"""The DeepSeek-V3 export (mha2mla_exp/export): a converted tiny Llama loads in stock transformers (no remote
code) and gives our logits; what cannot be exported exactly is refused, naming why, before weights are read."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.export import ExportError, export, plan_export
from mha2mla_exp.export.plan import fitted_theta, geometric_stride
from mha2mla_exp.export.weights import interleave
from mha2mla_exp.mla.convert import convert_to_mla
from mha2mla_exp.mla.rope.rorope_geometric import geometric_choice, geometric_strides

# every hf_config key vLLM 0.32's deepseek_v2.py reads as `config.<key>` (no default) for a dense MLA model, and
# the ones HF's DeepseekV3 needs to build the same model
VLLM_KEYS = (
    "architectures model_type vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads q_lora_rank kv_lora_rank qk_rope_head_dim qk_nope_head_dim v_head_dim hidden_act "
    "max_position_embeddings rms_norm_eps rope_parameters rope_interleave first_k_dense_replace n_routed_experts "
    "n_shared_experts moe_intermediate_size num_experts_per_tok norm_topk_prob tie_word_embeddings"
).split()


def calibration():
    return [torch.randint(0, 97, (4, 48), generator=torch.Generator().manual_seed(2))]


def converted(kind="mha", rope="rorope-geometric", r=1, svd="joint", d_kv=8):
    model = tiny_causal_lm(kind)
    return convert_to_mla(model, rope=rope, r=r, svd=svd, d_kv=d_kv, calibration=calibration()).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    mla = converted("gqa", r=2, d_kv=12)
    mla.save_pretrained(root / "src")
    record = export(root / "src", root / "out")
    return mla, root / "out", record


@pytest.mark.parametrize(
    "kind,svd,d_kv", [("mha", "joint", 8), ("gqa", "joint", 12), ("gqa", "split", 8), ("mha", "none", None)]
)
def test_export_matches_our_logits_in_stock_transformers(tmp_path, kind, svd, d_kv):
    from transformers import AutoModelForCausalLM

    mla = converted(kind, svd=svd, d_kv=d_kv)
    mla.save_pretrained(tmp_path / "src")
    record = export(tmp_path / "src", tmp_path / "out")
    assert record["plan"]["exact"] and record["norm"]["residual"] < 1e-6  # the latent norm: identity to 1e-6
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert "auto_map" not in config and not list((tmp_path / "out").glob("*.py"))  # no remote code
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(stock).__module__ == "transformers.models.deepseek_v3.modeling_deepseek_v3"
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = mla(ids, use_cache=False).logits, stock(ids, use_cache=False).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()
    assert record["verification"]["relative"] <= 1e-4
    with torch.no_grad():  # and decoding from DeepSeek's own cache gives the same next tokens
        greedy = stock.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
        mine = mla.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, mine)


def test_exported_config_has_every_key_vllm_reads(exported):
    _, out, record = exported
    config = json.loads((out / "config.json").read_text())
    assert not [k for k in VLLM_KEYS if k not in config]
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # every MLP dense: no MoE is built
    assert config["rope_parameters"]["rope_type"] == "default" and config["rope_interleave"] is True
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == record["cache_elements_per_token"] == 12 * 2 + 8
    assert json.loads((out / "export.json").read_text())["verification"] == record["verification"]


def test_geometric_frequency_sets():
    assert geometric_stride([0, 2, 4, 6]) == 2 and geometric_stride([0]) == 1
    assert geometric_stride([0, 1, 3]) is None and geometric_stride([1, 2, 3]) is None
    assert geometric_strides(32, 128) == [1, 2]  # Llama-2-7B's 32 pairs: {0..31} or {0, 2, .., 62}
    assert fitted_theta([0, 2, 4, 6], 10000.0, 16) == pytest.approx(10000.0)
    # one stride for the model: the layers' summed scores decide; each frequency keeps its best component
    scores = [torch.tensor([[5.0, 0, 1, 0], [0, 0, 0, 9]]), torch.tensor([[1.0, 3, 0, 0], [2, 0, 0, 0]])]
    stride, kept = geometric_choice(scores, 2)
    assert stride == 3 and kept == [[(0, 0), (1, 3)], [(1, 0), (0, 3)]]
    assert interleave(6).tolist() == [0, 3, 1, 4, 2, 5]


def test_refusals_name_why_before_weights_are_read(exported, tmp_path):
    mla, _, _ = exported
    base = mla.config

    def refused(match, **changes):
        config = copy.deepcopy(base)
        for k, v in changes.items():
            setattr(config, k, v)
        with pytest.raises(ExportError, match=match):
            plan_export(config)
        return config

    refused("rope_layout='per_head'", rope_layout="per_head")
    refused("q_bias", q_bias=True)
    refused("kv_bias", kv_bias=True)
    refused("mlp_bias", mlp_bias=True)
    refused("latent_dims", latent_dims=[24, 16])
    refused("widths differ between layers", rope_pairs=[[[0, 2, 4, 6]], [[0, 3]]])
    refused("not a geometric set", rope_pairs=[[[0, 1, 3, 5]], [[0, 1, 3, 5]]])
    refused("differ between layers", rope_pairs=[[[0, 2, 4, 6]], [[0, 1, 2, 3]]])
    refused("rope_type='llama3'", rope_parameters=dict(base.rope_parameters, rope_type="llama3"))
    refused("hidden_act='gelu'", hidden_act="gelu")
    refused("source_model_type='gemma'", mla=dict(base.mla, source_model_type="gemma"))
    # a folder holding only a refused config: refused from the config, no weights needed
    config = copy.deepcopy(base)
    config.rope_layout = "per_head"
    config.save_pretrained(tmp_path / "src")
    with pytest.raises(ExportError, match="per_head"):
        export(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_per_head_and_biased_conversions_are_refused(tmp_path):
    for kind, rope, match in (("gqa", "2-norm", "per_head"), ("qwen2", "rorope-geometric", "q_bias")):
        mla = converted(kind, rope=rope)
        with pytest.raises(ExportError, match=match):
            plan_export(mla.config)


def test_approximate_frequencies_are_measured_and_recorded(tmp_path):
    mla = converted("mha", rope="rorope", r=1)  # RoRoPE's own choice: frequencies need not be a geometric set
    mla.save_pretrained(tmp_path / "src")
    pairs = sorted(mla.config.rope_pairs[0][0])
    if geometric_stride(pairs) is not None and all(sorted(p[0]) == pairs for p in mla.config.rope_pairs):
        pytest.skip("RoRoPE happened to keep a geometric set")
    with pytest.raises(ExportError):
        export(tmp_path / "src", tmp_path / "out")
    record = export(tmp_path / "src", tmp_path / "out", approximate=True)
    assert not record["plan"]["exact"] and record["plan"]["stride"] is None
    assert record["verification"]["max_abs_dlogit_fp32"] > 0  # the change is measured and written down
    assert json.loads((tmp_path / "out/export.json").read_text())["plan"]["exact"] is False
