"""Where documents come from: the offline text assets, local .txt/.jsonl files, or a streamed hub mixture.

A data config (conf/data/*.yaml) names the source:
    source: asset   id: <text asset name>            one document per file of the asset
    source: local   paths: <folder | glob | file>...  .txt = one document per file,
                                                      .jsonl(.gz) = one per line (field `text_field`)
    source: hub     mixture: [{path, config, split, weight, text_field | blob_field}, ...]
                    weights are TOKEN shares (stream.StreamMixture turns them into document probabilities);
                    missing_parts: refuse | renormalise   a part this machine cannot read (python-edu
                    without AWS access) refuses the config, or is dropped and the others renormalised
    source: teacher teacher: <model config>  generation: {...}   text the model writes itself (teacher.py)
An asset or local source yields plain strings in a fixed order (iter_documents); a hub mixture's parts are
streamed here (part_stream, hub_mixture) and interleaved by stream.py; a teacher's samples are token ids already.
Splitting and tokenizing happen in prepare.py (documents begin with BOS where the tokenizer adds it: tokens.py).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import math
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..schema.sections import DataConfig

LOCAL_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


def check_data_config(data: DataConfig, *, missing_access: list[str] | None = None) -> None:
    """Raise ValueError naming the field unless `data` can be read; reads no documents. Types and ranges are the
    schema's (schema/sections.DataConfig); this checks what the source needs: its asset, files, teacher or parts.

    What this machine lacks to read a valid config (python-edu's boto3 and AWS credentials) raises too, unless
    `missing_access` is a list: then it is appended there (a dry run plans for the cluster that has them)."""
    if data.source == "asset":
        from ..assets import get_asset

        try:
            get_asset(data.id, kind="text")
        except ValueError as e:
            extra = " (never train on evaluation data)" if data.id in _eval_assets() else ""
            raise ValueError(f"data.id: {e}{extra}") from None
    elif data.source == "local":
        local_files(data.paths)  # raises when nothing matches
    elif data.source == "teacher":
        from .teacher import check_teacher_config

        check_teacher_config(data)
    else:
        check_mixture(data.mixture, missing_access=missing_access, renormalise=data.missing_parts == "renormalise")
        for key in ("max_tokens", "max_documents"):
            if getattr(data, key) is not None:
                raise ValueError(
                    f"data.{key}: a hub source is streamed, never cut: the fine-tune budget decides how much "
                    "is read (fresh tokens, no repetition); remove it"
                )
        if data.held_out_documents is None:
            raise ValueError("data.held_out_documents: a streamed source holds out its first N documents; set N")


def _eval_assets() -> set[str]:
    from ..assets import ASSETS

    return {a.name for a in ASSETS.values() if a.kind == "eval"}


def check_mixture(mixture: Any, *, missing_access: list[str] | None = None, renormalise: bool = False) -> None:
    """The parts' fields and weights; a part this machine cannot read is refused, unless `renormalise` (it is
    dropped when the stream opens) or `missing_access` is a list (a dry run: appended there)."""
    if not isinstance(mixture, list) or not mixture:
        raise ValueError(f"data.mixture: a hub source needs a non-empty list of parts, got {mixture!r}")
    for i, part in enumerate(mixture):
        where = f"data.mixture[{i}]"
        if not isinstance(part, Mapping) or not isinstance(part.get("path"), str) or not part["path"]:
            raise ValueError(f"{where}.path: each part needs a hub dataset path, got {part!r}")
        weight = part.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"{where}.weight: expected a positive number, got {weight!r}")
        if bool(part.get("text_field")) == bool(part.get("blob_field")):
            raise ValueError(f"{where}: give exactly one of text_field (the text column) or blob_field")
        if part["path"] in PACKAGED_BUILDERS:
            _check_data_files(part.get("data_files"), where)
        access = part_access_error(part, where)
        if access is not None and not renormalise:
            if missing_access is None:
                raise ValueError(access)
            missing_access.append(access)
    total = sum(p["weight"] for p in mixture)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ValueError(f"data.mixture: the weights sum to {total:g}, not 1")
    if renormalise and not available_parts(mixture, renormalise=True)[0]:
        raise ValueError(
            "data.missing_parts: renormalise drops every part of data.mixture: this machine can read none of them"
        )


def part_access_error(part: dict, where: str) -> str | None:
    """Why this machine cannot read `part` (python-edu's S3 access), or None."""
    if not part.get("blob_field"):
        return None
    try:
        check_software_heritage_access(where)
    except ValueError as err:
        return str(err)
    return None


def available_parts(mixture: list[dict], *, renormalise: bool) -> tuple[list[tuple[dict, float]], list[dict]]:
    """(part, token share) for the parts read, and the parts dropped with why. With `renormalise`
    (`missing_parts: renormalise`) a part this machine cannot read is dropped and the others' weights renormalised
    to sum to 1; without, every part is kept: validation refuses what cannot be read, a dry run plans for the
    cluster."""
    kept, dropped = [], []
    for i, part in enumerate(mixture):
        access = part_access_error(part, f"data.mixture[{i}]") if renormalise else None
        if access is None:
            kept.append(part)
        else:
            dropped.append({"name": part_name(part), "weight": part["weight"], "reason": access})
    total = sum(p["weight"] for p in kept)
    return [(p, p["weight"] / total) for p in kept if total > 0], dropped


def mixture_parts(data: DataConfig) -> tuple[list[tuple[dict, float]], list[dict]]:
    """`available_parts` of a hub source as `data.missing_parts` reads it."""
    return available_parts(data.mixture, renormalise=data.missing_parts == "renormalise")


def mixture_token_shares(data: DataConfig) -> list[tuple[str, float]]:
    """(part name, token share) of a hub mixture as it will be read, after any renormalisation."""
    return [(part_name(part), share) for part, share in mixture_parts(data)[0]]


# `datasets` builders that read local (or URL) files named by data_files instead of a hub repository
PACKAGED_BUILDERS = ("json", "text", "csv", "parquet", "arrow")


def _check_data_files(data_files: Any, where: str) -> None:
    files = [data_files] if isinstance(data_files, str) else data_files
    if not files or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{where}.data_files: a packaged builder needs a file or a list of files, got {data_files!r}")
    for f in files:
        if "://" not in f and not glob.glob(str(Path(f).expanduser())):
            raise ValueError(f"{where}.data_files: {f!r} matches no file")


def check_software_heritage_access(where: str) -> None:
    """python-edu stores blob ids; its text needs boto3 and AWS credentials: check both before any download."""
    try:
        import boto3
    except ImportError:
        raise ValueError(
            f"{where}.blob_field: this part stores Software Heritage blob ids, not text; reading it needs "
            "`pip install boto3` and AWS credentials allowed to read s3://softwareheritage (see the "
            "HuggingFaceTB/smollm-corpus card), or set data.missing_parts=renormalise to drop it"
        ) from None
    if boto3.Session().get_credentials() is None:
        raise ValueError(
            f"{where}.blob_field: boto3 finds no AWS credentials (env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "~/.aws/credentials or an instance role); python-edu's text lives in s3://softwareheritage "
            "(or set data.missing_parts=renormalise to drop it)"
        )


def probe_hub_datasets(mixture: list[dict]) -> list[str]:
    """Check that every hub part exists, when the hub is reachable; ValueError naming the part if not.

    Returns notes for what could not be checked (offline), so the runner can say so before heavy work.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    from ..models import hub_offline

    notes = []
    for i, part in enumerate(mixture):
        if part["path"] in PACKAGED_BUILDERS:
            continue
        if hub_offline():
            notes.append(
                f"data.mixture[{i}].path {part['path']!r}: not checked (HF_HUB_OFFLINE); unknown until the stream opens"
            )
            continue
        try:
            HfApi().dataset_info(part["path"], revision=part.get("revision"), timeout=10)
        except RepositoryNotFoundError:
            raise ValueError(
                f"data.mixture[{i}].path: no dataset {part['path']!r} on the hub "
                "(or it is private and you are not logged in)"
            ) from None
        except Exception as err:  # unreachable hub: say so, let the stream decide
            notes.append(
                f"data.mixture[{i}].path {part['path']!r}: not checked (hub unreachable: "
                f"{type(err).__name__}); unknown until the stream opens"
            )
    return notes


def local_files(paths: Any) -> list[Path]:
    """The files named by `paths` (folders are searched recursively), sorted and de-duplicated."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("data.paths: source 'local' needs a folder, glob or file (or a list of them)")
    found: set[Path] = set()
    for entry in paths:
        entry = str(Path(str(entry)).expanduser())
        if glob.has_magic(entry):
            matches = [Path(p) for p in glob.glob(entry, recursive=True)]
        elif Path(entry).is_dir():
            matches = [p for p in Path(entry).rglob("*")]
        elif Path(entry).is_file():
            matches = [Path(entry)]
        else:
            raise ValueError(f"data.paths: {entry!r} does not exist")
        matches = [p.resolve() for p in matches if p.is_file() and p.name.endswith(LOCAL_SUFFIXES)]
        if not matches:
            raise ValueError(f"data.paths: {entry!r} holds no {', '.join(LOCAL_SUFFIXES)} files")
        found.update(matches)
    return sorted(found)


def read_local(files: list[Path], text_field: str = "text") -> Iterator[str]:
    for path in files:
        if path.name.endswith(".txt"):
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{line_no}: not a JSON line ({e})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}:{line_no}: no string field {text_field!r} (data.text_field); has {keys}")
                yield record[text_field]


def corpus_fingerprint(data: DataConfig) -> dict:
    """What identifies the documents a config reads (part of the token cache key)."""
    source = data.source
    limits = {"max_documents": data.max_documents, "max_tokens": data.max_tokens}
    if source == "asset":
        from ..assets import get_asset

        asset = get_asset(data.id, kind="text")
        return {"source": source, "asset": asset.requirement, "sha256": asset.sha256} | limits
    if source == "local":
        files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in local_files(data.paths)]
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        return {"source": source, "files": digest, "text_field": data.text_field} | limits
    if source == "teacher":
        from dataclasses import asdict

        from .teacher import teacher_fingerprint, teacher_model

        return {
            "source": source,
            "teacher": teacher_fingerprint(teacher_model(data)),
            "generation": asdict(data.generation),
        } | limits
    return {"source": source, "mixture": data.mixture, "mixture_seed": data.mixture_seed} | limits


def iter_documents(data: DataConfig) -> Iterator[str]:
    """The documents of an asset or local `data` source, in a fixed order (limits are applied by the caller); a
    teacher source's are token ids (prepare.document_tokens reads them), a hub mixture's are streamed (stream.py)."""
    if data.source == "teacher":
        raise ValueError(
            "data.source: a teacher source's documents are token ids; read them with "
            "mha2mla_exp.data.prepare.document_tokens"
        )
    if data.source == "asset":
        from ..assets import asset_documents

        for path in asset_documents(data.id):
            yield path.read_text(encoding="utf-8", errors="replace")
    elif data.source == "local":
        yield from read_local(local_files(data.paths), data.text_field)
    else:  # its weights are token shares: only the tokenizer turns them into the documents to read
        raise ValueError(
            "data.source: a hub mixture is read by mha2mla_exp.data.stream (StreamMixture), whose "
            "document probabilities come from the tokenizer; use prepare_data"
        )


def hub_mixture(mixture: list[dict], seed: int = 0, probabilities: list[float] | None = None):
    """The parts streamed from the hub and interleaved per DOCUMENT with `probabilities` (default: the weights),
    seeded; stream.StreamMixture gives the probabilities that make the weights token shares."""
    import datasets

    streams = [part_stream(part) for part in mixture]
    if len(streams) == 1:
        return streams[0]
    return datasets.interleave_datasets(
        streams,
        probabilities=probabilities or [p["weight"] for p in mixture],
        seed=seed,
        stopping_strategy="first_exhausted",
    )


def part_stream(part: dict):
    """One part's streamed documents as {text, source}; python-edu's blobs are fetched in batches, concurrently."""
    import datasets

    extra = {"data_files": part["data_files"]} if part.get("data_files") else {}
    ds = datasets.load_dataset(
        part["path"],
        part.get("config"),
        split=part.get("split", "train"),
        streaming=True,
        revision=part.get("revision"),
        **extra,
    )
    if part.get("blob_field"):
        ds = ds.map(_blob_fetcher(part), batched=True, batch_size=BLOB_BATCH)
    else:
        ds = ds.map(_text_getter(part))
    return ds.select_columns(["text", "source"])


def part_name(part: dict) -> str:
    return part.get("name") or "/".join(x for x in (part["path"], part.get("config")) if x)


def _text_getter(part: dict):
    name = part_name(part)
    field = part["text_field"]

    def to_text(example: dict) -> dict:
        if not isinstance(example.get(field), str):
            raise ValueError(f"hub part {name!r}: no string column {field!r} (text_field); has {sorted(example)}")
        return {"text": example[field], "source": name}

    return to_text


def _blob_fetcher(part: dict):
    name = part_name(part)
    blob = part["blob_field"]

    def to_texts(batch: dict) -> dict:
        if blob not in batch:
            raise ValueError(f"hub part {name!r}: no column {blob!r} (blob_field); has {sorted(batch)}")
        texts = fetch_blob_texts(batch[blob])
        return {"text": texts, "source": [name] * len(texts)}

    return to_texts


# python-edu: each document is one object in Software Heritage's bucket, so the reader fetches many at once
BLOB_BATCH = 128  # documents per batched map call
BLOB_WORKERS = 32  # fetches in flight
BLOB_ATTEMPTS = 6  # per blob, on transient errors (botocore retries inside each attempt too)
BLOB_BACKOFF_S = 1.0  # doubled after each failed attempt, at most 30 s
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
}
_TRANSIENT_BOTOCORE = {"HTTPClientError", "ResponseStreamingError", "IncompleteReadError"}  # connection, timeouts


def fetch_blob_texts(blob_ids: list[str]) -> list[str]:
    """The texts of `blob_ids`, in their order, fetched BLOB_WORKERS at a time; the first blob that fails for good
    raises, and the fetches not yet started are cancelled."""
    pool = ThreadPoolExecutor(max_workers=BLOB_WORKERS, thread_name_prefix="python-edu")
    try:
        return list(pool.map(software_heritage_text, blob_ids))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_S3 = None
_S3_LOCK = threading.Lock()


def _s3_client():
    """One client for every fetch thread (boto3 clients are thread-safe; sessions are not)."""
    global _S3
    with _S3_LOCK:
        if _S3 is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise RuntimeError(
                    "python-edu stores Software Heritage blob ids, not text: reading it needs `pip install boto3` "
                    "and AWS credentials allowed to read s3://softwareheritage (see the HuggingFaceTB/smollm-corpus "
                    "card), or set data.missing_parts=renormalise to drop it"
                ) from None
            _S3 = boto3.client(
                "s3", config=Config(retries={"max_attempts": 10, "mode": "adaptive"}, max_pool_connections=BLOB_WORKERS)
            )
    return _S3


def _transient(err: BaseException) -> bool:
    response = getattr(err, "response", None)
    if isinstance(response, dict):  # botocore's ClientError: retry throttling and server errors only
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return response.get("Error", {}).get("Code") in _TRANSIENT_S3_CODES or status >= 500 or status == 429
    if {c.__name__ for c in type(err).__mro__} & _TRANSIENT_BOTOCORE:
        return True
    return isinstance(err, (OSError, EOFError))  # sockets, timeouts, a body cut short (gzip: EOFError)


def software_heritage_text(blob_id: str) -> str:
    """python-edu ships blob ids only; its files live gzipped in Software Heritage's S3 bucket. A transient error
    is retried with backoff (the body's read too, which botocore's own retries do not cover)."""
    client = _s3_client()
    for attempt in range(1, BLOB_ATTEMPTS + 1):
        try:
            obj = client.get_object(Bucket="softwareheritage", Key=f"content/{blob_id}")
            with gzip.GzipFile(fileobj=obj["Body"]) as f:
                return f.read().decode("utf-8", errors="ignore")
        except Exception as err:
            if attempt == BLOB_ATTEMPTS or not _transient(err):
                raise RuntimeError(
                    f"python-edu: blob {blob_id!r} (s3://softwareheritage/content/{blob_id}) failed after {attempt} "
                    f"attempt(s): {type(err).__name__}: {err}"
                ) from err
            time.sleep(min(BLOB_BACKOFF_S * 2 ** (attempt - 1), 30.0))
    raise AssertionError("unreachable")
