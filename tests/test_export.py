"""The DeepSeek-V3 export (mha2mla_exp/export): a converted tiny Llama loads in stock transformers (no remote
code) and gives our logits; what cannot be exported exactly is refused, naming why, before weights are read."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_causal_lm

from mha2mla_exp.export import ExportError, export, plan_export
from mha2mla_exp.export.plan import fitted_theta, geometric_stride
from mha2mla_exp.export.weights import interleave
from mha2mla_exp.mla.convert import convert_to_mla
from mha2mla_exp.mla.rope.rorope_geometric import geometric_choice, geometric_strides

CELLS = Path(__file__).resolve().parents[1] / "conf/cells/conversion"
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
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 1.0
    assert config["rope_interleave"] is True
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


def test_exported_rope_is_ours_on_the_yarn_path(exported):
    """The export's YaRN-at-factor-1 rope (vLLM's pure-PyTorch DeepSeek YaRN class, exact in eager mode too) gives,
    the way transformers computes it for that config, the default rope's frequencies bit for bit, ours in fp64 to
    fp32 rounding, and a cos/sin scale and a softmax scale of exactly 1."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    mla, out, record = exported
    config = AutoConfig.from_pretrained(out)
    assert config.rope_parameters["rope_type"] == "yarn"
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    default, _ = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(config)
    assert torch.equal(inv_freq, default) and attention_factor == 1.0  # YaRN's blend adds no rounding at factor 1
    assert DeepseekV3RotaryEmbedding(config).attention_scaling == 1.0  # cos/sin not rescaled
    head = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert yarn_apply_mscale(config.rope_parameters, head**-0.5) == head**-0.5  # no mscale^2 on the softmax
    assert DeepseekV3Attention(config, layer_idx=0).scaling == head**-0.5
    # ours: the source's frequencies at the kept pairs, theta^(-2f/d_h); DeepSeek's slot j: theta'^(-2j/d_r)
    plan = record["plan"]
    pairs = torch.tensor(plan["pairs"], dtype=torch.float64)
    ours64 = plan["theta"] ** (-2 * pairs / plan["nope_dim"])
    theirs64 = plan["theta_export"] ** (-2 * torch.arange(len(pairs), dtype=torch.float64) / plan["rope_dim"])
    assert torch.allclose(theirs64, ours64, rtol=1e-12, atol=0)  # the same frequencies, in fp64
    ours32 = mla.model.rotary_emb.inv_freq[plan["pairs"]]  # our model's own (fp32) and theirs, both fp32 roundings
    assert torch.allclose(inv_freq.double(), ours64, rtol=2**-23, atol=0)
    assert torch.allclose(ours32.double(), ours64, rtol=2**-23, atol=0)


def test_target_check_refuses_the_tiny_mechanics_export_for_vllm_cpu(tmp_path, capsys):
    """`model=tiny_random +cells/conversion=serve576`: 4 heads of 16 dims, 2 KV heads, so r=1 d_kv=16 gives a
    32-wide latent and a 4-dim rope key; vllm-cpu takes 512 + 64 only: refused before anything is written, naming
    both widths and why no conversion of this model reaches them."""
    from mha2mla_exp.export.__main__ import main

    cell = yaml.safe_load((CELLS / "serve576.yaml").read_text())
    mla = converted("gqa", r=cell["rope"]["r"], d_kv=cell["svd"]["d_kv"])
    mla.save_pretrained(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--target", "vllm-cpu"]) == 2
    err = capsys.readouterr().err
    assert "kv_lora_rank 512 + qk_rope_head_dim 64" in err and "kv_lora_rank 32 + qk_rope_head_dim 4" in err
    assert "head_dim 16 has 8 rope frequencies" in err
    assert not (tmp_path / "out").exists()
    # vllm-gpu: Triton MLA takes any width, so a warning naming the backends, and the export is written
    with pytest.warns(UserWarning, match="runs on TRITON_MLA only"):
        record = export(tmp_path / "src", tmp_path / "out", target="vllm-gpu")
    assert record["targets"]["fits"] == ["transformers"] and record["targets"]["asked"] == "vllm-gpu"
    assert json.loads((tmp_path / "out/export.json").read_text())["targets"] == record["targets"]


def test_target_check_accepts_512_plus_64_and_names_the_conversion(exported):
    from types import SimpleNamespace

    from mha2mla_exp.export.targets import check_target, fitting_targets, gpu_backends, servable_conversion

    _, _, record = exported
    plan = plan_export(exported[0].config)
    served = replace(plan, latent=512, rope_dim=64, nope_dim=128)
    for target in ("vllm-cpu", "vllm-gpu", "transformers"):
        assert check_target(served, None, target) == []
    assert fitting_targets(served) == ["transformers", "vllm-cpu", "vllm-gpu"]
    assert gpu_backends(served) == ["CUTLASS_MLA", "FLASHINFER_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA"]
    assert record["targets"]["fits"] == ["transformers"]  # the fixture's 24 + 8 fits transformers alone
    with pytest.raises(ExportError, match="vllm-tpu"):
        check_target(served, None, "vllm-tpu")
    # the conversion reaching 512 + 64: Llama-2-7B's 32 KV heads of 128 is the serve576 cell; 8 KV heads: r=4
    cell = yaml.safe_load((CELLS / "serve576.yaml").read_text())
    llama2 = servable_conversion(SimpleNamespace(num_key_value_heads=32, head_dim=128))
    assert f"rope.r={cell['rope']['r']} " in llama2 and f"svd.d_kv={cell['svd']['d_kv']} " in llama2
    assert "serve576.yaml" in llama2
    gqa8 = servable_conversion(SimpleNamespace(num_key_value_heads=8, head_dim=128))
    assert "rope.r=4 " in gqa8 and "svd.d_kv=64" in gqa8 and "serve576" not in gqa8
    assert "do not divide" in servable_conversion(SimpleNamespace(num_key_value_heads=3, head_dim=128))
