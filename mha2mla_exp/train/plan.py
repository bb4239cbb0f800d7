"""The fine-tune's plan, made before any weight is loaded: precision, token budget and lr schedule, memory per GPU
and host, and the process layout against this launch's (`plan_training`). Each check of the train section that
needs several fields lives here, once; a field's own range is the schema's. Errors are ValueErrors naming the
field (the runner reports them as config errors)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..schema.sections import DataConfig, ModelConfig, SizesConfig, TrainConfig
from .budget import PEAK_BF16_FLOPS, Budget, WallTime, flops_per_token, gpu_kind_of, plan_budget
from .memory import (
    HostEstimate,
    LaunchCheck,
    MemoryEstimate,
    checkpoint_bytes_per_process,
    estimate_host_memory,
    estimate_memory,
    processes_needed,
)
from .precision import Precision, precision_for
from .schedule import Schedule, schedule_for


@dataclass(frozen=True)
class TrainingPlan:
    """What the run trains and how: nothing (`fine_tune` and `distill` false), layer-wise distillation, a fine-tune
    (its precision, budget, schedule; with `train.gpu_memory_gb` its memory and process layout), or both."""

    fine_tune: bool
    distill: bool  # layer-wise distillation before the fine-tune (converted models only)
    precision: Precision | None = None  # None when nothing is fine-tuned
    budget: Budget | None = None
    schedule: Schedule | None = None
    memory: MemoryEstimate | None = None  # per GPU, where train.gpu_memory_gb asks
    host_memory: HostEstimate | None = None  # per process, same plan
    processes: LaunchCheck | None = None  # the processes the plan needs against this launch's
    refused: tuple[str, ...] = ()  # dry runs only: why this launch would be refused (a real run raises)

    @property
    def trains(self) -> bool:
        """Whether the run produces weights of its own (worth keeping: they cost compute)."""
        return self.fine_tune or self.distill

    def describe(self, train: TrainConfig, distill_sequences: int = 0, distill_epochs: int = 0) -> list[str]:
        """The dry run's lines for the training part."""
        if not self.trains:
            return ["nothing trained"]
        lines = []
        if self.distill:
            lines.append(f"layer-wise distillation: {distill_sequences} sequences x {distill_epochs} epochs")
        if not self.fine_tune:
            return lines
        budget = self.budget
        lines += [
            f"fine-tune: {budget.steps:,} steps x {budget.tokens_per_step:,} tokens = {budget.tokens:,} "
            f"tokens on {world_size()} process(es), {self.precision.mode} ({self.precision.reason})",
            f"step: {'chunked loss' if train.fused_loss else 'full logits'}, "
            f"{train.optimizer_impl} AdamW (train.fused_loss, train.optimizer_impl)",
            f"lr schedule: {self.schedule.describe()} (peak lr {float(train.lr):g})",
        ]
        if self.processes is not None:
            lines.append(f"processes: {self.processes.describe()}")
            lines.append(f"wall time: {self.processes.expected_wall.describe()}")
        if self.memory is not None:
            lines.append(f"GPU memory: {self.memory.describe()}")
        if self.host_memory is not None:
            written = checkpoint_bytes_per_process(
                parameters=self.memory.parameters, processes=self.memory.processes, strategy=self.memory.strategy
            )
            lines.append(f"host memory: {self.host_memory.describe()}")
            lines.append(
                f"checkpoint: {written / 1e9:.1f} GB from the busiest process every "
                f"{train.checkpoint_every} steps and at a stop signal"
            )
        return lines


def plan_training(
    train: TrainConfig,
    data: DataConfig,
    model: ModelConfig,
    shape,
    *,
    fine_tune: bool,
    distill: bool,
    teacher: bool,
    device_type: str,
    dry_run: bool,
    bf16_pays=None,
) -> TrainingPlan:
    """The plan of a run's training. `data`: the corpus it trains on (`train.data`, else the run's); `shape`: the
    model's `ModelShape`; `teacher`: the objective distils the original. A launch that cannot run the plan is
    refused: a real run raises, a dry run (which plans a GPU launch from anywhere) lists why in `refused`."""
    if not fine_tune:
        return TrainingPlan(fine_tune=False, distill=distill)
    budget, schedule = _check_train(train, model)
    precision = precision_for(
        train.precision,
        device_type,
        hidden_size=shape.hidden_size,
        intermediate_size=intermediate_size(model, shape),
        bf16_pays=bf16_pays,
    )
    refused = [] if dry_run else None
    memory, host, processes = _check_memory(
        train, data, model, shape, precision, budget, teacher=teacher, device_type=device_type, refused=refused
    )
    return TrainingPlan(
        fine_tune=True,
        distill=distill,
        precision=precision,
        budget=budget,
        schedule=schedule,
        memory=memory,
        host_memory=host,
        processes=processes,
        refused=tuple(refused or ()),
    )


def world_size() -> int:
    """Processes of this launch (torchrun / accelerate launch set WORLD_SIZE); known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_batch_rows(train: TrainConfig) -> int:
    return int(train.micro_batch_size) * int(train.grad_accum) * world_size()


def intermediate_size(model: ModelConfig, shape) -> int:
    """The MLP width the precision probe and the memory estimate read: the config's, else 4 x hidden."""
    sizes = model.sizes or SizesConfig()
    return int(sizes.intermediate_size or model.intermediate_size or 4 * shape.hidden_size)


def _check_train(train: TrainConfig, model: ModelConfig) -> tuple[Budget, Schedule]:
    """What the fine-tune's settings must satisfy together (the budget, the global batch, the model's context, the
    schedule within the budget's steps)."""
    if train.pretrain_share_pct is None and train.tokens <= 0:
        raise ValueError("train.tokens: must be positive when fine-tuning is enabled")
    wanted = train.global_batch_rows
    if wanted is not None and global_batch_rows(train) != wanted:
        world = world_size()
        per_process = train.micro_batch_size * world
        hint = (
            f"set train.grad_accum={wanted // per_process}"
            if wanted % per_process == 0
            else f"choose micro_batch_size x processes dividing {wanted}"
        )
        raise ValueError(
            f"train.grad_accum: micro_batch_size {train.micro_batch_size} x grad_accum "
            f"{train.grad_accum} x {world} processes = {global_batch_rows(train)} rows per step, but "
            f"global_batch_rows is {wanted}: {hint}"
        )
    if train.grad_accum <= 0:  # after the global batch: train=paper derives it, and that check says why it is 0
        raise ValueError(f"train.grad_accum: must be positive, got {train.grad_accum}")
    context = model.shape.context_length if model.shape is not None else None
    if context and train.seq_len > context:
        raise ValueError(
            f"train.seq_len: {train.seq_len} is longer than model {model.name!r}'s context of "
            f"{context} tokens (model.shape.context_length)"
        )
    budget = plan_budget(train, pretrain_tokens=model.pretrain_tokens, num_processes=world_size())
    return budget, schedule_for(train, budget.steps)


def _check_memory(
    train: TrainConfig,
    data: DataConfig,
    model: ModelConfig,
    shape,
    precision: Precision,
    budget: Budget,
    *,
    teacher: bool,
    device_type: str,
    refused: list | None,
) -> tuple[MemoryEstimate | None, HostEstimate | None, LaunchCheck | None]:
    """The fine-tune's per-GPU and host memory and its wall time where the train config states the GPU's memory
    (`train.gpu_memory_gb`), for the processes the plan is laid out for (`train.gpus`, or this launch's where it
    has more). A plan above the GPU's memory is refused, on a GPU and in a dry run (`refused` a list); so is a
    launch with fewer processes than the plan's, for memory where it would not fit (one process of an 8-GPU FSDP
    plan trains unsharded) and for time where it would (train.allow_fewer_processes=true: intended), naming the
    command that launches it right."""
    strategy = train.strategy
    if strategy == "fsdp" and precision.separate_master_copy:
        raise ValueError(
            f"train.strategy: fsdp shards the fp32 weights themselves; {precision.mode} keeps a "
            "separate master copy it cannot shard (use bf16-autocast or fp32)"
        )
    if train.gpu_memory_gb is None:
        return None, None, None
    sizes = model.sizes or SizesConfig()
    vocab_size = sizes.vocab_size or model.vocab_size
    if vocab_size is None:
        raise ValueError(
            f"model.sizes.vocab_size: the memory estimate (train.gpu_memory_gb) needs model "
            f"{model.name!r}'s vocabulary size"
        )
    launched, limit = world_size(), float(train.gpu_memory_gb)
    planned = max(launched, train.gpus)  # more processes than the plan's: the launch's own layout

    def per_gpu(processes: int) -> MemoryEstimate:
        return estimate_memory(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate_size=intermediate_size(model, shape),
            vocab_size=int(vocab_size),
            tied_embeddings=sizes.tied_embeddings,
            micro_batch_size=train.micro_batch_size,
            seq_len=train.seq_len,
            processes=processes,
            strategy=strategy,
            activation_checkpointing=train.activation_checkpointing,
            precision_mode=precision.mode,
            teacher=teacher,
            fused_loss=train.fused_loss,
        )

    memory = per_gpu(planned)
    host = estimate_host_memory(
        parameters=memory.parameters,
        processes=planned,
        strategy=strategy,
        largest_tensor=int(vocab_size) * shape.hidden_size,
        stream_parts=len(data.mixture or ()) if data.source == "hub" else 0,
        stream_window_tokens=data.shuffle_rows * train.seq_len if data.source == "hub" else 0,
        device_type=device_type,
        on_device=memory,
    )
    wall = WallTime(
        tokens=budget.tokens,
        flops_per_token=flops_per_token(
            parameters=memory.parameters,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            head_dim=shape.head_dim,
            seq_len=train.seq_len,
        ),
        processes=planned,
        gpu=gpu_kind(train.gpu_kind, device_type),
    )
    launch = LaunchCheck(
        planned=planned,
        launched=launched,
        needed=processes_needed(per_gpu, limit),
        on_launch=per_gpu(launched),
        limit_gb=limit,
        wall=wall,
        fewer_intended=train.allow_fewer_processes,
    )
    if device_type != "cuda" and refused is None:  # a real run on CPU: the GPU plan does not apply
        return memory, host, launch
    if memory.total_gb > limit:
        raise ValueError(
            f"train.gpu_memory_gb: the fine-tune needs about {memory.describe()}, above the "
            f"{train.gpu_memory_gb} GB stated; use more GPUs (train.gpus), train.strategy=fsdp, "
            "train.activation_checkpointing=true or a smaller train.micro_batch_size"
        )
    why = launch.refusal()
    if why is not None:
        if refused is None:
            raise ValueError(why)
        refused.append(why)
    return memory, host, launch


def gpu_kind(asked: str | None, device_type: str) -> str:
    """The GPU kind the wall time is planned for: `train.gpu_kind`, else this machine's GPU, else an H100."""
    if asked is not None:
        if asked not in PEAK_BF16_FLOPS:
            raise ValueError(f"train.gpu_kind: unknown {asked!r}; expected one of {', '.join(PEAK_BF16_FLOPS)}")
        return asked
    if device_type == "cuda" and torch.cuda.is_available():
        return gpu_kind_of(torch.cuda.get_device_name()) or "H100"
    return "H100"
