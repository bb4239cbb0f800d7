from .base import FixedPairs


class Low(FixedPairs):
    """The r lowest frequencies, pairs {d_h/2-r .. d_h/2-1} (METHOD.md step 1)."""

    name = "low"

    def pairs(self, r, head_dim):
        return list(range(head_dim // 2 - r, head_dim // 2))
