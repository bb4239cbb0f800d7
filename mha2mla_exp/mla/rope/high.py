from .base import FixedPairs


class High(FixedPairs):
    """The r highest frequencies, pairs {0..r-1} (METHOD.md step 1)."""

    name = "high"

    def pairs(self, r, head_dim):
        return list(range(r))
