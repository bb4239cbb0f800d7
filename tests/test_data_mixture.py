"""A streamed mixture (data.source: hub): token shares, python-edu's blob fetching, BOS, parts without access.

Local JSONL parts go through the `json` builder of `datasets`, the hub source's own code path."""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.data import prepare_data, sources
from mha2mla_exp.data.sources import check_data_config, mixture_token_shares, part_name
from mha2mla_exp.data.tokens import bos_prefix, tokenize_documents
from mha2mla_exp.models import byte_tokenizer
from mha2mla_exp.schema.sections import DataConfig


@pytest.fixture
def tok():
    return byte_tokenizer()


def bos_tokenizer():
    """The byte-level tokenizer with a BOS that its post-processor puts first, as Llama-2's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    eos, bos = "<|endoftext|>", "<s>"
    vocab = {eos: 0, bos: 1} | {ch: i + 2 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([eos, bos])
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=eos)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def section(cfg: dict) -> DataConfig:
    """A data config as the layer takes it: the schema's section, its types and ranges checked."""
    return typed_section(DataConfig, cfg, "data")


def stream_cfg(parts: list[dict], **extra) -> dict:
    return {
        "name": "toy-mixture",
        "source": "hub",
        "seq_len": 64,
        "held_out_documents": 20,
        "split_seed": 0,
        "separator": "eos",
        "mixture_seed": 0,
        "length_sample_documents": 200,
        "mixture": parts,
    } | extra


# each part is written in its own letter, so a row's tokens say which part they came from without the code's help
LETTERS = {"long": "l", "medium": "m", "short": "s"}
LENGTHS = {"long": (150, 250), "medium": (30, 70), "short": (5, 15)}  # characters = byte tokens


def lettered_parts(tmp_path, shares: dict[str, float], n: int = 6000) -> list[dict]:
    rng = random.Random(0)
    parts = []
    for name, share in shares.items():
        # numbered: no document repeats a held-out one (those are skipped); digits count with the letters before
        docs = [{"text": LETTERS[name] * rng.randint(*LENGTHS[name]) + f"{i:05d}"} for i in range(n)]
        parts.append(
            {
                "name": name,
                "path": "json",
                "data_files": write_jsonl(tmp_path / f"{name}.jsonl", docs),
                "weight": share,
                "text_field": "text",
            }
        )
    return parts


def tokens_per_part(rows: torch.Tensor, tok, separator: int) -> dict[str, int]:
    """Tokens per part in the rows, a separator (and a digit) counted with the document it ends (as the shares
    count it)."""
    part_of = {tok.convert_tokens_to_ids(letter): name for name, letter in LETTERS.items()}
    counts, last = {}, None
    for token in rows.reshape(-1).tolist():
        name = part_of.get(token, last) if token != separator else last
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
        last = name
    return counts


def test_the_rows_hold_each_part_in_its_token_share_whatever_its_document_length(tmp_path, tok):
    shares = {"long": 0.5, "medium": 0.3, "short": 0.2}  # documents ~200, ~50 and ~10 tokens long
    data = prepare_data(section(stream_cfg(lettered_parts(tmp_path, shares))), tok)
    stream = data.training_rows(64, seed=0)
    rows = torch.cat([stream.step_rows(step, 50) for step in range(60)])  # 192,000 tokens
    counts = tokens_per_part(rows, tok, tok.eos_token_id)
    total = sum(counts.values())
    for name, share in shares.items():  # per document, the long part would take ~85% of the tokens
        assert counts[name] / total == pytest.approx(share, abs=0.02), (name, counts)
    # the record's bookkeeping agrees with the count from the rows themselves
    assert stream.mixture_read()["tokens_read"] == counts
    mixture = data.stats["mixture"]
    assert mixture["token_shares"] == shares and mixture["dropped"] == []
    assert mixture["documents_measured"] == {"long": 200, "medium": 200, "short": 200}
    means = mixture["mean_document_tokens"]
    assert 195 < means["long"] < 216 and 50 < means["medium"] < 61 and 14 < means["short"] < 18  # + number, separator
    probabilities = mixture["document_probabilities"]
    assert sum(probabilities.values()) == pytest.approx(1.0)
    assert probabilities["short"] / probabilities["long"] == pytest.approx(
        (0.2 / means["short"]) / (0.5 / means["long"])
    )
    held_out = mixture["held_out"]["token_shares_read"]
    assert set(held_out) <= set(shares) and sum(held_out.values()) == pytest.approx(1.0)


def test_the_shares_read_resume_with_the_rows_and_only_under_the_same_mixture(tmp_path, tok):
    cfg = stream_cfg(lettered_parts(tmp_path, {"long": 0.6, "short": 0.4}, n=2000), shuffle_rows=16)
    data = prepare_data(section(cfg), tok)
    straight = data.training_rows(64, seed=1)
    reference = [straight.step_rows(step, 6) for step in range(10)]
    first = data.training_rows(64, seed=1)
    for step in range(5):  # stops inside a shuffle window
        first.step_rows(step, 6)
    resumed = data.training_rows(64, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for step in range(5, 10):
        assert torch.equal(resumed.step_rows(step, 6), reference[step])
    assert resumed.mixture_read() == straight.mixture_read()

    other = prepare_data(section(cfg | {"length_sample_documents": 50}), tok)  # another measurement, probabilities
    with pytest.raises(RuntimeError, match="not the one its checkpoint was read with"):
        other.training_rows(64, seed=1).load_state_dict(json.loads(json.dumps(first.state_dict())))


@pytest.mark.parametrize(
    "changes, message",
    [  # the schema's
        ({"length_sample_documents": 0}, "data.length_sample_documents: must be positive"),
        ({"length_sample_documents": 2.5}, "data.length_sample_documents"),
        ({"missing_parts": None}, "data.missing_parts"),
    ],
)
def test_mixture_settings_errors_name_the_field(tmp_path, changes, message):
    parts = lettered_parts(tmp_path, {"long": 1.0}, n=10)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_data_config(section(stream_cfg(parts, **changes)))


# ---------------------------------------------------------------------------------------- parts without access


def python_edu_mixture(tmp_path) -> list[dict]:
    parts = lettered_parts(tmp_path, {"long": 0.5, "short": 0.3}, n=300)
    blobs = write_jsonl(tmp_path / "blobs.jsonl", [{"blob_id": f"b{i}"} for i in range(300)])
    return parts + [{"name": "python-edu", "path": "json", "data_files": blobs, "weight": 0.2, "blob_field": "blob_id"}]


def no_aws(where):
    raise ValueError(f"{where}.blob_field: boto3 finds no AWS credentials")


def test_a_part_without_access_is_refused_unless_renormalise_says_drop_it(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(sources, "check_software_heritage_access", no_aws)
    cfg = stream_cfg(python_edu_mixture(tmp_path))
    with pytest.raises(ValueError, match=r"data\.mixture\[2\]\.blob_field: boto3 finds no AWS credentials"):
        check_data_config(section(cfg))
    blocked = []  # a dry run plans for the cluster: said, not fatal
    check_data_config(section(cfg), missing_access=blocked)
    assert len(blocked) == 1 and "data.mixture[2]" in blocked[0]
    assert mixture_token_shares(section(cfg)) == [("long", 0.5), ("short", 0.3), ("python-edu", 0.2)]
    with pytest.raises(ValueError, match=r"data\.missing_parts: .*expected one of refuse, renormalise, got 'drop'"):
        check_data_config(section(cfg | {"missing_parts": "drop"}))

    cfg = cfg | {"missing_parts": "renormalise"}
    blocked = []
    check_data_config(section(cfg), missing_access=blocked)
    assert blocked == []
    assert mixture_token_shares(section(cfg)) == [("long", pytest.approx(0.625)), ("short", pytest.approx(0.375))]
    data = prepare_data(section(cfg), tok)
    mixture = data.stats["mixture"]
    assert mixture["token_shares"] == {"long": pytest.approx(0.625), "short": pytest.approx(0.375)}
    [dropped] = mixture["dropped"]
    assert dropped["name"] == "python-edu" and dropped["weight"] == 0.2 and "no AWS credentials" in dropped["reason"]
    rows = data.training_rows(64, seed=0).step_rows(0, 8)
    assert set(tokens_per_part(rows, tok, tok.eos_token_id)) <= {"long", "short"}

    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)  # with access: all kept
    assert [name for name, _ in mixture_token_shares(section(cfg))] == ["long", "short", "python-edu"]


def test_renormalise_with_nothing_left_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "check_software_heritage_access", no_aws)
    blobs = write_jsonl(tmp_path / "blobs.jsonl", [{"blob_id": "b0"}])
    cfg = stream_cfg(
        [{"name": "python-edu", "path": "json", "data_files": blobs, "weight": 1.0, "blob_field": "blob_id"}],
        missing_parts="renormalise",
    )
    with pytest.raises(ValueError, match=r"data\.missing_parts: renormalise drops every part"):
        check_data_config(section(cfg))


def test_the_paper_mixture_opts_in_explicitly_and_its_text_variant_has_the_same_shares(monkeypatch):
    from omegaconf import OmegaConf

    from tests.test_data import CONF

    # the group file as a run composes it: onto the schema's DataConfig (the file holds only what differs from it)
    full = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(CONF / "data" / "smollm_corpus.yaml"))
    full = OmegaConf.to_container(full)
    text = OmegaConf.to_container(OmegaConf.load(CONF / "data" / "smollm_corpus_text.yaml"))
    assert full["missing_parts"] == "refuse"  # the paper's mixture; dropping a part is the user's choice
    monkeypatch.setattr(sources, "check_software_heritage_access", no_aws)
    dropped = mixture_token_shares(section(full | {"missing_parts": "renormalise"}))
    assert [name for name, _ in dropped] == [name for name, _ in mixture_token_shares(section(text))]
    for (_, a), (_, b) in zip(dropped, mixture_token_shares(section(text))):
        assert a == pytest.approx(b, abs=1e-5)


# ---------------------------------------------------------------------------------------- python-edu's blobs


class FakeS3:
    """get_object as botocore returns it; some blobs fail transiently first; counts the fetches in flight."""

    def __init__(self, texts: dict[str, str], transient_failures: dict[str, int] | None = None, error=None):
        self.texts, self.failures = texts, dict(transient_failures or {})
        self.error = error or (lambda blob: ConnectionResetError(f"connection reset fetching {blob}"))
        self.calls: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def get_object(self, Bucket, Key):
        assert Bucket == "softwareheritage" and Key.startswith("content/")
        blob = Key.removeprefix("content/")
        with self.lock:
            self.calls[blob] = self.calls.get(blob, 0) + 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.01)
            with self.lock:
                if self.failures.get(blob, 0) > 0:
                    self.failures[blob] -= 1
                    raise self.error(blob)
            return {"Body": io.BytesIO(gzip.compress(self.texts[blob].encode()))}
        finally:
            with self.lock:
                self.in_flight -= 1


class NoSuchKey(Exception):
    """Shaped like botocore's ClientError: a permanent error."""

    def __init__(self, blob):
        super().__init__(f"An error occurred (NoSuchKey) fetching {blob}")
        self.response = {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}


@pytest.fixture
def fake_s3(monkeypatch):
    monkeypatch.setattr(sources, "BLOB_BACKOFF_S", 0.0)

    def install(s3: FakeS3) -> FakeS3:
        monkeypatch.setattr(sources, "_S3", s3)
        return s3

    return install


def test_blobs_are_fetched_concurrently_in_order_and_transient_errors_are_retried(fake_s3):
    ids = [f"b{i}" for i in range(100)]
    s3 = fake_s3(FakeS3({b: f"print({i})" for i, b in enumerate(ids)}, transient_failures={"b3": 2, "b50": 5}))
    assert sources.fetch_blob_texts(ids) == [f"print({i})" for i in range(100)]
    assert s3.calls["b3"] == 3 and s3.calls["b50"] == 6 and s3.calls["b0"] == 1
    assert s3.most_in_flight > 4  # one thread would keep a single fetch in flight


def test_a_blob_that_keeps_failing_or_does_not_exist_is_named(fake_s3, monkeypatch):
    monkeypatch.setattr(sources, "BLOB_WORKERS", 2)
    ids = [f"b{i}" for i in range(200)]
    s3 = fake_s3(FakeS3({b: "x" for b in ids}, transient_failures={"b1": 99}))
    with pytest.raises(
        RuntimeError, match=r"python-edu: blob 'b1' .*failed after 6 attempt\(s\): ConnectionResetError"
    ):
        sources.fetch_blob_texts(ids)
    assert s3.calls["b1"] == sources.BLOB_ATTEMPTS
    assert len(s3.calls) < len(ids)  # the fetches not yet started when it failed were cancelled
    s3 = fake_s3(FakeS3({"b0": "x"}, transient_failures={"b0": 1}, error=NoSuchKey))
    with pytest.raises(RuntimeError, match=r"blob 'b0' \(s3://softwareheritage/content/b0\) failed after 1 attempt"):
        sources.fetch_blob_texts(["b0"])
    assert s3.calls["b0"] == 1  # a permanent error is not retried


def test_a_blob_part_streams_in_order_and_resumes_exactly(tmp_path, tok, fake_s3, monkeypatch):
    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)
    monkeypatch.setattr(sources, "BLOB_BATCH", 16)
    rng = random.Random(2)
    texts = {f"b{i}": f"def f{i}():\n    return {'x' * rng.randint(5, 60)}\n" for i in range(400)}
    s3 = fake_s3(FakeS3(texts, transient_failures={"b7": 1, "b123": 2}))
    blobs = write_jsonl(tmp_path / "blobs.jsonl", [{"blob_id": b} for b in texts])
    part = {"name": "python-edu", "path": "json", "data_files": blobs, "weight": 1.0, "blob_field": "blob_id"}
    assert [ex["text"] for ex in sources.hub_mixture([part])] == list(texts.values())
    assert s3.most_in_flight > 1

    data = prepare_data(section(stream_cfg([part], held_out_documents=5)), tok)
    straight = data.training_rows(64, seed=0)
    reference = [straight.step_rows(step, 4) for step in range(12)]
    first = data.training_rows(64, seed=0)
    for step in range(5):
        first.step_rows(step, 4)
    resumed = data.training_rows(64, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for step in range(5, 12):
        assert torch.equal(resumed.step_rows(step, 4), reference[step])


# ---------------------------------------------------------------------------------------- BOS


def test_documents_begin_with_bos_where_the_tokenizer_adds_it_as_lm_eval_scores(tmp_path, tok):
    llama_like = bos_tokenizer()
    bos, eos = llama_like.bos_token_id, llama_like.eos_token_id
    assert bos_prefix(llama_like) == [bos] and bos_prefix(tok) == []
    text = "the union is strong"
    # lm-eval's HFLM encodes with the tokenizer's default special tokens: the same ids as training's
    assert tokenize_documents(llama_like, [text]) == [llama_like(text)["input_ids"]]
    assert tokenize_documents(tok, [text]) == [tok(text)["input_ids"]]

    docs = [f"doc {i}: " + "word " * (i % 7 + 3) for i in range(120)]
    streamed = stream_cfg(
        [
            {
                "name": "toy",
                "path": "json",
                "weight": 1.0,
                "text_field": "text",
                "data_files": write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs]),
            }
        ],
        seq_len=16,
        held_out_documents=10,
    )
    local = {
        "name": "toy-local",
        "source": "local",
        "paths": str(tmp_path / "docs.jsonl"),
        "seq_len": 16,
        "held_out_fraction": 0.2,
        "split_seed": 0,
    }
    for cfg in (streamed, local):
        data = prepare_data(section(cfg), llama_like, cache=False)
        held_out = torch.cat([data.held_out.reshape(-1), data.held_out_tail]).tolist()
        training = (data.training_rows(16, seed=0).step_rows(0, 20) if cfg is streamed else data.train).reshape(-1)
        for stream in (held_out, training.tolist()):
            starts = [stream[i + 1] for i, t in enumerate(stream[:-1]) if t == eos]  # the token after a separator
            assert starts and all(t == bos for t in starts), cfg["source"]
        assert held_out[0] == bos
        assert tokenizer_bos_count(held_out, bos) == int(data.held_out_doc_lengths.numel())  # one per document
    byte_rows = prepare_data(section(local), tok, cache=False).train.reshape(-1).tolist()
    assert tok.bos_token_id == eos and byte_rows.count(eos) > 0  # its BOS is its EOS: only separators, no prefix
    assert not any(a == eos and b == eos for a, b in zip(byte_rows, byte_rows[1:]))


def tokenizer_bos_count(stream: list[int], bos: int) -> int:
    return sum(1 for t in stream if t == bos)


def test_a_token_cache_written_without_bos_is_never_read_for_a_tokenizer_that_adds_it(tmp_path, tok, monkeypatch):
    from mha2mla_exp.assets.fetch import CACHE_ENV
    from mha2mla_exp.data import prepare

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i}"} for i in range(40)])
    cfg = {
        "name": "toy-local",
        "source": "local",
        "paths": docs,
        "seq_len": 8,
        "held_out_fraction": 0.2,
        "split_seed": 0,
    }
    llama_like = bos_tokenizer()
    with monkeypatch.context() as old_code:  # documents without BOS, as before: the same tokenizer fingerprint
        old_code.setattr(prepare, "bos_prefix", lambda tokenizer: [])
        _, without_bos, _ = prepare.load_or_tokenize(section(cfg), llama_like, llama_like.eos_token_id)
    tensors, with_bos, hit = prepare.load_or_tokenize(section(cfg), llama_like, llama_like.eos_token_id)
    assert with_bos != without_bos and not hit and tensors["train"][0] == llama_like.bos_token_id
    # a tokenizer that adds no BOS keeps the key it always had
    with monkeypatch.context() as old_code:
        old_code.setattr(prepare, "bos_prefix", lambda tokenizer: [])
        _, before, _ = prepare.load_or_tokenize(section(cfg), tok, tok.eos_token_id)
    assert prepare.load_or_tokenize(section(cfg), tok, tok.eos_token_id)[1:] == (before, True)


def test_the_length_measurement_is_read_once_and_kept_for_the_other_processes(tmp_path, tok, monkeypatch):
    """Every process (and every relaunch) re-read each part's first documents to measure them, python-edu's from S3;
    the main process prepares the data first, so the others now read its measurement from the cache."""
    from mha2mla_exp.assets.fetch import CACHE_ENV
    from mha2mla_exp.data import stream

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    opened = []
    real = stream.part_stream
    monkeypatch.setattr(stream, "part_stream", lambda part: opened.append(part_name(part)) or real(part))
    parts = lettered_parts(tmp_path, {"long": 0.5, "short": 0.5}, n=600)
    first = prepare_data(section(stream_cfg(parts)), tok).stats["mixture"]
    assert sorted(opened) == ["long", "short"]
    opened.clear()
    again = prepare_data(section(stream_cfg(parts)), tok).stats["mixture"]
    assert opened == [] and again["mean_document_tokens"] == first["mean_document_tokens"]
    write_jsonl(Path(parts[0]["data_files"]), [{"text": f"l{i:05d}"} for i in range(600)])  # rewritten in place
    assert prepare_data(section(stream_cfg(parts)), tok).stats["mixture"]["mean_document_tokens"]["long"] < 10
    assert "long" in opened  # measured anew
