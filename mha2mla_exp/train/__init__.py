"""Recovery after conversion: the paper's fine-tune as a recipe (on accelerate), its objectives and precisions,
and layer-wise distillation."""

from .objectives import OBJECTIVES, build_objective
from .precision import MODES as PRECISION_MODES
from .precision import Precision, precision_for
from .recipe import FineTuneDiverged, FineTuneRecipe, finetune, plan_budget, remove_checkpoint
from .schedule import warmup_constant_sqrt_decay

__all__ = ["OBJECTIVES", "PRECISION_MODES", "FineTuneDiverged", "FineTuneRecipe", "Precision", "build_objective",
           "finetune", "plan_budget", "precision_for", "remove_checkpoint", "warmup_constant_sqrt_decay"]
