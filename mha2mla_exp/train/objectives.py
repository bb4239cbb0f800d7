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

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ..registry import Registered, Registry
from ..schema.sections import ObjectiveConfig

OBJECTIVES = Registry("recovery objective", "objective.name")


def build_objective(objective: ObjectiveConfig) -> "Objective":
    """The objective `objective.name` names, its other settings as arguments (null: the objective's own default);
    ValueError naming the field. Their ranges are the schema's (schema/sections.ObjectiveConfig)."""
    arguments = {
        f.name: getattr(objective, f.name)
        for f in fields(objective)
        if f.name != "name" and getattr(objective, f.name) is not None
    }
    cls = OBJECTIVES.class_of(objective.name)
    try:
        return cls(**arguments)
    except TypeError as err:
        raise ValueError(f"objective: {objective.name!r} does not take {sorted(arguments)} ({err})") from None


class Objective(Registered):
    registry = OBJECTIVES
    needs_teacher = False

    def token_loss_sum(
        self, logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """The objective summed over N scored positions: `logits` `[N, V]` predict `targets` `[N]`; the one
        definition of the method, used on full logits (`__call__`) and chunk by chunk (train/loss_head.py)."""
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None):
        """The per-token mean loss of the student's logits `[B, T, V]` on `input_ids` `[B, T]`: positions
        0..T-2 predict 1..T-1 (as transformers' causal-LM loss)."""
        scored, targets = logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten()
        teacher = None if teacher_logits is None else teacher_logits[:, :-1].flatten(0, 1)
        return self.token_loss_sum(scored, targets, teacher) / targets.numel()


def next_token_ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over positions, in fp32."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def forward_kl_sum(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) at temperature tau summed over positions, times tau^2, in fp32."""
    student = F.log_softmax(logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="sum") * temperature**2


@dataclass
class CrossEntropy(Objective):
    name = "ce"

    def token_loss_sum(self, logits, targets, teacher_logits=None):
        return next_token_ce_sum(logits, targets)


@dataclass
class LogitDistillation(Objective):
    name = "kd"
    temperature: float = 1.0
    needs_teacher = True

    def token_loss_sum(self, logits, targets, teacher_logits):
        return forward_kl_sum(logits, teacher_logits, self.temperature)


@dataclass
class CrossEntropyAndDistillation(Objective):
    name = "ce+kd"
    kd_weight: float = 0.5
    temperature: float = 1.0
    needs_teacher = True

    def token_loss_sum(self, logits, targets, teacher_logits):
        ce = next_token_ce_sum(logits, targets)
        return (1 - self.kd_weight) * ce + self.kd_weight * forward_kl_sum(logits, teacher_logits, self.temperature)
