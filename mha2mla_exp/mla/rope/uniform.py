from .base import FixedPairs


class Uniform(FixedPairs):
    """r pairs spread evenly, {floor(k*d_h/(2r)) : k < r} (METHOD.md step 1)."""

    name = "uniform"

    def pairs(self, r, head_dim):
        return sorted({(k * head_dim) // (2 * r) for k in range(r)})
