"""Text written by the original model itself, as recovery data (LLM-QAT, arXiv 2305.17888, section 2.1).

The converted model forgets what the original knew when it is fine-tuned on a corpus far from the one the
original was trained on (here: State of the Union speeches). LLM-QAT's answer, which needs no pretraining
data: let the original model write the training text. Each sample starts from one token (uniform over the
vocabulary's ordinary tokens, or drawn from a list of words), continues with a few greedy tokens (so the
start settles into something the model finds likely), then samples to full length; a sample that emits EOS
ends there. The samples are the documents of a data source like any other (`source: teacher`,
conf/data/teacher_samples.yaml): split by document, packed, cached, budgeted.

Generation is batched with the KV cache (transformers' Cache API), seeded per shard (a shard is one batch:
its tokens are a pure function of (generation config, shard index)), written shard by shard atomically,
and resumed shard by shard: an interrupted generation loses at most one batch, and asking for more samples
later generates only the missing shards. The shards live under <cache>/teacher/<teacher>-<key>/, key = the
teacher's identity and every generation setting but the count; `generation.json` there states what each
shard cost in CPU-seconds (process time, all threads) and wall seconds, on which machine.

A set can be published with the repository (results/teacher_samples/shards/<teacher>-<key>/, the same
folder name, so the same key; each shard gzipped, `.safetensors.gz`): a missing shard is then unpacked from there
instead of generated, and its manifest entry (what writing it cost, where) comes with it. A fresh clone thus trains
on the committed set without paying for generation again; the cost stays stated once, as the record's
data.generation.

`python -m mha2mla_exp.data.teacher [overrides]` generates the set a data config names and publishes a small
readable sample (results/teacher_samples/).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import atomic
from ..schema.sections import DataConfig, GenerationConfig, ModelConfig

log = logging.getLogger(__name__)

PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "results" / "teacher_samples" / "shards"
PUBLISHED_SUFFIX = ".gz"  # published shards are gzipped (a third of the size in the tree); the cache keeps them plain
FORMAT = 1
_PAD = -1  # after a sample's EOS


def shard_count(gen: GenerationConfig) -> int:
    """Shards of the set: one batch of `batch_size` samples each."""
    return -(-gen.count // gen.batch_size)


def key_material(gen: GenerationConfig) -> dict:
    """What the shards' tokens depend on: every generation setting but the count (more samples extend a set)."""
    return {k: v for k, v in asdict(gen).items() if k != "count"}


def teacher_model(data: DataConfig) -> ModelConfig:
    """`data.teacher` as a model section. The schema types it Any (`${model}` is interpolated after composition),
    so a composed config gives a ModelConfig and a recorded config.yaml a mapping, typed here."""
    if isinstance(data.teacher, ModelConfig):
        return data.teacher
    if not isinstance(data.teacher, Mapping):
        raise ValueError(
            f"data.teacher: a teacher source names the model that writes it (a model config; "
            f"conf/data/teacher_samples.yaml uses the run's own, ${{model}}), got {data.teacher!r}"
        )
    from ..confutil import typed_section

    return typed_section(ModelConfig, data.teacher, "data.teacher")


def check_teacher_config(data: DataConfig) -> GenerationConfig:
    """The checks of a `source: teacher` data section that need no weights and that the schema's types and ranges
    leave: the teacher's model (data.teacher, by default the run's model) and the generation block's settings that
    go together."""
    from ..models import check_model_config

    try:
        check_model_config(teacher_model(data))
    except ValueError as err:
        raise ValueError(f"data.teacher: {err}" if not str(err).startswith("data.teacher") else str(err)) from None
    gen = data.generation
    if gen is None:
        raise ValueError("data.generation: a teacher source needs its generation settings")
    if gen.length < 2:
        raise ValueError(f"data.generation.length: a sample needs at least 2 tokens, got {gen.length}")
    if gen.first_token == "list" and not gen.first_words:
        raise ValueError("data.generation.first_words: first_token='list' needs a non-empty list of words")
    return gen


def teacher_fingerprint(teacher: ModelConfig) -> dict:
    """What identifies the model that writes: its source and id (an asset by its pinned wheel and sha256)."""
    fp = {"source": teacher.source, "id": teacher.id, "revision": teacher.revision}
    if teacher.source == "asset":
        from ..assets import get_asset

        asset = get_asset(teacher.id, kind="model")
        fp |= {"asset": asset.requirement, "sha256": asset.sha256}
    elif teacher.source == "random":
        fp |= {
            "shape": asdict(teacher.shape),
            "vocab_size": teacher.vocab_size,
            "intermediate_size": teacher.intermediate_size,
            "seed": teacher.seed,
        }
    return fp


def shard_dir(data: DataConfig) -> Path:
    """The cache folder of the set `data` (a teacher source) names: the teacher and every setting but the count."""
    from ..assets import cache_dir

    teacher = teacher_model(data)
    material = {"format": FORMAT, "teacher": teacher_fingerprint(teacher), "generation": key_material(data.generation)}
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    name = str(teacher.name or teacher.id or "teacher").replace("/", "_")
    return cache_dir() / "teacher" / f"{name}-{key}"


def first_token_ids(gen: GenerationConfig, tokenizer, n: int, generator: torch.Generator) -> torch.Tensor:
    """`n` first tokens: uniform over the vocabulary without special tokens, or the first token of a
    uniformly drawn word of `first_words` (each word tokenized with a leading space where it has none)."""
    if gen.first_token == "list":
        starts = [
            tokenizer(w if w.startswith(" ") else " " + w, add_special_tokens=False)["input_ids"][:1]
            for w in gen.first_words
        ]
        if any(not s for s in starts):
            raise ValueError("data.generation.first_words: a word tokenizes to nothing")
        choices = torch.tensor([s[0] for s in starts])
        return choices[torch.randint(len(choices), (n,), generator=generator)]
    special = set(tokenizer.all_special_ids)
    choices = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    return choices[torch.randint(len(choices), (n,), generator=generator)]


def eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


@torch.no_grad()
def generate_batch(
    model, first: torch.Tensor, gen: GenerationConfig, generator: torch.Generator, eos: list[int]
) -> torch.Tensor:
    """[B, length] token ids from first tokens `first` [B]: greedy for `greedy_tokens`, then sampled at
    `temperature` (top-k when set); positions after a sample's EOS hold -1. One prefill token, then one
    cached forward per position (transformers' DynamicCache)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    batch = first.shape[0]
    out = torch.full((batch, gen.length), _PAD, dtype=torch.long)
    out[:, 0] = first
    done = torch.isin(first, torch.tensor(eos, dtype=torch.long))
    cache = DynamicCache(config=model.config)
    step_input = first[:, None].to(device)
    for t in range(1, gen.length):
        logits = model(input_ids=step_input, cache=cache, use_cache=True).logits[:, -1].float().cpu()
        if t <= gen.greedy_tokens:
            nxt = logits.argmax(-1)
        else:
            logits = logits / gen.temperature
            if gen.top_k and gen.top_k < logits.shape[-1]:  # 0: off
                kth = logits.topk(gen.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
        out[:, t] = torch.where(done, torch.full_like(nxt, _PAD), nxt)
        done |= torch.isin(nxt, torch.tensor(eos, dtype=torch.long))
        if bool(done.all()):
            break
        step_input = nxt[:, None].to(device)
    return out


def shard_seed(gen: GenerationConfig, shard: int) -> int:
    """A shard's generator seed: a pure function of (seed, shard), so shards can be made in any order."""
    digest = hashlib.sha256(f"{gen.seed}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def generate_shards(data: DataConfig, tokenizer, *, model=None, progress: bool = True) -> Path:
    """Make every missing shard of the set `data` (a `source: teacher` data section) names; returns the folder.

    The teacher is loaded only when a shard is missing (`model` overrides loading it)."""
    gen = check_teacher_config(data)
    folder = shard_dir(data)
    folder.mkdir(parents=True, exist_ok=True)
    missing = [s for s in range(shard_count(gen)) if not (folder / _shard_name(s)).is_file()]
    if not missing:
        return folder
    from filelock import FileLock

    with FileLock(str(folder / ".lock")):  # one writer per set, even across runs of a parallel sweep
        _copy_published(folder, gen)
        missing = [s for s in range(shard_count(gen)) if not (folder / _shard_name(s)).is_file()]
        if not missing:
            return folder
        if model is None:
            from ..models import load_model

            model, _ = load_model(teacher_model(data), dtype=gen.dtype)
        else:
            model = model.to(getattr(torch, gen.dtype))
        _check_same_tokenizer(model, tokenizer)
        model.eval()
        device = next(model.parameters()).device
        eos = eos_ids(model, tokenizer)
        manifest = _read_manifest(folder) or {
            "format": FORMAT,
            "teacher": teacher_fingerprint(teacher_model(data)),
            "generation": key_material(gen),
            "shards": {},
        }
        bar = _progress(
            len(missing) * gen.batch_size * gen.length,
            progress,
            f"teacher samples ({len(missing)} of {shard_count(gen)} batches to write)",
        )
        for shard in missing:
            cpu, wall = time.process_time(), time.perf_counter()
            generator = torch.Generator().manual_seed(shard_seed(gen, shard))
            first = first_token_ids(gen, tokenizer, gen.batch_size, generator)
            ids = generate_batch(model, first, gen, generator, eos)
            with atomic.atomic_path(folder / _shard_name(shard)) as tmp:
                save_file({"ids": ids.int()}, str(tmp))
            tokens = int((ids != _PAD).sum())
            manifest["shards"][str(shard)] = {
                "tokens": tokens,
                "cpu_s": round(time.process_time() - cpu, 2),
                "wall_s": round(time.perf_counter() - wall, 2),
                "machine": _machine(device),
                "torch_threads": torch.get_num_threads(),
            }
            _write_manifest(folder, manifest)
            bar.update(gen.batch_size * gen.length)
        bar.close()
    return folder


def _copy_published(folder: Path, gen: GenerationConfig, published_root: Path | None = None) -> None:
    """Copy into the cache the shards of this set that the repository publishes (same key), with their cost."""
    source = (published_root or PUBLISHED_DIR) / folder.name
    published = _read_manifest(source)
    if published is None:
        return
    manifest = _read_manifest(folder) or {k: published[k] for k in ("format", "teacher", "generation")} | {"shards": {}}
    for shard in range(shard_count(gen)):
        name = _shard_name(shard)
        packed = source / (name + PUBLISHED_SUFFIX)
        if (folder / name).is_file() or not packed.is_file():
            continue
        with atomic.atomic_path(folder / name) as tmp, gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        manifest["shards"][str(shard)] = published["shards"][str(shard)] | {"copied_from": "published"}
    _write_manifest(folder, manifest)


def publish_shards(data: DataConfig, published_root: Path | None = None) -> Path:
    """Copy the set's first `count` samples' shards and their manifest from the cache into the repository's
    published folder (generating what is missing first is the caller's job); returns that folder."""
    gen = data.generation
    folder = shard_dir(data)
    dest = (published_root or PUBLISHED_DIR) / folder.name
    dest.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(folder)
    names = [_shard_name(s) for s in range(shard_count(gen))]
    if manifest is None or any(not (folder / n).is_file() for n in names):
        raise FileNotFoundError(f"teacher set {folder} is incomplete: generate it before publishing")
    for name in names:
        packed = (folder / name).read_bytes()
        # mtime 0: the same shard packs to the same bytes, so a republished set changes no committed file
        atomic.write_bytes(dest / (name + PUBLISHED_SUFFIX), gzip.compress(packed, compresslevel=9, mtime=0))
    kept = {str(s): manifest["shards"][str(s)] for s in range(shard_count(gen))}
    _write_manifest(dest, {k: manifest[k] for k in ("format", "teacher", "generation")} | {"shards": kept})
    return dest


def teacher_documents(data: DataConfig, tokenizer, *, model=None) -> Iterator[list[int]]:
    """The first `count` samples of the set, in shard order, as token-id lists (EOS and what follows cut),
    generating the shards that are missing first."""
    gen = data.generation
    folder = generate_shards(data, tokenizer, model=model)
    left = gen.count
    for shard in range(shard_count(gen)):
        ids = load_file(folder / _shard_name(shard))["ids"].long()
        for row in ids[:left]:
            yield row[row != _PAD].tolist()
        left -= len(ids)


def generation_cost(data: DataConfig) -> dict:
    """What the first `count` samples cost to write (from the manifest): tokens, CPU-seconds, wall seconds."""
    gen = data.generation
    shards = (_read_manifest(shard_dir(data)) or {}).get("shards", {})
    used = [shards.get(str(s)) for s in range(shard_count(gen))]
    known = [s for s in used if s]
    return {
        "shards": shard_count(gen),
        "shards_with_cost": len(known),
        "tokens": sum(s["tokens"] for s in known),
        "cpu_s": round(sum(s["cpu_s"] for s in known), 1),
        "wall_s": round(sum(s["wall_s"] for s in known), 1),
        "machines": sorted({s["machine"] for s in known}),
    }


def _check_same_tokenizer(model, tokenizer) -> None:
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(
            f"data.teacher: the teacher's vocabulary ({vocab}) is smaller than the run's tokenizer "
            f"({len(tokenizer)}); a teacher must share the student's tokenizer"
        )


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _read_manifest(folder: Path) -> dict | None:
    path = folder / "generation.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _write_manifest(folder: Path, manifest: dict) -> None:
    atomic.write_text(folder / "generation.json", json.dumps(manifest, indent=1, sort_keys=True))


def _machine(device: torch.device) -> str:
    from ..machine import machine_info

    return machine_info(device)["name"]


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="tok", unit_scale=True)
