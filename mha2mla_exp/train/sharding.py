"""FSDP (`train.strategy=fsdp`): every decoder layer and then the whole model fully sharded over the processes
with PyTorch's `fully_shard` (FSDP2: parameters become DTensors; its CPU/gloo path is the one CI runs), so that
weights, gradients and AdamW state take 1/N of the memory each (train/memory.py). The weights stay fp32 (the
master weights); bf16 compute is still `train.precision`'s autocast.

What only one process did under DDP is collective here, because a sharded parameter exists only as N pieces:
the held-out probe runs on every process, checkpoints are written from full (gathered) state dicts, and the
trained model handed back to the runner is a plain, unsharded copy built from the gathered weights.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

STATE_FILE = "fsdp_state.pt"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard(model: torch.nn.Module, device_type: str, num_processes: int) -> torch.nn.Module:
    """`model` sharded in place, one FSDP unit per decoder layer (gathered one at a time) and one for the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (num_processes,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model, optimizer) -> dict:
    """The gathered model and optimizer state (collective: every process calls it), on CPU."""
    return {"model": get_model_state_dict(model, options=_FULL),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=_FULL)}


def load_full_state(model, optimizer, state: dict) -> None:
    """Scatter a `full_state` back into the shards (every process holds `state`)."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def unsharded_copy(model: torch.nn.Module, model_state: dict) -> torch.nn.Module:
    """A plain module of the model's own class holding the gathered weights: what the main process evaluates
    and saves (a sharded module would wait for the other processes at every forward)."""
    cls = type(model).__bases__[-1]  # fully_shard made the class (FSDPModule, the model's own class)
    plain = cls(model.config)
    missing, unexpected = plain.load_state_dict(model_state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"the gathered weights do not fit {cls.__name__}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    return plain.to(dtype=next(iter(model_state.values())).dtype)
