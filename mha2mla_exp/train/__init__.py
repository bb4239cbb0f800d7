"""Recovery fine-tuning after conversion (the paper's recipe, on accelerate)."""

from .finetune import FineTuneDiverged, finetune, plan_budget
from .schedule import warmup_constant_sqrt_decay

__all__ = ["FineTuneDiverged", "finetune", "plan_budget", "warmup_constant_sqrt_decay"]
