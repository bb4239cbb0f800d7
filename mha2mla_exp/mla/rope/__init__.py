"""RoPE strategies (step 1 of MHA2MLA): which frequency pairs keep RoPE. One class per file, registered by
name; importing this package imports every module in it. See `base.RopeStrategy` for how to add one."""

from ...registry import import_submodules
from .base import ROPE_STRATEGIES, FixedPairs, RopeStrategy

import_submodules(__name__, __path__)


def fixed_pairs(strategy: str, r: int, head_dim: int) -> list[int]:
    """The pairs a data-free strategy keeps (the same for every layer and KV head)."""
    found = ROPE_STRATEGIES.get(strategy)
    if not isinstance(found, FixedPairs):
        raise ValueError(f"strategy {strategy!r} is not a fixed selection")
    return found.pairs(r, head_dim)


__all__ = ["ROPE_STRATEGIES", "FixedPairs", "RopeStrategy", "fixed_pairs"]
