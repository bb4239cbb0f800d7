"""Low-rank initialisations (step 2 of MHA2MLA): what error the truncated SVD of [W_k_nope; W_v] minimises.
One class per file, registered by name; see `base.LowRankInit` for how to add one."""

from ...registry import import_submodules
from .base import LOWRANK_INITS, LayerProblem, LowRankInit, Weighting

import_submodules(__name__, __path__)

__all__ = ["LOWRANK_INITS", "LayerProblem", "LowRankInit", "Weighting"]
