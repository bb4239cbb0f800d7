"""The fine-tune's optimizer: AdamW with the recipe's hyper-parameters, in the implementation `train.optimizer_impl`
names. The three are the same update (tests/test_loss_head.py checks them against each other); they differ in how
many passes over memory one step makes, which on a CPU is most of the optimizer's time (results/bench/cpu_train/).
"""

from __future__ import annotations

import torch

from ..schema.sections import TrainConfig

# fused: one kernel per dtype group over all parameters (CPU and CUDA); foreach: multi-tensor ops, several passes;
# loop: one parameter at a time, an op per update term (torch's own default on CPU)
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def adamw(param_groups: list[dict], train: TrainConfig) -> torch.optim.AdamW:
    """`train.optimizer_impl` is one of IMPLEMENTATIONS (the schema checks it)."""
    return torch.optim.AdamW(
        param_groups, lr=train.lr, betas=tuple(train.betas), eps=train.eps, **IMPLEMENTATIONS[train.optimizer_impl]
    )
