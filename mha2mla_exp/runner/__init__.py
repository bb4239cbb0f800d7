"""The experiment runner: compose -> run_config (once) -> validate (each layer plans its stage) -> load -> convert ->
fine-tune -> evaluate -> record."""

from .config import ConfigError, RunPlan, run_config, validate
from .run import plan_run, run, run_dir_for, trained_model_for

__all__ = ["ConfigError", "RunPlan", "run_config", "validate", "plan_run", "run", "run_dir_for", "trained_model_for"]
