"""How much GPU and host memory a fine-tune needs per process, from the model's shape and the training plan alone,
so that a plan that cannot fit is refused before a 7B model is fetched, and how many processes it needs.

Bytes per trained parameter: fp32 weights 4, fp32 gradients 4, AdamW's two fp32 moments 8 (every mode keeps
fp32 master state on GPU; bf16-master adds a bf16 copy of the weights, 2). DDP keeps all of it on every
process plus its gradient buckets (4: `gradient_as_bucket_view` is off); FSDP full-shard divides it by the
number of processes and holds two layers gathered at a time (the one computing and the one prefetched).
Activations, bf16, with SDPA/flash attention (no score matrix kept): ~34 x tokens x hidden bytes per layer
(Korthikanti et al. 2022, "Reducing Activation Recomputation"); with activation checkpointing each layer keeps
only its input (2 x tokens x hidden) and one layer is recomputed at a time. The output layer: fp32 logits and
their gradient (8 x tokens x vocab) plus the bf16 logits under autocast (2 x tokens x vocab), of a micro-batch's
tokens, or of one chunk's (`loss_head.CHUNK_ROWS`) with `train.fused_loss`. A teacher (logit distillation) is a
bf16 copy of the original. CUDA context and allocator slack: 1.5 GB plus 10 %.

Host memory per process of a launch on GPUs (`estimate_host_memory`): weights are read from memory-mapped
safetensors straight onto each process's GPU (models.py: the original, a kd teacher, a kept model), the conversion
runs there, checkpoints are written and read one tensor at a time (torch.save per storage under DDP; FSDP: each
process its own shards through torch.distributed.checkpoint's bounded CPU staging), so a process holds its
interpreter, torch and the CUDA libraries (`HOST_RUNTIME_BYTES`) and one tensor in flight. The main process also
reads the data stream for every process (data/stream: each mixture part's `datasets` reader, `STREAM_PART_BYTES`
each, and the current and the prefetched shuffle window of token ids) and, at the end, saves the kept model: the
trained weights are gathered onto its GPU one tensor at a time (train/sharding.py) and `save_pretrained` writes
them one safetensors shard of at most `SAVE_SHARD_BYTES` at a time, the only part of the weights on the host.
A CPU run (`device_type="cpu"`) holds on the host what a GPU run holds on its GPU (the per-GPU estimate's parts),
and its main process the original and the conversion during loading (8 bytes a parameter) and the plain copy it
keeps (4); the 2-process benchmark (mha2mla_exp.bench.host_rss) measures that against its peak RSS.

SLURM's `mem_gb` is per node: `slurm_mem_gb` is the node's estimate plus `SLURM_MARGIN` (the estimate is
arithmetic; allocator fragmentation and the data readers' real buffers are not measured on a cluster yet),
and conf/hydra/launcher/slurm.yaml asks for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .budget import WallTime
from .loss_head import CHUNK_ROWS

GB = 1e9
STRATEGIES = ("ddp", "fsdp")
CONTEXT_BYTES = 1.5e9
SLACK = 0.10
HOST_RUNTIME_BYTES = 3e9  # python, torch, CUDA libraries and the tokenizer, resident in every process
CPU_RUNTIME_BYTES = 1e9  # the same without the CUDA libraries (a CPU run)
SAVE_SHARD_BYTES = 1_000_000_000  # save_pretrained's max_shard_size for a kept model: the host holds one shard
STREAM_PART_BYTES = 0.5e9  # an allowance per streamed mixture part (a parquet row group and arrow buffers)
SLURM_MARGIN = 0.25  # on top of the node's host estimate, for the SLURM request
SLURM_MIN_MEM_GB = 16  # a job never asks for less
MAX_PROCESSES = 1024  # the most processes `processes_needed` looks for


@dataclass(frozen=True)
class MemoryEstimate:
    strategy: str
    processes: int
    activation_checkpointing: bool
    parameters: int
    parts: dict  # name -> bytes per process

    @property
    def total_bytes(self) -> float:
        return (sum(self.parts.values()) + CONTEXT_BYTES) * (1 + SLACK)

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.parts.items())
        return (
            f"{self.total_gb:.1f} GB per GPU ({self.strategy} on {self.processes} process(es), activation "
            f"checkpointing {'on' if self.activation_checkpointing else 'off'}, {self.parameters / 1e9:.2f}B "
            f"parameters; GB: {parts}, + context and {SLACK:.0%} slack)"
        )


def parameter_count(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tied_embeddings: bool,
) -> int:
    """A Llama-family decoder's parameters (the converted model has fewer in attention: this bounds it)."""
    attention = hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = 3 * hidden_size * intermediate_size
    embeddings = vocab_size * hidden_size * (1 if tied_embeddings else 2)
    return num_layers * (attention + mlp + 2 * hidden_size) + embeddings + hidden_size


def estimate_memory(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tied_embeddings: bool,
    micro_batch_size: int,
    seq_len: int,
    processes: int,
    strategy: str = "ddp",
    activation_checkpointing: bool = False,
    precision_mode: str = "bf16-autocast",
    teacher: bool = False,
    fused_loss: bool = False,
) -> MemoryEstimate:
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy: unknown {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    p = parameter_count(
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size, tied_embeddings
    )
    state = 16 + (2 if precision_mode == "bf16-master" else 0)
    layer = p / num_layers  # the embeddings' share makes this an upper bound for one decoder layer
    tokens = micro_batch_size * seq_len
    parts = {}
    if strategy == "ddp":
        parts["weights+grads+adam"] = state * p
        parts["ddp buckets"] = 4 * p
    else:
        parts["weights+grads+adam (sharded)"] = state * p / processes
        parts["gathered layers"] = 2 * 4 * layer * 2  # two layers' fp32 weights and gradients, unsharded
    if activation_checkpointing:
        parts["activations"] = 2 * tokens * hidden_size * num_layers + 34 * tokens * hidden_size
    else:
        parts["activations"] = 34 * tokens * hidden_size * num_layers
    parts["logits"] = 10 * (min(tokens, CHUNK_ROWS) if fused_loss else tokens) * vocab_size
    if teacher:
        parts["teacher (bf16)"] = 2 * p
    return MemoryEstimate(strategy, processes, activation_checkpointing, p, parts)


@dataclass(frozen=True)
class HostEstimate:
    strategy: str
    processes: int
    main: dict  # part name -> bytes, the main process at its peak
    other: dict  # the same for each other process (empty with one process)
    runtime_bytes: float = HOST_RUNTIME_BYTES

    def _total(self, parts: dict) -> float:
        return (sum(parts.values()) + self.runtime_bytes) * (1 + SLACK)

    @property
    def main_gb(self) -> float:
        return self._total(self.main) / GB

    @property
    def other_gb(self) -> float:
        return self._total(self.other) / GB if self.processes > 1 else 0.0

    def node_gb(self, processes_per_node: int) -> float:
        """The node that holds the main process and `processes_per_node - 1` others."""
        return self.main_gb + (min(processes_per_node, self.processes) - 1) * self.other_gb

    def slurm_mem_gb(self, processes_per_node: int) -> int:
        """SLURM's `mem_gb` for the node with the main process: its estimate plus `SLURM_MARGIN`, whole GB."""
        return max(SLURM_MIN_MEM_GB, math.ceil(self.node_gb(processes_per_node) * (1 + SLURM_MARGIN)))

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.main.items()) or "the weights stay on its GPU"
        text = f"main process {self.main_gb:.1f} GB ({parts})"
        if self.processes > 1:
            others = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.other.items()) or "the runtime alone"
            text += (
                f", each of the other {self.processes - 1} {self.other_gb:.1f} GB ({others}); "
                f"{self.node_gb(self.processes):.1f} GB for all {self.processes} on one node"
            )
        return text + (
            f" (+ {self.runtime_bytes / GB:.0f} GB runtime each and {SLACK:.0%} slack); SLURM mem_gb "
            f"{self.slurm_mem_gb(self.processes)} (+{SLURM_MARGIN:.0%})"
        )


def estimate_host_memory(
    *,
    parameters: int,
    processes: int,
    strategy: str = "ddp",
    largest_tensor: int = 0,
    stream_parts: int = 0,
    stream_window_tokens: int = 0,
    device_type: str = "cuda",
    on_device: MemoryEstimate | None = None,
    original_parameters: int | None = None,
) -> HostEstimate:
    """Host (CPU) memory per process of a fine-tune of a model of `parameters` (see the module docstring).
    `largest_tensor`: elements of the model's largest weight (its embeddings), one of which is in flight at a
    checkpoint; `stream_parts`: the streamed mixture's parts (0: a local corpus held by its file);
    `stream_window_tokens`: a shuffle window's tokens (`data.shuffle_rows` x `train.seq_len`). On CPU (`device_type`)
    `on_device` (the per-process estimate) lives on the host too, and the main process loads
    `original_parameters` (default: `parameters`) before converting."""
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy: unknown {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    in_flight = {"checkpoint tensor in flight": 4 * largest_tensor} if largest_tensor else {}
    main = dict(in_flight)
    if stream_parts:
        main["data stream"] = stream_parts * STREAM_PART_BYTES + 2 * 8 * stream_window_tokens
    if device_type == "cuda":  # a shard's tensors are copied off the GPU to be written (on CPU they are viewed)
        main["final save (one safetensors shard)"] = max(min(SAVE_SHARD_BYTES, 4 * parameters), 4 * largest_tensor)
    other = dict(in_flight) if processes > 1 else {}
    runtime = HOST_RUNTIME_BYTES
    if device_type == "cpu":  # the device's parts are the host's; the main process's peak is its largest phase
        runtime = CPU_RUNTIME_BYTES
        device_parts = dict(on_device.parts) if on_device else {}
        sharded_weights = 4 * parameters / (processes if strategy == "fsdp" else 1)
        phases = {
            "loading": {"original and conversion": 4 * (original_parameters or parameters) + 4 * parameters},
            "training": device_parts,
            "end": {"weights (sharded)": sharded_weights, "kept plain copy": 4 * parameters},
        }
        phase = max(phases, key=lambda name: sum(phases[name].values()))
        main = {f"{phase}: {k}": v for k, v in phases[phase].items()} | main
        other = device_parts | other if processes > 1 else {}
    return HostEstimate(strategy, processes, main, other, runtime)


def processes_needed(estimate, limit_gb: float) -> int | None:
    """The fewest processes for which `estimate(processes)` (a MemoryEstimate) fits `limit_gb` per GPU, or None
    where none does (DDP's per-GPU memory does not shrink with more processes)."""
    processes = 1
    while processes <= MAX_PROCESSES:
        if estimate(processes).total_gb <= limit_gb:
            return processes
        processes *= 2
    return None


@dataclass(frozen=True)
class LaunchCheck:
    """The processes a fine-tune's plan is laid out for (`train.gpus`) against those this launch has: a launch
    with fewer is refused, for memory where the plan would not fit and for time where it would (one process of an
    8-GPU plan takes 8 times as long), unless `train.allow_fewer_processes` says it is intended."""

    planned: int
    launched: int
    needed: int | None  # the fewest processes whose per-GPU memory fits, None: no count does
    on_launch: MemoryEstimate  # per GPU with this launch's processes
    limit_gb: float
    wall: WallTime | None = None  # the fine-tune's wall time on the planned processes
    fewer_intended: bool = False  # train.allow_fewer_processes

    @property
    def fits(self) -> bool:
        return self.on_launch.total_gb <= self.limit_gb

    @property
    def accepted(self) -> bool:
        return self.fits and (self.launched >= self.planned or self.fewer_intended)

    @property
    def expected_wall(self) -> WallTime:
        """The fine-tune's wall time on this launch (fewer processes than planned where that is intended)."""
        return self.wall.on(min(self.launched, self.planned)) if self.launched < self.planned else self.wall

    def command(self) -> str:
        n = self.planned
        return (
            f"torchrun --nproc_per_node {n} -m mha2mla_exp ... (on SLURM: hydra.launcher.tasks_per_node={n} "
            f"hydra.launcher.gpus_per_node={n})"
        )

    def refusal(self) -> str | None:
        """Why this launch is refused (None: accepted), naming the command that launches the plan."""
        if self.accepted:
            return None
        head = (
            f"train.gpus: this launch has {self.launched} process(es) but the plan is laid out for {self.planned} "
            f"({self.on_launch.strategy}); "
        )
        if not self.fits:
            why = (
                f"on {self.launched} the fine-tune needs about {self.on_launch.describe()}, above the "
                f"{self.limit_gb:g} GB of train.gpu_memory_gb"
            )
        else:
            why = (
                f"on {self.launched} the fine-tune would take {self.wall.on(self.launched).describe()} instead of "
                f"about {self.wall.hours:,.1f} h on {self.planned} (train.allow_fewer_processes=true if intended)"
            )
        return head + why + f". Launch {self.planned} processes: {self.command()}"

    def describe(self) -> str:
        needed = (
            f"at least {self.needed} to fit {self.limit_gb:g} GB per GPU"
            if self.needed
            else f"no process count fits {self.limit_gb:g} GB per GPU"
        )
        if not self.fits:
            verdict = f"refused: on {self.launched} process(es) it needs {self.on_launch.total_gb:.1f} GB per GPU"
        elif not self.accepted:
            hours = self.wall.on(self.launched).hours
            verdict = f"refused: on {self.launched} process(es) it takes about {hours:,.1f} h"
        elif self.launched < self.planned:
            verdict = "accepted (fewer processes, as train.allow_fewer_processes says)"
        else:
            verdict = "accepted"
        return (
            f"the plan is laid out for {self.planned} (train.gpus, {self.on_launch.strategy}; {needed}); "
            f"this launch has {self.launched}: {verdict}"
        )


def checkpoint_bytes_per_process(*, parameters: int, processes: int, strategy: str) -> float:
    """What the busiest process writes at a checkpoint: fp32 weights and AdamW's two moments (12 bytes a parameter),
    its 1/N shard under FSDP (sharded checkpoints), all of it from the main process under DDP."""
    return 12 * parameters / (processes if strategy == "fsdp" else 1)


def slurm_mem_gb_for(model, train, data, tasks_per_node: int, default: int = 64) -> int:
    """SLURM's `mem_gb` for one node of a fine-tune of `model` (composed config sections): the main process's node
    under the host estimate (GPU launch, `train.strategy`), plus `SLURM_MARGIN`; `default` for a model without
    shape facts (a local folder, an asset)."""
    shape, sizes = model.get("shape"), model.get("sizes") or {}
    vocab = sizes.get("vocab_size") or model.get("vocab_size")
    if not shape or not vocab:
        return default
    inner = sizes.get("intermediate_size") or model.get("intermediate_size") or 4 * shape["hidden_size"]
    p = parameter_count(
        shape["num_layers"],
        shape["hidden_size"],
        shape["num_heads"],
        shape["num_kv_heads"],
        shape["head_dim"],
        inner,
        vocab,
        bool(sizes.get("tied_embeddings", True)),
    )
    hub = data.get("source") == "hub"
    host = estimate_host_memory(
        parameters=p,
        processes=max(tasks_per_node, 1),
        strategy=train.get("strategy", "ddp"),
        largest_tensor=vocab * shape["hidden_size"],
        stream_parts=len(data.get("mixture") or ()) if hub else 0,
        stream_window_tokens=data.get("shuffle_rows", 0) * train.get("seq_len", 0) if hub else 0,
    )
    return host.slurm_mem_gb(tasks_per_node)
