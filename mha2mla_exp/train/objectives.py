"""Recovery objectives: what the converted model is trained to reproduce. One class each, registered by name.

- `ce`: next-token cross-entropy on the corpus (the paper).
- `kd`: logit distillation from the original model: forward KL(teacher || student) at temperature tau,
  per-token mean, scaled by tau^2 (Hinton et al.) so the gradient scale does not depend on tau.
- `ce+kd`: `(1 - kd_weight) * ce + kd_weight * kd`.

The teacher (the unconverted model) is kept frozen, in bf16 when the device computes bf16 well, and
only runs forward passes. Add an objective by writing a class here that sets `name` (it registers itself,
mha2mla_exp/registry.py) and a file in conf/objective/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..registry import Registered, Registry

OBJECTIVES = Registry("recovery objective", "objective.name")


def build_objective(cfg: dict) -> "Objective":
    """The objective named by `cfg["name"]`, its other keys as arguments; ValueError naming the field."""
    cfg = dict(cfg or {"name": "ce"})
    name = cfg.pop("name", "ce")
    cls = OBJECTIVES.class_of(name)
    try:
        return cls(**cfg)
    except TypeError as err:
        raise ValueError(f"objective: {name!r} does not take {sorted(cfg)} ({err})") from None


class Objective(Registered):
    registry = OBJECTIVES
    needs_teacher = False

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None):
        """A scalar loss from the student's logits `[B, T, V]` on `input_ids` `[B, T]`."""
        raise NotImplementedError


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (as transformers' causal-LM loss: fp32, positions 0..T-2 predict 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten())


def forward_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token mean of KL(teacher || student) over positions 0..T-2 (those the CE scores), times tau^2."""
    student = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)
    return kl.mean() * temperature**2


@dataclass
class CrossEntropy(Objective):
    name = "ce"
    def __call__(self, logits, input_ids, teacher_logits=None):
        return next_token_ce(logits, input_ids)


@dataclass
class LogitDistillation(Objective):
    name = "kd"
    temperature: float = 1.0
    needs_teacher = True

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"objective.temperature: must be positive, got {self.temperature}")

    def __call__(self, logits, input_ids, teacher_logits):
        return forward_kl(logits, teacher_logits, self.temperature)


@dataclass
class CrossEntropyAndDistillation(Objective):
    name = "ce+kd"
    kd_weight: float = 0.5
    temperature: float = 1.0
    needs_teacher = True

    def __post_init__(self):
        if not 0 <= self.kd_weight <= 1:
            raise ValueError(f"objective.kd_weight: must be in [0, 1], got {self.kd_weight}")
        if not self.temperature > 0:
            raise ValueError(f"objective.temperature: must be positive, got {self.temperature}")

    def __call__(self, logits, input_ids, teacher_logits):
        ce = next_token_ce(logits, input_ids)
        return (1 - self.kd_weight) * ce + self.kd_weight * forward_kl(logits, teacher_logits, self.temperature)
