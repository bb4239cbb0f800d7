import torch

from .base import LowRankInit, Weighting


class BalancedKV(LowRankInit):
    """TransMLA's BKV: activation-aware, with the K block scaled so that its output energy on the calibration
    inputs equals V's (pre-RoPE NoPE keys are often ~10x the values, and would take most of the rank)."""

    name = "bkv"
    statistics = ("input_gram",)
    label = "bkv"

    def weighting(self, problem, calibration):
        gram = calibration.get("input_gram")[problem.layer]
        k, v = problem.split.nope_weight.double(), problem.v_weight.double()
        if len(k) == 0:
            return Weighting(inputs=gram)
        energy_k = torch.einsum("id,de,ie->", k, gram, k)
        energy_v = torch.einsum("id,de,ie->", v, gram, v)
        balance = (energy_v / energy_k.clamp_min(1e-30)).item()
        return Weighting(k=balance * torch.eye(len(k), dtype=torch.float64), inputs=gram)
