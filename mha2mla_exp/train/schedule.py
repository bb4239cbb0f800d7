"""The paper's learning-rate schedule: linear warmup, constant, then 1-sqrt decay to 0."""

from __future__ import annotations

import math


def warmup_constant_sqrt_decay(total_steps: int, warmup_steps: int, decay_fraction: float):
    """A LambdaLR multiplier for optimizer step `step` (0-based: the lr used by the step-th update)."""
    decay_steps = max(1, round(total_steps * decay_fraction)) if decay_fraction > 0 else 0
    decay_start = total_steps - decay_steps

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay_steps and step >= decay_start:  # reaches 0 just after the last step
            return 1.0 - math.sqrt((step - decay_start) / decay_steps)
        return 1.0

    return multiplier
