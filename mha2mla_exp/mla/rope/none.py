from .base import FixedPairs


class NoPE(FixedPairs):
    """Control: no pair keeps RoPE (NoPE, r = 0)."""

    name = "none"

    def default_r(self, head_dim):
        return 0

    def resolve_r(self, r, head_dim):
        if r not in (None, 0):
            raise ValueError(f"r={r} contradicts rope='none' (NoPE keeps no pair)")
        return 0

    def label(self, r, score):
        return "nope"

    def pairs(self, r, head_dim):
        return []
