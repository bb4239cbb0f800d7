"""The paper's learning-rate schedule: linear warm-up, constant, then 1-sqrt decay to 0 (nanotron's `linear`
warm-up and `1-sqrt` decay with `min_decay_lr: 0`, as the released configs use it).

The decay is either the last `train.decay_steps` optimizer steps (the released configs give it in steps: 1,800
of 18,000 for 135M/360M, 2,000 of 12,000 for 1.7B/7B; `train=paper` reads it from the model's `paper_recipe`) or,
where that is unset, the last `train.decay_fraction` of the steps (the CPU recipes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema.sections import TrainConfig


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    warmup_steps: int
    decay_steps: int

    @property
    def decay_start(self) -> int:
        """The first update whose lr is decayed (0-based)."""
        return self.total_steps - self.decay_steps

    def multiplier(self, step: int) -> float:
        """A LambdaLR multiplier for optimizer step `step` (0-based: the lr used by the step-th update)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps and step >= self.decay_start:  # reaches 0 just after the last step
            return 1.0 - math.sqrt((step - self.decay_start) / self.decay_steps)
        return 1.0

    def describe(self) -> str:
        decay = (
            f"1-sqrt decay from step {self.decay_start:,} to 0 at step {self.total_steps:,}"
            if self.decay_steps
            else "no decay"
        )
        return f"warm-up ends at step {self.warmup_steps:,}, constant, then {decay}"


def schedule_for(train: TrainConfig, total_steps: int) -> Schedule:
    """The schedule of a fine-tune of `total_steps` optimizer steps under `train`; ValueError (naming the
    field) where its warm-up and decay do not fit the steps."""
    warmup = int(train.warmup_steps)
    if train.decay_steps is not None:
        decay = int(train.decay_steps)
        if warmup + decay > total_steps:
            raise ValueError(
                f"train.decay_steps: {warmup:,} warm-up steps (train.warmup_steps) and {decay:,} decay "
                f"steps do not fit the budget's {total_steps:,} steps; shorten them with the budget "
                "(the released configs: warm-up 5-8 %, decay the last 10-17 %)"
            )
    else:
        fraction = float(train.decay_fraction)
        decay = max(1, round(total_steps * fraction)) if fraction > 0 else 0
    return Schedule(total_steps, warmup, decay)
