"""fp32 master copies of bf16 weights: the optimizer updates the copies, the model computes with rounded weights.

A bf16 weight cannot hold an update much smaller than itself (8 bits of mantissa: an lr-1e-4 step on a
weight of 1.0 rounds away), so training bf16 weights directly loses most of the fine-tune. The master copy
accumulates every update in fp32; the bf16 weight is its rounding, refreshed after each step.
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.master = [p.detach().float().clone().requires_grad_(True) for p in params]

    def grads_to_master(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    @torch.no_grad()
    def restore_fp32(self, model: torch.nn.Module) -> None:
        """Make `model` fp32 and give each trained weight its exact master value (nothing is lost to rounding)."""
        model.float()
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    def state_dict(self) -> dict:
        return {"master": [m.detach() for m in self.master]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.master_to_model()
