from .base import LowRankInit, Weighting


class WeightSVD(LowRankInit):
    """The paper's plain truncated SVD of the weights: minimises ||W - W_hat||_F."""

    name = "weight"

    def weighting(self, problem, calibration):
        return Weighting()
