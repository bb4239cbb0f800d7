"""FSDP (`train.strategy=fsdp`): every decoder layer and then the whole model fully sharded over the processes
with PyTorch's `fully_shard` (FSDP2: parameters become DTensors; its CPU/gloo path is the one CI runs), so that
weights, gradients and AdamW state take 1/N of the memory each (train/memory.py). The weights stay fp32 (the
master weights); bf16 compute is still `train.precision`'s autocast. It applies wherever a process group exists
(`shards`): torchrun with one process shards over a mesh of one, a plain `python -m mha2mla_exp` trains plainly.

No process but the main one ever holds the whole model on the host:
- start: the main process loads and converts; the others build the converted model on the meta device
  (`empty_like_main`), and after sharding every process takes its shard of the main process's weights
  (`take_shards_from_main`: torch.distributed.checkpoint's broadcast_from_rank0, one tensor at a time);
- checkpoints: torch.distributed.checkpoint writes each process's shards of the weights and AdamW's state into
  one file per process (`save_sharded`), and a resume reads back only its own (`load_sharded`);
- end: the weights are gathered one tensor at a time into a plain, unsharded copy on the main process's training
  device (`gathered_copy`), which it evaluates and saves (one safetensors shard at a time: runner/trained.py); the
  other processes keep nothing, and no process holds the whole model on the host.
What only one process did under DDP is collective here, because a sharded parameter exists only as N pieces:
the held-out probe runs on every process.
"""

from __future__ import annotations

import torch
import torch.distributed as td
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..schema.sections import TrainConfig

SHARDED_STATE_DIR = "fsdp_shards"  # inside a checkpoint folder: torch.distributed.checkpoint's files


def shards(train: TrainConfig) -> bool:
    """Whether a fine-tune with `train` trains sharded: `train.strategy=fsdp` in a launch with a process
    group (torchrun / accelerate launch / SLURM tasks, one process or more)."""
    return train.strategy == "fsdp" and td.is_available() and td.is_initialized()


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


def empty_like_main(config) -> torch.nn.Module:
    """The model of `config` (the main process's, e.g. the converted MLAConfig) on the meta device: its
    structure without any memory, for a process that receives its shards from the main one."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def take_shards_from_main(model: torch.nn.Module, main_weights: dict | None, device: torch.device) -> None:
    """Fill a sharded `model` with the main process's weights (collective). `main_weights`: the main process's
    full state dict, taken before sharding; None on the others, whose model may be on the meta device (it is
    materialised on `device` first). Buffers (rotary frequencies, which no state dict holds) are the main's too."""
    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device=device)
    set_model_state_dict(
        model, main_weights or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for buffer in model.buffers():
        td.broadcast(buffer, src=0)


def save_sharded(model, optimizer, folder) -> None:
    """Each process writes its shards of the weights and of AdamW's state into `folder` (collective)."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_sharded(model, optimizer, folder) -> None:
    """The inverse of `save_sharded`: each process reads back its own shards (collective)."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def gathered_copy(model: torch.nn.Module, device: torch.device, main: bool) -> torch.nn.Module | None:
    """The trained weights gathered into a plain module of the model's own class on `device` (the training device:
    the main process evaluates it there; a sharded module would wait for the other processes at every forward), on
    the main process; None on the others (collective). One tensor at a time: each is all-gathered on the training
    device, copied into the plain module and freed, so the whole fp32 model is never on the host (the GPU holds the
    plain copy and one gathered tensor) and the final save then writes it one safetensors shard at a time."""
    from torch.distributed.tensor import DTensor

    plain = target = None
    if main:
        cls = type(model).__bases__[-1]  # fully_shard made the class (FSDPModule, the model's own class)
        with torch.device("meta"):
            plain = cls(model.config)
        plain.to_empty(device=device)
        target = plain.state_dict()  # views of the plain module's tensors
    copied = set()
    with torch.no_grad():
        for name, value in model.state_dict().items():  # the same order on every process
            full = value.full_tensor() if isinstance(value, DTensor) else value  # collective
            if main:
                if name not in target:
                    raise RuntimeError(f"the gathered weights do not fit {type(plain).__name__}: unexpected {name}")
                target[name].copy_(full)
                copied.add(name)
            del full
    if not main:
        return None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(target) - copied - tied
    if missing:
        raise RuntimeError(f"the gathered weights do not fit {type(plain).__name__}: missing {sorted(missing)}")
    plain.tie_weights()
    sharded_buffers = dict(model.named_buffers())  # not sharded: every process has them whole
    with torch.no_grad():
        for name, buffer in plain.named_buffers():
            buffer.copy_(sharded_buffers[name])
    return plain.to(dtype=next(model.parameters()).dtype)
