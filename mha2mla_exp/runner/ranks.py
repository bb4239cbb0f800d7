"""How the processes of one launch (torchrun / accelerate launch / SLURM tasks) stay in step around the work
whose length differs between them.

Every process evaluates: each holds the model on its own device and lm-eval gives each its share of the
documents (evaluation/lm.py). The shares do not end together (LongBench's documents differ in length by tens of
thousands of tokens), and the main process alone writes the record after them; in a multirun every process
walks the same cells, so a process that has finished must not wait in a collective that times out (NCCL: 10
minutes) before the slowest share ends. Those waits therefore go through a gloo group of their own whose timeout
is `distributed.eval_wait_s` (`long_wait_group`): the evaluation's few collectives and the barrier at the end of
each cell (`wait_for_main_process`), so the training collectives keep the short `distributed.timeout_s` that
catches a real hang.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list

log = logging.getLogger(__name__)

SLOW_EVAL_ENV = "MHA2MLA_SLOW_EVAL_S"  # tests only: the main process's evaluation takes this many seconds longer


def process_state(device: str, timeout_s: float) -> PartialState:
    """accelerate's view of this launch on `device` (the run's, `auto` or a kind), its process group created with
    the collective timeout `timeout_s` (`distributed.timeout_s`)."""
    on_cpu = str(device).startswith("cpu") or not torch.cuda.is_available()
    kwargs = {}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs["timeout"] = datetime.timedelta(seconds=float(timeout_s))
    return PartialState(cpu=on_cpu, **kwargs)


def same_on_every_rank(value, dist: PartialState):
    """The main process's `value` on every process: a decision that branches into collectives must agree."""
    return broadcast_object_list([value])[0] if dist.num_processes > 1 else value


def shared_bf16_verdict(dist: PartialState):
    """`bf16_pays` for `validate`: the main process times bf16 against fp32 and every process takes its verdict,
    so `train.precision=auto` and `eval.dtype=fastest` resolve once per launch (processes on a busy machine
    could time it differently, and ranks training in two precisions would not even agree on a gradient's dtype).
    Every process calls it at the same points of `validate`, as a collective must be."""
    from ..train.precision import cpu_bf16_pays

    def verdict(hidden_size: int, intermediate_size: int) -> tuple[bool, str]:
        mine = cpu_bf16_pays(hidden_size, intermediate_size) if dist.is_main_process else None
        fast, why = same_on_every_rank(mine, dist)
        return fast, why if dist.num_processes == 1 else f"{why}; measured by the main process"

    return verdict


_WAIT_GROUPS: dict[float, object] = {}


def long_wait_group(dist: PartialState, timeout_s: float):
    """A gloo group whose collectives wait up to `timeout_s` (None on one process). Creating it is itself
    collective: every process calls this at the same point (the first evaluation or the first cell's end)."""
    if dist.num_processes <= 1:
        return None
    import torch.distributed as td

    if timeout_s not in _WAIT_GROUPS:
        _WAIT_GROUPS[timeout_s] = td.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _WAIT_GROUPS[timeout_s]


def wait_for_main_process(dist: PartialState, timeout_s: float) -> None:
    """Every process waits here until the main one arrives (after the record is written), for up to `timeout_s`."""
    group = long_wait_group(dist, timeout_s)
    if group is None:
        return
    import torch.distributed as td

    if not dist.is_main_process:
        log.info("waiting up to %.0f s for the main process", timeout_s)
    td.barrier(group=group)
