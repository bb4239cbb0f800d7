"""Recovery after conversion: the paper's fine-tune as a recipe (on accelerate), its objectives and precisions,
and layer-wise distillation."""

from .budget import Budget, check_epochs, plan_budget, pretrain_share_pct
from .objectives import OBJECTIVES, build_objective
from .precision import MODES as PRECISION_MODES
from .precision import Precision, precision_for
from .recipe import FineTuneDiverged, FineTuneRecipe, TrainingStopped, finetune, remove_checkpoint
from .schedule import Schedule, schedule_for

__all__ = [
    "OBJECTIVES",
    "PRECISION_MODES",
    "Budget",
    "FineTuneDiverged",
    "FineTuneRecipe",
    "Precision",
    "TrainingStopped",
    "build_objective",
    "check_epochs",
    "finetune",
    "plan_budget",
    "precision_for",
    "pretrain_share_pct",
    "remove_checkpoint",
    "Schedule",
    "schedule_for",
]
