"""`absorbed_decode`: the Triton kernel on CUDA when triton imports, else the PyTorch reference."""

from __future__ import annotations

import functools

import torch

from .decode_reference import absorbed_decode_reference

BACKENDS = ("auto", "triton", "torch")
_state = {"backend": "auto", "triton_calls": 0}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton can be imported (it is an optional dependency: the `kernels` extra)."""
    try:
        from .decode_triton import absorbed_decode_triton  # noqa: F401
    except Exception:  # a broken triton install must not break the model: fall back to torch
        return False
    return True


def set_backend(backend: str) -> None:
    """'auto' (Triton on CUDA tensors, torch elsewhere), 'triton' (always; on CPU this needs
    TRITON_INTERPRET=1) or 'torch' (the reference, e.g. to benchmark the plain path)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _state["backend"] = backend


def get_backend() -> str:
    return _state["backend"]


def triton_calls() -> int:
    """How many decode steps went through the Triton kernel (lets a benchmark confirm it ran)."""
    return _state["triton_calls"]


def absorbed_decode(
    q_rope: torch.Tensor,
    q_latent: torch.Tensor,
    k_rope: torch.Tensor,
    latent: torch.Tensor,
    k_slice: slice,
    v_slice: slice,
    scale: float,
    valid_start: torch.Tensor | None = None,
    valid_end: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One absorbed decode step; arguments and result as in `absorbed_decode_reference`.

    `backend` overrides the process-wide choice of `set_backend` for this call.
    """
    backend = backend or _state["backend"]
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    use_triton = backend == "triton" or (backend == "auto" and latent.is_cuda and triton_available())
    if use_triton:
        from .decode_triton import absorbed_decode_triton

        _state["triton_calls"] += 1
        return absorbed_decode_triton(q_rope, q_latent, k_rope, latent, k_slice, v_slice, scale, valid_start, valid_end)
    return absorbed_decode_reference(q_rope, q_latent, k_rope, latent, k_slice, v_slice, scale, valid_start, valid_end)
