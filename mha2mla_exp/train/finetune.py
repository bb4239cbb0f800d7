"""Full-parameter (or attention-only) causal-LM fine-tuning with checkpoints and resume.

Built on accelerate so that `accelerate launch -m mha2mla_exp ...` runs the same loop under DDP,
FSDP or DeepSpeed. The data order is a pure function of (seed, step), so a run resumed from its
last checkpoint sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from .schedule import warmup_constant_sqrt_decay

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"


class FineTuneDiverged(RuntimeError):
    """The loss went NaN/inf or exploded; the run is recorded as diverged."""

    def __init__(self, step: int, loss: float, reason: str):
        super().__init__(f"fine-tune diverged at step {step}: loss={loss} ({reason})")
        self.step, self.loss = step, loss


@dataclass(frozen=True)
class Budget:
    tokens_per_step: int
    steps: int

    @property
    def tokens(self) -> int:
        return self.tokens_per_step * self.steps


def plan_budget(train_cfg, *, pretrain_tokens: float | None, num_processes: int = 1) -> Budget:
    """Optimizer steps for the token budget (`pretrain_share_pct` of the pretraining tokens wins)."""
    per_step = train_cfg.seq_len * train_cfg.micro_batch_size * train_cfg.grad_accum * num_processes
    share = train_cfg.get("pretrain_share_pct")
    if share is not None:
        if not pretrain_tokens:
            raise ValueError("train.pretrain_share_pct needs model.pretrain_tokens")
        tokens = share / 100 * pretrain_tokens
    else:
        tokens = train_cfg.tokens
    return Budget(per_step, max(1, math.ceil(tokens / per_step)))


class _Rows(Dataset):
    """Fixed-length training rows, visited in a seeded order that is a function of the index alone."""

    def __init__(self, rows: torch.Tensor, length: int, seed: int):
        self.rows, self.length, self.seed = rows, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        epoch, j = divmod(i, len(self.rows))
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.rows[order[j]]


def rechunk(rows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Re-cut packed rows to `seq_len` (the packed stream is contiguous text, so this loses no order)."""
    flat = rows.reshape(-1)
    n = flat.numel() // seq_len
    if n == 0:
        raise ValueError(f"the training split has {flat.numel()} tokens, fewer than one sequence of {seq_len}")
    return flat[: n * seq_len].view(n, seq_len)


def finetune(
    model: torch.nn.Module,
    train_rows: torch.Tensor,
    train_cfg,
    run_dir: Path,
    *,
    seed: int,
    pretrain_tokens: float | None = None,
    on_log=None,
    periodic_eval=None,
    fail_at_step: int | None = None,
) -> dict:
    """Fine-tune `model` in place; return the `train` block of the run record.

    Checkpoints go to `run_dir/checkpoint` every `checkpoint_every` steps; when one exists the loop
    resumes from it. `on_log(record)` receives each logged step (the runner appends it to
    metrics.jsonl and W&B). `periodic_eval(model) -> dict`, when given and `train.eval_every` > 0,
    runs before the first step and every `eval_every` steps (a recovery curve within one run); its
    time is excluded from `seconds`. `fail_at_step` simulates a crash (tests of resume).
    """
    cuda = torch.cuda.is_available()
    precision = train_cfg.precision
    mixed = "bf16" if (precision == "bf16" or (precision == "auto" and cuda)) else "no"
    # the schedule counts optimizer steps: step it ourselves, once per real update, on every process
    accelerator = Accelerator(
        mixed_precision=mixed, gradient_accumulation_steps=train_cfg.grad_accum, cpu=not cuda,
        step_scheduler_with_optimizer=False,
    )
    budget = plan_budget(train_cfg, pretrain_tokens=pretrain_tokens, num_processes=accelerator.num_processes)
    rows = rechunk(train_rows, train_cfg.seq_len)
    micro_batches = budget.steps * train_cfg.grad_accum
    dataset = _Rows(rows, micro_batches * train_cfg.micro_batch_size * accelerator.num_processes, seed)
    loader = DataLoader(dataset, batch_size=train_cfg.micro_batch_size, shuffle=False)

    if train_cfg.freeze_non_attention:
        for name, p in model.named_parameters():
            p.requires_grad_(".self_attn." in name)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 else decay).append(p)  # no decay on biases and norm weights
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=train_cfg.eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_constant_sqrt_decay(budget.steps, train_cfg.warmup_steps, train_cfg.decay_fraction)
    )
    model.train()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ckpt = Path(run_dir) / CHECKPOINT_DIR
    step, first_loss, elapsed_before = 0, None, 0.0
    if (ckpt / "progress.json").exists():
        accelerator.load_state(str(ckpt))
        progress = json.loads((ckpt / "progress.json").read_text())
        step, first_loss, elapsed_before = progress["step"], progress["first_loss"], progress["elapsed_s"]
        log.info("resuming fine-tune from step %d/%d", step, budget.steps)
    batches = accelerator.skip_first_batches(loader, step * train_cfg.grad_accum) if step else loader

    eval_every = int(train_cfg.get("eval_every") or 0) if periodic_eval else 0

    def evaluate_now(at_step: int, elapsed_s: float) -> float:
        """Run the probe, log it; return the seconds it took (kept out of the training time)."""
        t = time.perf_counter()
        model.eval()
        with torch.no_grad():
            result = periodic_eval(accelerator.unwrap_model(model))
        model.train()
        if on_log:
            on_log({"step": at_step, "tokens": at_step * budget.tokens_per_step, "elapsed_s": round(elapsed_s, 3)}
                   | result)
        return time.perf_counter() - t

    if eval_every and step == 0:
        evaluate_now(0, 0.0)
    eval_seconds = 0.0  # probe time inside the loop below
    start = time.perf_counter()
    running, n_micro, last_loss = 0.0, 0, float("nan")
    bar = tqdm(total=budget.steps, initial=step, desc="fine-tune", unit="step", disable=not accelerator.is_main_process)
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            accelerator.backward(loss)
            running += loss.detach().float().item()
            n_micro += 1
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), train_cfg.clip)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        last_loss, running, n_micro = running / n_micro, 0.0, 0
        first_loss = last_loss if first_loss is None else first_loss
        elapsed = elapsed_before + time.perf_counter() - start - eval_seconds
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}")
        if step % train_cfg.log_every == 0 or step == budget.steps:
            record = {"step": step, "tokens": step * budget.tokens_per_step, "loss": last_loss,
                      "lr": scheduler.get_last_lr()[0], "elapsed_s": round(elapsed, 3)}
            if on_log:
                on_log(record)
        if not math.isfinite(last_loss):
            raise FineTuneDiverged(step, last_loss, "not finite")
        if last_loss > train_cfg.divergence_factor * first_loss:
            raise FineTuneDiverged(step, last_loss, f"above {train_cfg.divergence_factor} x first loss {first_loss:.3f}")
        if eval_every and (step % eval_every == 0 or step == budget.steps):
            eval_seconds += evaluate_now(step, elapsed)
        if train_cfg.checkpoint_every and step % train_cfg.checkpoint_every == 0 and step < budget.steps:
            _save_checkpoint(accelerator, ckpt, step, first_loss, elapsed)
        if fail_at_step is not None and step == fail_at_step:
            raise RuntimeError(f"simulated crash at step {step}")
    bar.close()
    seconds = elapsed_before + time.perf_counter() - start - eval_seconds
    model = accelerator.unwrap_model(model)
    throughput = step * budget.tokens_per_step / max(seconds, 1e-9)
    flops = _train_flops_per_token(model, train_cfg.seq_len) * throughput
    model.eval()
    if ckpt.exists():
        shutil.rmtree(ckpt)  # the finished run needs no resume point
    return {
        "tokens": step * budget.tokens_per_step,
        "steps": step,
        "final_loss": last_loss,
        "first_loss": first_loss,
        "pretrain_share_pct": 100 * step * budget.tokens_per_step / pretrain_tokens if pretrain_tokens else None,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(throughput, 1),
        "achieved_tflops": round(flops / 1e12, 4),
        "mfu": _mfu(flops, accelerator),
        "precision": mixed if mixed != "no" else "fp32",
        "processes": accelerator.num_processes,
    }


# dense bf16 tensor-core peaks (no sparsity), per device; MFU is left empty elsewhere (CPUs)
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def _train_flops_per_token(model, seq_len: int) -> float:
    """6N for the weights plus 12 * L * d_attn * T for attention scores and mixing (PaLM's estimate)."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6 * n + attn


def _mfu(flops_per_s: float, accelerator: Accelerator) -> float | None:
    if accelerator.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(accelerator.device)
    peak = next((v for k, v in _PEAK_FLOPS.items() if k in name), None)
    return round(flops_per_s / (peak * accelerator.num_processes), 4) if peak else None


def _save_checkpoint(accelerator: Accelerator, ckpt: Path, step: int, first_loss: float, elapsed: float) -> None:
    """Write the state next to the old one, then swap, so a crash mid-save keeps the previous checkpoint."""
    tmp = ckpt.with_name(CHECKPOINT_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    accelerator.save_state(str(tmp), safe_serialization=False)  # tied embeddings share storage
    (tmp / "progress.json").write_text(json.dumps({"step": step, "first_loss": first_loss, "elapsed_s": elapsed}))
    if accelerator.is_main_process:
        old = ckpt.with_name(CHECKPOINT_DIR + ".old")
        if ckpt.exists():
            ckpt.rename(old)
        tmp.rename(ckpt)
        if old.exists():
            shutil.rmtree(old)
