from __future__ import annotations

import torch

from .activation import ActivationSVD
from .base import LowRankInit, Weighting
from .bkv import BalancedKV

BALANCES = tuple(4.0**k for k in range(-4, 2))  # K-block scales tried around the derived weighting


class OutputAware(LowRankInit):
    """Output-aware: each layer's truncation is the one whose attention output on the calibration sample is
    closest to the full-rank layer's, among activation-aware SVD, BKV and the derived output weighting below
    at K/V balances 4^-4 .. 4 (so it is never worse than either on that error; the balance is measured).

    The derived weighting, both blocks in units of squared attention output to first order: a value error
    dv moves head h's output by W_o,h sum_s p_s dv_s, bounded (Jensen) by the weight W_o,h^T W_o,h summed
    over the query heads of the value's group. A NoPE key error dk moves the scores by s*q.dk (s = d_h^-1/2),
    and a score change d moves the output by sum_s p_s (d_s - mean d)(v_s - o): at most (Cauchy-Schwarz)
    s^2 (q^T dk)^2 times the head's value spread tau_h (`value_spread`). So the K block of group g is weighted
    by s^2 sum_h tau_h E[q_h q_h^T] on the query dims that meet the NoPE keys, mapped onto the compact key
    rows. The K bound is loose where a head's score errors are not aligned with its values, hence the
    measured balance.
    """

    name = "output"
    statistics = ("input_gram", "query_moments", "value_spread", "attention_inputs")
    label = "out"

    def derived(self, problem, calibration) -> Weighting:
        i, shape, split = problem.layer, problem.shape, problem.split
        n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
        group = n_h // n_kv
        queries = calibration.get("query_moments")[i]  # [n_h, d_h, d_h]
        spread = calibration.get("value_spread")[i]  # [n_h]
        w_o = problem.o_weight.double().view(-1, n_h, d_h).transpose(0, 1)  # [n_h, d, d_h]
        k_blocks, v_blocks = [], []
        for g in range(n_kv):
            heads = range(g * group, (g + 1) * group)
            idx = split.nope_query_index[g]
            k_blocks.append(sum(spread[h] * queries[h][idx][:, idx] for h in heads) * d_h**-1.0)
            v_blocks.append(sum(w_o[h].T @ w_o[h] for h in heads))
        k_weight = torch.block_diag(*k_blocks)
        if split.nope_embed is not None:
            embed = split.nope_embed.double()
            k_weight = embed.T @ k_weight @ embed
        return Weighting(k=k_weight, v=torch.block_diag(*v_blocks), inputs=calibration.get("input_gram")[i])

    def weightings(self, problem, calibration):
        derived = self.derived(problem, calibration)
        scaled = [Weighting(b * derived.k, derived.v, derived.inputs, f"output*{b:g}") for b in BALANCES]
        activation = ActivationSVD().weighting(problem, calibration)
        bkv = BalancedKV().weighting(problem, calibration)
        activation.label, bkv.label = "activation", "bkv"
        return [activation, bkv, *scaled]

    def weighting(self, problem, calibration):
        return self.derived(problem, calibration)
