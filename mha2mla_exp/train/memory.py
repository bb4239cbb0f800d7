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
runs there, checkpoints are written and read one tensor at a time (FSDP: each process its own shards), so a process
holds little beyond its interpreter, torch and the CUDA libraries (`HOST_RUNTIME_BYTES`). The exception: at the end
of an FSDP fine-tune the main process gathers the trained weights on the host (4 bytes a parameter) to build the
plain model it saves. (A CPU run holds the original and the conversion on the main process, 8 bytes a parameter;
under FSDP the others build the model on the meta device and receive their shards: train/sharding.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .loss_head import CHUNK_ROWS

GB = 1e9
STRATEGIES = ("ddp", "fsdp")
CONTEXT_BYTES = 1.5e9
SLACK = 0.10
HOST_RUNTIME_BYTES = 3e9  # python, torch, CUDA libraries and the tokenizer, resident in every process
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

    @staticmethod
    def _total(parts: dict) -> float:
        return (sum(parts.values()) + HOST_RUNTIME_BYTES) * (1 + SLACK)

    @property
    def main_gb(self) -> float:
        return self._total(self.main) / GB

    @property
    def other_gb(self) -> float:
        return self._total(self.other) / GB if self.processes > 1 else 0.0

    def node_gb(self, processes_per_node: int) -> float:
        """The node that holds the main process and `processes_per_node - 1` others."""
        return self.main_gb + (min(processes_per_node, self.processes) - 1) * self.other_gb

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.main.items()) or "the weights stay on its GPU"
        text = f"main process {self.main_gb:.1f} GB ({parts})"
        if self.processes > 1:
            others = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.other.items()) or "the runtime alone"
            text += (
                f", each of the other {self.processes - 1} {self.other_gb:.1f} GB ({others}); "
                f"{self.node_gb(self.processes):.1f} GB for all {self.processes} on one node"
            )
        return text + f" (+ {HOST_RUNTIME_BYTES / GB:.0f} GB runtime each and {SLACK:.0%} slack)"


def estimate_host_memory(*, parameters: int, processes: int, strategy: str = "ddp") -> HostEstimate:
    """Host (CPU) memory per process of a fine-tune on GPUs of a model of `parameters` (see the module docstring)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy: unknown {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    main = {"gathered weights at the end": 4 * parameters} if strategy == "fsdp" and processes > 1 else {}
    return HostEstimate(strategy, processes, main, {})


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
    """The processes a fine-tune's plan is laid out for (`train.gpus`) against those this launch has."""

    planned: int
    launched: int
    needed: int | None  # the fewest processes whose per-GPU memory fits, None: no count does
    on_launch: MemoryEstimate  # per GPU with this launch's processes
    limit_gb: float

    @property
    def fits(self) -> bool:
        return self.on_launch.total_gb <= self.limit_gb

    def describe(self) -> str:
        needed = (
            f"at least {self.needed} to fit {self.limit_gb:g} GB per GPU"
            if self.needed
            else f"no process count fits {self.limit_gb:g} GB per GPU"
        )
        verdict = (
            "accepted"
            if self.fits
            else f"refused: on {self.launched} process(es) it needs {self.on_launch.total_gb:.1f} GB per GPU"
        )
        return (
            f"the plan is laid out for {self.planned} (train.gpus, {self.on_launch.strategy}; {needed}); "
            f"this launch has {self.launched}: {verdict}"
        )


def checkpoint_bytes_per_process(*, parameters: int, processes: int, strategy: str) -> float:
    """What the busiest process writes at a checkpoint: fp32 weights and AdamW's two moments (12 bytes a parameter),
    its 1/N shard under FSDP (sharded checkpoints), all of it from the main process under DDP."""
    return 12 * parameters / (processes if strategy == "fsdp" else 1)
