"""The experiment runner: compose -> validate -> load -> calibrate -> convert -> fine-tune -> evaluate -> record."""

from .config import ConfigError, RunPlan, validate
from .run import plan_run, run, run_dir_for, trained_model_for

__all__ = ["ConfigError", "RunPlan", "validate", "plan_run", "run", "run_dir_for", "trained_model_for"]
