"""Quantized-KV evaluation: generation tasks run on the quantized cache (int4 / int2, HQQ / quanto, residual
128) for the MLA model and the original model with the same quantizer (or, labelled, transformers'
QuantizedCache defaults); the measured bytes per token are recorded next to the nominal ratio."""

import pytest
import torch

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.evaluation.fixtures import text_files
from mha2mla_exp.evaluation.kv import KVQuant, new_cache, nominal_ratio
from mha2mla_exp.evaluation.run import run_evaluation
from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.models import build_random_model
from mha2mla_exp.schema.sections import EvalConfig, KVQuantConfig, ModelConfig, PerplexityConfig, ShapeConfig

# n_kv * d_h = 64: transformers' quanto KV layers need the flattened head dims to fill whole groups of 64
TINY = ModelConfig(
    name="tiny-random",
    source="random",
    vocab_size=320,
    intermediate_size=128,
    seed=0,
    shape=ShapeConfig(
        num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, rope_base=10000, context_length=512
    ),
)
QUANTS = [{"backend": b, "nbits": n, "residual_length": 128} for b in ("hqq", "quanto") for n in (4, 2)]
CACHE_LABEL = {
    ("mla", "tokens"): "quantized latent, groups of 64 tokens per channel",
    ("original", "tokens"): "quantized K/V, groups of 64 tokens per channel",
    ("original", "transformers"): "transformers QuantizedCache",
}


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = build_random_model(TINY)
    model.eval()
    mla = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=12).eval()  # (2r + d_kv) / 2d_h = 16/64
    yield {"original": model, "mla": mla}, tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eval_cfg(tmp_path_factory):
    files = [str(p) for p in text_files(tmp_path_factory.mktemp("texts"), n_docs=3, sentences=60)]
    return typed_section(
        EvalConfig,
        {
            "perplexity": {"enabled": True, "batch_size": 2},
            "long_context": {
                "enabled": True,
                "lengths": [480],
                "depths": [0.5],
                "samples_per_depth": 2,
                "ppl_lengths": [],
                "texts": files,
                "batch_size": 2,
            },
        },
        "eval",
    )


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))


@pytest.fixture(scope="module")
def unquantized(models, eval_cfg):
    (by_kind, tokenizer), held = models, torch.randint(1, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    return {kind: run_evaluation(m, tokenizer, eval_cfg, held_out=held, window=512) for kind, m in by_kind.items()}


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q['backend']}{q['nbits']}")
@pytest.mark.parametrize("kind, grouping", list(CACHE_LABEL), ids=lambda v: v if isinstance(v, str) else None)
def test_quantized_generation_records_measured_bytes(models, eval_cfg, unquantized, kind, grouping, quant):
    by_kind, tokenizer = models
    model = by_kind[kind]
    quant = quant | {"grouping": grouping}
    out = run_evaluation(model, tokenizer, eval_cfg, kv_quant=KVQuant(**quant), window=512)
    kv, plain = out["kv_cache"], unquantized[kind]["kv_cache"]
    assert kv["kv_quant"] == KVQuant(**quant).to_dict() and kv["generate_calls"] == 1  # one batch of 2 prompts
    assert kv["cache"] == CACHE_LABEL[kind, grouping]
    assert 0 < kv["bytes_per_token_measured"] < plain["bytes_per_token_measured"]
    # the 128 most recent tokens stay full precision, so the measured ratio sits above the nominal one
    assert kv["ratio_nominal"] < kv["ratio_measured"] < plain["ratio_measured"]
    assert kv["bytes_per_token_mha"] == 2 * 2 * 32 * 2 * 4  # K and V, 2 KV heads x 32 dims, 2 layers, fp32
    assert kv["mem_change_pct"] == pytest.approx(100 * (kv["ratio_measured"] - 1))
    assert kv["ratio_nominal_paper"] == pytest.approx(kv["ratio_nominal"] * 2)  # BF16 vs this fp32 baseline
    assert 0.0 <= out["long_context"]["passkey@480"] <= 1.0
    assert "loglikelihood" in kv["note"]


def test_int2_holds_fewer_bytes_than_int4(models, eval_cfg):
    by_kind, tokenizer = models
    for model in by_kind.values():
        four, two = (
            run_evaluation(model, tokenizer, eval_cfg, kv_quant=KVQuant(backend="hqq", nbits=n), window=512)[
                "kv_cache"
            ]["bytes_per_token_measured"]
            for n in (4, 2)
        )
        assert two < four


def test_unquantized_caches_and_nominal_ratios(models, unquantized):
    by_kind, _ = models
    mla, orig = unquantized["mla"]["kv_cache"], unquantized["original"]["kv_cache"]
    assert orig["cache"] == "transformers DynamicCache" and orig["ratio_measured"] == pytest.approx(1.0)
    assert mla["cache"] == "latent" and mla["ratio_measured"] == pytest.approx(0.25)  # exactly the formula
    assert mla["ratio_nominal"] == pytest.approx(0.25)
    assert nominal_ratio(by_kind["mla"], KVQuant(nbits=4)) == pytest.approx(0.25 * 4 / 32)  # fp32 model
    assert nominal_ratio(by_kind["original"], KVQuant(nbits=2)) == pytest.approx(2 / 32)
    assert nominal_ratio(by_kind["original"], KVQuant(nbits=4), baseline_bits=16) == pytest.approx(
        0.25
    )  # the paper's -75%
    assert unquantized["mla"]["perplexity"]["heldout"] > 1


def test_no_generation_task_means_no_cache_measurement(models):
    by_kind, tokenizer = models
    out = run_evaluation(
        by_kind["mla"], tokenizer, EvalConfig(perplexity=PerplexityConfig(enabled=False)), kv_quant=KVQuant(**QUANTS[0])
    )
    assert "bytes_per_token_measured" not in out["kv_cache"] and "no KV cache" in out["kv_cache"]["note"]


@pytest.mark.parametrize("backend", ["hqq", "quanto"])
def test_mha_and_mla_caches_share_one_quantizer(models, backend):
    """The same [B, H, T, D] tensor comes back the same from the original's and the latent's quantized cache."""
    by_kind, _ = models
    quant = KVQuant(backend=backend, nbits=4, residual_length=0)
    x = torch.randn(1, 2, 200, 24, generator=torch.Generator().manual_seed(0))
    back = []
    for model in by_kind.values():
        cache = new_cache(model, quant)
        keys, _ = cache.layers[0].update(x, x)  # the first update keeps full precision, quantizes for later
        back.append(cache.layers[0]._dequantize(cache.layers[0]._quantized_keys))
    assert type(new_cache(by_kind["original"], quant)) is type(new_cache(by_kind["mla"], quant))
    assert torch.equal(back[0], back[1]) and 0 < (back[0] - x).abs().max() < 0.5


def test_bad_kv_quant_is_rejected():
    def quantization(**section) -> KVQuant | None:
        return KVQuant.from_config(typed_section(KVQuantConfig, section, "kv_quant"))

    with pytest.raises(ValueError, match="kv_quant.grouping: expected one of"):  # the schema's
        quantization(backend="hqq", nbits=4, grouping="heads")
    with pytest.raises(ValueError, match="original model"):
        KVQuant(grouping="transformers").check_model(converted=True)
    with pytest.raises(ValueError, match="kv_quant.backend: expected one of"):
        quantization(backend="gptq", nbits=4)
    with pytest.raises(ValueError, match="nbits"):  # the backend's bits
        quantization(backend="quanto", nbits=8)
    assert quantization(backend=None, nbits=None) is None
