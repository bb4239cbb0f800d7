"""The fine-tune's optimizer: AdamW with the recipe's hyper-parameters, in the implementation `train.optimizer_impl`
names. The three are the same update (tests/test_loss_head.py checks them against each other); they differ in how
many passes over memory one step makes, which on a CPU is most of the optimizer's time (results/bench/cpu_train/).
"""

from __future__ import annotations

import torch

# fused: one kernel per dtype group over all parameters (CPU and CUDA); foreach: multi-tensor ops, several passes;
# loop: one parameter at a time, an op per update term (torch's own default on CPU)
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
DEFAULT = "loop"  # where a config does not say (records made before the key existed)


def optimizer_impl(train_cfg) -> str:
    """`train.optimizer_impl`, checked; ValueError naming the field."""
    name = train_cfg.get("optimizer_impl") or DEFAULT
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"train.optimizer_impl: unknown {name!r}; expected one of {', '.join(IMPLEMENTATIONS)}")
    return name


def adamw(param_groups: list[dict], train_cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups, lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=train_cfg.eps,
                             **IMPLEMENTATIONS[optimizer_impl(train_cfg)])
