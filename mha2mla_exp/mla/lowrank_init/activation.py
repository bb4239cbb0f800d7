from .base import LowRankInit, Weighting


class ActivationSVD(LowRankInit):
    """Activation-aware SVD (as SVD-LLM): minimises the K/V output error on the calibration inputs,
    E||(W - W_hat) x||^2, every output row weighted alike."""

    name = "activation"
    statistics = ("input_gram",)
    label = "act"

    def weighting(self, problem, calibration):
        return Weighting(inputs=calibration.get("input_gram")[problem.layer])
