"""The low-rank-init interface and its registry.

An init chooses the weights of the error the joint (or split) truncation minimises,
    sum over the K and V blocks of  E_x || M^{1/2} (W - W_hat) x ||^2,  x ~ the layer's input,
as a left weight per block (`Weighting.k`, `Weighting.v`: PSD matrices on the block's rows, None = identity)
and a right weight (`Weighting.inputs`: the input second moment, None = identity). The solver
(`mla/lowrank.py`) is exact for any such weights (Eckart-Young after whitening both sides) and exact at full
rank. To add one, write a class in a new file of this package (and a line in `conf/svd/` if it needs a file):

    class Mine(LowRankInit):
        name = "mine"                   # svd.init=mine
        statistics = ("input_gram",)    # calibration statistics it reads (mla/calibration.py)
        label = "mine"                  # its part of a run name

        def weighting(self, problem, calibration):
            return Weighting(inputs=calibration.get("input_gram")[problem.layer])

An init may offer several candidates (`weightings`); the conversion then measures them (see `output.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...registry import Registered, Registry
from ..layouts import KeySplit

LOWRANK_INITS = Registry("low-rank init", "init")


@dataclass
class LayerProblem:
    """One layer's truncation: the compact NoPE key rows `split.nope_weight`, the value rows `v_weight`
    [n_kv*d_h, d], and what reads them (the split's query dims, the output projection `o_weight` [d, n_h*d_h])."""

    layer: int
    split: KeySplit
    v_weight: torch.Tensor
    o_weight: torch.Tensor
    shape: object


@dataclass
class Weighting:
    k: torch.Tensor | None = None  # [m_k, m_k] on the compact NoPE key rows
    v: torch.Tensor | None = None  # [n_kv*d_h, n_kv*d_h] on the value rows
    inputs: torch.Tensor | None = None  # [d, d]
    label: str = ""  # names a candidate in the converted config (`mla.init_choices`)


class LowRankInit(Registered):
    registry = LOWRANK_INITS
    statistics: ClassVar[tuple[str, ...]] = ()
    label: ClassVar[str] = ""  # "" = the paper's choice, nothing added to a run name

    def weighting(self, problem: LayerProblem, calibration) -> Weighting:
        raise NotImplementedError

    def weightings(self, problem: LayerProblem, calibration) -> list[Weighting]:
        """Candidate weightings; with more than one, the conversion keeps, per layer, the truncation whose
        attention output is closest to the full-rank layer's on the calibration sample (`attention_inputs`)."""
        return [self.weighting(problem, calibration)]
