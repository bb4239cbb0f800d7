from .base import FixedPairs


class Full(FixedPairs):
    """Control: every pair keeps RoPE (r = d_h/2)."""

    name = "full"

    def default_r(self, head_dim):
        return head_dim // 2

    def resolve_r(self, r, head_dim):
        if r is not None and r != head_dim // 2:
            raise ValueError(f"r={r} contradicts rope='full', which keeps all d_h/2={head_dim // 2} pairs")
        return head_dim // 2

    def label(self, r, score):
        return "fullrope"

    def pairs(self, r, head_dim):
        return list(range(head_dim // 2))
