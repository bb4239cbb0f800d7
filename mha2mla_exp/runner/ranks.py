"""How the processes of one launch (torchrun / accelerate launch / SLURM tasks) stay in step around the work only
the main process does.

The main process alone evaluates (lm-eval and LongBench hold one model). In a multirun every process walks the
same cells, so without a wait the others would enter the next cell and block in its first collective while
the main process is still evaluating, and a collective times out (NCCL: 10 minutes) long before
`commonsense_full` or LongBench ends. They wait instead at a barrier of their own: a gloo group whose timeout
is `distributed.eval_wait_s`, so the training collectives keep the short `distributed.timeout_s` that catches
a real hang.
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


def process_state(cfg) -> PartialState:
    """accelerate's view of this launch, its process group created with the configured collective timeout."""
    on_cpu = str(cfg.device).startswith("cpu") or not torch.cuda.is_available()
    settings = cfg.get("distributed") or {}
    kwargs = {}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and settings.get("timeout_s"):
        kwargs["timeout"] = datetime.timedelta(seconds=float(settings["timeout_s"]))
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


def wait_for_main_process(dist: PartialState, timeout_s: float) -> None:
    """Every process waits here until the main one arrives (after its evaluation), for up to `timeout_s`."""
    if dist.num_processes <= 1:
        return
    import torch.distributed as td

    if timeout_s not in _WAIT_GROUPS:  # new_group is itself collective: every process creates it at the same call
        _WAIT_GROUPS[timeout_s] = td.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if not dist.is_main_process:
        log.info("waiting up to %.0f s for the main process's evaluation", timeout_s)
    td.barrier(group=_WAIT_GROUPS[timeout_s])


def eval_wait_s(cfg) -> float:
    return float((cfg.get("distributed") or {}).get("eval_wait_s") or 86400)
