"""Turn a GGUF model asset into a plain safetensors Hugging Face folder, once.

Reading GGUF dequantises every tensor on each load (~25 s on 2 cores) and needs the `gguf`
reader; a GGUF-loaded model also refuses `save_pretrained`. So the dequantised fp32 weights are
copied into a fresh model built from the same config (minus its quantization_config), saved with
the tokenizer, reloaded and checked against the GGUF model before the folder is published.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ..atomic import atomic_folder
from .fetch import PROVENANCE, AssetError, _provenance_ok, asset_lock, cache_dir, fetch_asset, sha256_of
from .registry import Asset, get_asset

log = logging.getLogger(__name__)

CHECK_TEXT = "The State of the Union is strong, and the Congress has before it the business of the nation."


def model_dir(name: str) -> Path:
    """A Hugging Face folder (config.json, model.safetensors, tokenizer) for model asset `name`."""
    asset = get_asset(name, kind="model")
    final = cache_dir() / "models" / asset.slug
    if _provenance_ok(final, asset):
        return final
    root = fetch_asset(name)
    with asset_lock(asset, "model"):
        if _provenance_ok(final, asset):
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        joined = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.gguf-"))
        try:
            with atomic_folder(final) as tmp:  # a stale folder (provenance mismatch) is replaced
                gguf = gguf_file(asset, root, joined)
                log.info("converting %s to a safetensors folder at %s (once)", gguf.name, final)
                gguf_to_hf_folder(gguf, tmp)
                meta = {
                    "name": asset.name,
                    "requirement": asset.requirement,
                    "sha256": asset.sha256,
                    "converted_from": asset.gguf,
                    "license": asset.license,
                    "note": "GGUF tensors dequantised to float32 by transformers; not the original bf16 weights",
                }
                (tmp / PROVENANCE).write_text(json.dumps(meta, indent=1) + "\n")
        finally:
            shutil.rmtree(joined, ignore_errors=True)
    return final


def gguf_file(asset: Asset, root: Path, scratch: Path) -> Path:
    """The asset's GGUF: the file in the extracted wheel, or its chunks joined in order into `scratch` and checked
    against the pinned sha256 of the whole (a chunk missing or out of order cannot pass)."""
    if not asset.gguf_parts:
        gguf = root / asset.gguf
        if not gguf.is_file():
            raise AssetError(f"asset {asset.name!r}: {asset.gguf} is missing from the extracted wheel at {root}")
        return gguf
    joined = scratch / asset.gguf
    with open(joined, "wb") as out:
        for part in asset.gguf_parts:
            if not (root / part).is_file():
                raise AssetError(f"asset {asset.name!r}: chunk {part} is missing from the extracted wheels at {root}")
            with open(root / part, "rb") as chunk:
                shutil.copyfileobj(chunk, out, 1 << 24)
    got = sha256_of(joined)
    if got != asset.gguf_sha256:
        raise AssetError(
            f"asset {asset.name!r}: the joined GGUF has sha256 {got}, but {asset.gguf_sha256} is pinned "
            f"(chunks {', '.join(asset.gguf_parts)})"
        )
    return joined


def gguf_to_hf_folder(gguf: Path, out: Path, *, check: bool = True) -> None:
    """Write `gguf` as a safetensors HF folder into `out`; with `check`, verify the reload matches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        src = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain fp32, not GGUF
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dst.load_state_dict(src.state_dict(), strict=True)
    dst.save_pretrained(out, safe_serialization=True)
    # GGUF leaves the length unset (1e30); the hub tokenizers record the context length
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    if check:
        _check_roundtrip(src, tokenizer, out)


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers parses the GGUF anew for the tokenizer, the config and the weights: ~8 s each for Gemma-3's
    262k-token vocabulary, most of a conversion. Inside this block one parse (a read-only memory map) serves them
    (transformers imports the reader from the `gguf` package at each parse)."""
    import gguf as gguf_utils

    parse = gguf_utils.GGUFReader
    parsed = {}

    def parsed_once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = parse(path, *args, **kwargs)
        return parsed[key]

    gguf_utils.GGUFReader = parsed_once
    try:
        yield
    finally:
        gguf_utils.GGUFReader = parse


def _check_roundtrip(src, tokenizer, out: Path) -> None:
    """The saved folder must give the GGUF model's tokens and logits exactly (same fp32 weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tokenizer(CHECK_TEXT, return_tensors="pt").input_ids
    ids2 = tok2(CHECK_TEXT, return_tensors="pt").input_ids
    if not torch.equal(ids, ids2) or tok2.eos_token_id != tokenizer.eos_token_id:
        raise AssetError(f"the tokenizer saved to {out} does not reproduce the GGUF tokenizer")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        a = src.eval()(ids).logits
        b = reloaded.eval()(ids).logits
    diff = (a - b).abs().max().item()
    if diff > 1e-5:
        raise AssetError(f"the safetensors folder at {out} changes the logits (max abs diff {diff:.3g})")
    log.info("safetensors folder verified against the GGUF model (max abs logit diff %.3g)", diff)
