"""The fine-tune's token budget: optimizer steps for `train.tokens` (or a share of the model's pretraining
tokens), their share of pretraining, and passes over a finite corpus. The one planner: the dry run, the
pre-load corpus check and the recipe all read it.

The paper's claim is recovery with 0.3-0.6 % of the pretraining tokens (SmolLM-135M: 18k steps x 64 sequences
x 2,048 tokens = 2.36B tokens = 0.39 % of 600B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema.sections import TrainConfig


@dataclass(frozen=True)
class Budget:
    tokens_per_step: int  # every row is packed (no padding), so every position counts
    steps: int
    rows_per_step: int  # the global batch: micro-batch x accumulation x processes

    @property
    def tokens(self) -> int:
        return self.tokens_after(self.steps)

    def tokens_after(self, steps: int) -> int:
        return self.tokens_per_step * steps


def plan_budget(train: TrainConfig, *, pretrain_tokens: float | None, num_processes: int = 1) -> Budget:
    """The fewest optimizer steps that read the token budget (`pretrain_share_pct` of the pretraining tokens
    wins over `tokens` when set)."""
    sizes = (train.micro_batch_size, train.grad_accum, num_processes, train.seq_len)
    if min(sizes) < 1:  # grad_accum and the processes are known only here; the others guard a division
        raise ValueError(f"train: micro_batch_size, grad_accum, processes and seq_len must be positive, got {sizes}")
    rows = train.micro_batch_size * train.grad_accum * num_processes
    per_step = train.seq_len * rows
    if train.pretrain_share_pct is not None:
        if not pretrain_tokens:
            raise ValueError("train.pretrain_share_pct needs model.pretrain_tokens")
        tokens = train.pretrain_share_pct / 100 * pretrain_tokens
    else:
        tokens = train.tokens
    return Budget(per_step, max(1, math.ceil(tokens / per_step)), rows)


def pretrain_share_pct(tokens: int | float, pretrain_tokens: int | float | None) -> float | None:
    """`tokens` as a percentage of the model's pretraining tokens (None when that is unknown)."""
    if pretrain_tokens is None:
        return None
    if pretrain_tokens <= 0:
        raise ValueError(f"pretrain_tokens must be positive, got {pretrain_tokens}")
    return 100.0 * tokens / pretrain_tokens


def check_epochs(tokens: int, available: int | None, epochs_allowed) -> float | None:
    """Epochs a budget makes over a finite corpus; ValueError unless `epochs_allowed` permits repeating text.

    `epochs_allowed`: false (one pass at most), true (any), or a number (at most that many passes).
    A stream (`available` None) never repeats.
    """
    if available is None:
        return None
    epochs = tokens / available
    limit = 1.0 if not epochs_allowed else (float("inf") if epochs_allowed is True else float(epochs_allowed))
    if epochs > limit:
        raise ValueError(
            f"train.tokens: the budget of {tokens:,} tokens is {epochs:.2f} passes over the {available:,} training "
            f"tokens of this corpus (allowed: {limit:g}); fine-tuning would repeat text. Lower the budget, stream a "
            "corpus (data=smollm_corpus), or set train.epochs_allowed=true (or a number of passes)"
        )
    return epochs


# ---- wall time: a plan is checked for time as well as memory --------------------------------------------------------
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}  # dense


def flops_per_token(*, parameters: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12 * L * d_attn * T for attention scores and mixing
    (PaLM's estimate)."""
    return 6 * parameters + 12 * num_layers * num_heads * head_dim * seq_len


# The one measured training throughput on a GPU, and where it comes from; every other model and GPU kind is scaled
# from it by FLOPs per token and the GPU's bf16 peak (the same MFU). A 135M model keeps a GPU busy worse than a
# large one, so for the 1.7B and the 7B the times below are upper bounds.
REFERENCE_THROUGHPUT = {
    "gpu": "H200",
    "tokens_per_s": 105_000,
    "shape": {"parameters": 134_515_008, "num_layers": 30, "num_heads": 9, "head_dim": 64, "seq_len": 512},
    "source": "SmolLM2-135M's shape, bf16 autocast with fp32 master weights, AdamW, batch 32 x 512, no compile, "
    "torch 2.11 + CUDA 13, one H200, 2026-11-30 (docs/PAPER_SCALE.md section 5)",
}


def reference_mfu() -> float:
    ref = REFERENCE_THROUGHPUT
    return ref["tokens_per_s"] * flops_per_token(**ref["shape"]) / PEAK_BF16_FLOPS[ref["gpu"]]


def gpu_kind_of(name: str) -> str | None:
    """The table's GPU kind in a device name ('NVIDIA H100 80GB HBM3' -> 'H100'), None when not in the table."""
    return next((kind for kind in PEAK_BF16_FLOPS if kind in name), None)


@dataclass(frozen=True)
class WallTime:
    """A fine-tune's expected wall time on `processes` GPUs of `gpu` (the reference throughput's MFU)."""

    tokens: int
    flops_per_token: float
    processes: int
    gpu: str

    @property
    def tokens_per_s(self) -> float:
        return self.processes * reference_mfu() * PEAK_BF16_FLOPS[self.gpu] / self.flops_per_token

    @property
    def hours(self) -> float:
        return self.tokens / self.tokens_per_s / 3600

    def on(self, processes: int) -> WallTime:
        return WallTime(self.tokens, self.flops_per_token, processes, self.gpu)

    def describe(self) -> str:
        ref = REFERENCE_THROUGHPUT
        return (
            f"about {self.hours:,.1f} h on {self.processes} {self.gpu} ({self.tokens_per_s:,.0f} tokens/s: "
            f"{reference_mfu():.1%} MFU of {PEAK_BF16_FLOPS[self.gpu] / 1e12:.0f} TFLOP/s bf16 per GPU, "
            f"from {ref['tokens_per_s']:,} tokens/s measured on one {ref['gpu']} (train/budget.py "
            "REFERENCE_THROUGHPUT); an upper bound for models larger than 135M)"
        )
