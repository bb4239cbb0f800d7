"""Teacher-written recovery text (data/teacher.py): deterministic for a seed, resumable, and a data source that
splits, packs and caches like the others; `train.data` trains on it while calibration and held-out stay put."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.data import prepare_data
from mha2mla_exp.data.teacher import (
    eos_ids,
    first_token_ids,
    generate_batch,
    generate_shards,
    generation_cost,
    shard_dir,
    teacher_documents,
)
from mha2mla_exp.models import build_random_model
from mha2mla_exp.schema.sections import DataConfig, GenerationConfig
from tests.conftest import TINY_BYTE_LM


def teacher_cfg(**generation) -> DataConfig:
    gen = {
        "count": 6,
        "length": 24,
        "greedy_tokens": 3,
        "top_k": 20,
        "seed": 0,
        "batch_size": 4,
        "dtype": "float32",
    } | generation
    return typed_section(
        DataConfig,
        {
            "name": "teacher-samples",
            "source": "teacher",
            "teacher": TINY_BYTE_LM,
            "generation": gen,
            "seq_len": 16,
            "held_out_fraction": 0.3,
            "split_seed": 0,
            "separator": "eos",
        },
        "data",
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return build_random_model(TINY_BYTE_LM)


def shards(cfg) -> dict[str, torch.Tensor]:
    folder = shard_dir(cfg)
    return {p.name: load_file(p)["ids"] for p in sorted(folder.glob("shard-*.safetensors"))}


def test_generation_is_a_function_of_its_seed(cache, teacher, tmp_path, monkeypatch):
    model, tokenizer = teacher
    cfg = teacher_cfg()
    first = list(teacher_documents(cfg, tokenizer, model=model))
    assert len(first) == 6 and all(2 <= len(d) <= 24 for d in first)
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "elsewhere"))
    assert list(teacher_documents(cfg, tokenizer, model=model)) == first
    other = list(teacher_documents(teacher_cfg(seed=1), tokenizer, model=model))
    assert other != first


def test_greedy_start_follows_the_uncached_model(teacher):
    """The first tokens after the start are the argmax of a full forward over the prefix: the cached decode
    is the model itself."""
    model, tokenizer = teacher
    gen = GenerationConfig(count=3, length=10, greedy_tokens=6, batch_size=3, dtype="float32")
    g = torch.Generator().manual_seed(0)
    ids = generate_batch(model, first_token_ids(gen, tokenizer, 3, g), gen, g, eos_ids(model, tokenizer))
    for row in ids:
        for t in range(1, 7):
            if row[t] < 0:
                break
            with torch.no_grad():
                logits = model(input_ids=row[None, :t]).logits[0, -1]
            assert int(logits.argmax()) == int(row[t])


def test_first_tokens_come_from_the_list_or_the_ordinary_vocabulary(teacher):
    _, tokenizer = teacher
    g = torch.Generator().manual_seed(0)
    vocab = first_token_ids(GenerationConfig(count=1), tokenizer, 200, g)
    assert not set(vocab.tolist()) & set(tokenizer.all_special_ids)
    listed = first_token_ids(GenerationConfig(count=1, first_token="list", first_words=("ab", "c")), tokenizer, 50, g)
    allowed = {
        tokenizer(" ab", add_special_tokens=False)["input_ids"][0],
        tokenizer(" c", add_special_tokens=False)["input_ids"][0],
    }
    assert set(listed.tolist()) <= allowed


def test_an_interrupted_generation_resumes_to_the_same_set_and_more_samples_reuse_it(cache, teacher):
    model, tokenizer = teacher
    cfg = teacher_cfg()
    generate_shards(cfg, tokenizer, model=model, progress=False)
    complete = shards(cfg)
    assert len(complete) == 2
    folder = shard_dir(cfg)
    (folder / "shard-00001.safetensors").unlink()  # the batch a crash lost
    (folder / ".shard-00001.safetensors.123.tmp").write_bytes(b"half a file")
    stamp = (folder / "shard-00000.safetensors").stat().st_mtime_ns
    generate_shards(cfg, tokenizer, model=model, progress=False)
    assert {k: v.tolist() for k, v in shards(cfg).items()} == {k: v.tolist() for k, v in complete.items()}
    assert (folder / "shard-00000.safetensors").stat().st_mtime_ns == stamp  # not written again

    more = teacher_cfg(count=10)
    assert shard_dir(more) == folder  # the count is not in the key
    generate_shards(more, tokenizer, model=model, progress=False)
    assert (folder / "shard-00000.safetensors").stat().st_mtime_ns == stamp
    assert len(shards(more)) == 3
    cost = generation_cost(more)
    assert cost["shards_with_cost"] == 3 and cost["cpu_s"] >= 0 and cost["tokens"] > 0


def test_teacher_source_splits_packs_and_caches_like_any_corpus(cache, teacher, monkeypatch):
    model, tokenizer = teacher
    cfg = teacher_cfg(count=16)
    docs = list(teacher_documents(cfg, tokenizer, model=model))
    monkeypatch.setattr(
        "mha2mla_exp.models.load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("reloaded"))
    )
    data = prepare_data(cfg, tokenizer)  # the shards exist: no model is loaded
    assert data.stats["documents"]["train"] + data.stats["documents"]["held_out"] == 16
    assert data.stats["documents"]["held_out"] > 0 and data.stats["documents"]["train"] > 0
    assert data.stats["tokens"]["train"] + data.stats["tokens"]["held_out"] == sum(len(d) + 1 for d in docs)
    assert data.train.shape[1] == 16 and data.held_out.shape[1] == 16
    assert data.stats["generation"]["shards"] == 4
    # a document is wholly on one side: its ids appear in exactly one split's stream
    streams = {s: data.stream(s).tolist() for s in ("train", "held_out")}
    for doc in docs:
        inside = [s for s, stream in streams.items() if _contains(stream, doc)]
        assert len(inside) == 1, doc
    again = prepare_data(cfg, tokenizer)
    assert again.stats["cache_hit"] and torch.equal(again.train, data.train)


def _contains(stream: list[int], doc: list[int]) -> bool:
    n = len(doc)
    return any(stream[i : i + n] == doc for i in range(len(stream) - n + 1))


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"count": 0}, "data.generation.count"),
        ({"temperature": 0}, "data.generation.temperature"),
        ({"first_token": "list"}, "data.generation.first_words"),
        ({"colour": 1}, "data.generation.colour"),
        ({"length": 1}, "data.generation.length"),
        ({"dtype": "int8"}, "data.generation.dtype"),
    ],
)
def test_bad_generation_settings_are_refused_before_any_work(bad, field):
    from mha2mla_exp.data import check_data_config

    with pytest.raises(ValueError, match=field):
        check_data_config(teacher_cfg(**bad))


def test_a_run_can_recover_on_teacher_text_while_calibration_and_held_out_stay_on_its_corpus(tmp_path, monkeypatch):
    from mha2mla_exp.runner import ConfigError, run, run_config, validate
    from tests.test_runner import smoke_cfg

    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))
    extra = (
        "+data@train.data=teacher_samples",
        "train.data.generation.count=16",
        "train.data.generation.length=80",
        "train.data.generation.batch_size=4",
        "train.data.generation.dtype=float32",
        "train.data.seq_len=32",
        "train.data.held_out_fraction=0.5",
        "train.tokens=512",
        "train.epochs_allowed=true",
    )
    cfg = smoke_cfg(tmp_path, "mla_2-norm_joint", *extra)
    record = run(run_config(cfg))
    assert record["status"] == "ok", record["error"]
    assert record["train_data"]["name"] == "teacher-samples" and record["train_data"]["generation"]["shards"] == 4
    assert record["data"]["name"] == "sotu"  # calibration and held-out: the run's corpus
    ppl = record["eval"]["perplexity"]
    assert ppl["heldout"] > 1 and ppl["heldout:teacher-samples"] > 1
    assert len(ppl["row_nll:teacher-samples"]) == len(ppl["row_tokens:teacher-samples"]) > 0
    assert "-teacher__" in record["run_name"]
    plain = validate(run_config(smoke_cfg(tmp_path, "mla_2-norm_joint", "train.tokens=512")))
    assert plain.identity.trained_hash != validate(run_config(cfg)).identity.trained_hash
    with pytest.raises(ConfigError, match="train.data.generation.count"):
        validate(run_config(smoke_cfg(tmp_path, "mla_2-norm_joint", *extra[:1], "train.data.generation.count=0")))
    with pytest.raises(ConfigError, match="train.data: recovery text is set, but this run fine-tunes nothing"):
        validate(run_config(smoke_cfg(tmp_path, "original", *extra[:1])))
    json.dumps(record)  # the record stays JSON


def test_a_published_set_is_copied_into_a_fresh_cache_instead_of_regenerated(cache, teacher, tmp_path, monkeypatch):
    """A fresh clone trains on the set the repository publishes: the same documents, no teacher loaded, and
    the cost stated is the one paid when it was written; samples beyond it are generated as usual."""
    from mha2mla_exp.data import teacher as teacher_mod

    model, tokenizer = teacher
    cfg = teacher_cfg()
    written = list(teacher_documents(cfg, tokenizer, model=model))
    cost = generation_cost(cfg)
    root = teacher_mod.publish_shards(cfg, tmp_path / "published")
    assert sorted(p.name for p in root.glob("shard-*")) == sorted(f"{name}.gz" for name in shards(cfg))

    monkeypatch.setattr(teacher_mod, "PUBLISHED_DIR", tmp_path / "published")
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setattr(
        "mha2mla_exp.models.load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the teacher was loaded"))
    )
    assert list(teacher_documents(cfg, tokenizer)) == written
    again = generation_cost(cfg)
    assert (again["tokens"], again["cpu_s"], again["wall_s"]) == (cost["tokens"], cost["cpu_s"], cost["wall_s"])

    more = teacher_cfg(count=10)  # one shard more than was published: generated, the rest copied
    docs = list(teacher_documents(more, tokenizer, model=model))
    assert docs[:6] == written and len(docs) == 10


def test_publishing_an_incomplete_set_is_refused(cache, teacher, tmp_path):
    from mha2mla_exp.data import teacher as teacher_mod

    model, tokenizer = teacher
    list(teacher_documents(teacher_cfg(), tokenizer, model=model))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        teacher_mod.publish_shards(teacher_cfg(count=10), tmp_path / "published")
