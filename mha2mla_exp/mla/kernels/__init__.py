"""Fused decode kernels for the absorbed MHA2MLA attention.

`absorbed_decode` runs one decode step (query length 1) of attention that reads the cached
latent directly: a Triton kernel on CUDA, the PyTorch reference everywhere else. Triton is
imported lazily, so this package imports without it. The modules live flat in `mla/`
(`decode_dispatch`, `decode_reference`, `decode_triton`) because a saved checkpoint carries them
as its remote code, which transformers copies as one flat folder; `tune` is the launch-config sweep.
"""

from ..decode_dispatch import absorbed_decode, get_backend, set_backend, triton_available, triton_calls
from ..decode_reference import absorbed_decode_reference

__all__ = [
    "absorbed_decode",
    "absorbed_decode_reference",
    "get_backend",
    "set_backend",
    "triton_available",
    "triton_calls",
]
