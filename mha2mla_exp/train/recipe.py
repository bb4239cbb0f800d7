"""The recovery fine-tune as a recipe whose steps read in order: setup -> resume -> (step -> log -> checkpoint)*
-> finish (as torchtune writes its recipes).

On accelerate, so `accelerate launch` / `torchrun` run the same loop under DDP, or with `train.strategy=fsdp`
fully sharded (`train.sharding`): every process trains; only the main process logs and writes. The rows a step
reads are a pure function of (seed, step) (`data.rows`), laid out so N processes with the same global batch see what one
process sees with N times the gradient accumulation: the same losses. Checkpoints are written by all
processes into a temporary folder and swapped in by the main one between barriers, so a crash, a kill or a
SLURM requeue resumes from the last complete one (`recover_checkpoint`: also when the swap was cut).
Resume unpickles nothing this project wrote: weights, optimizer and RNG states are read weights-only
(`torch.load(weights_only=True)`, accelerate's default), the lr schedule's state is JSON in progress.json. (Under
FSDP, torch's DCP `.metadata` is a pickle by torch's design: a checkpoint folder is trusted like code.)

A time-limit or preemption signal (`STOP_SIGNALS`: SLURM's and submitit's SIGUSR2, SIGTERM) only sets a flag;
at the next step boundary every process checkpoints, and then the signal's own handler runs (submitit's
requeues the job) or, where there is none, `TrainingStopped` ends the run for a relaunch to resume: a
requeue loses no step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.profiler import record_function
from tqdm.auto import tqdm

from .. import atomic
from ..data.rows import local_rows
from ..faults import fault_point
from ..schema.sections import ObjectiveConfig, TrainConfig
from . import sharding
from .budget import PEAK_BF16_FLOPS, flops_per_token, plan_budget, pretrain_share_pct
from .loss_head import loss_head_for
from .master_weights import MasterWeights
from .objectives import Objective, build_objective
from .optimizer import adamw
from .precision import Precision
from .schedule import schedule_for

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
DIVERGENCE_FLOOR = 1.0  # nats: below it a rising loss is not called diverged
KILL_AT_STEP_ENV = "MHA2MLA_KILL_AT_STEP"  # tests only: SIGKILL every process right after that step
PEAK_RSS_DIR_ENV = "MHA2MLA_PEAK_RSS_DIR"  # tests only: each process writes its peak host memory into this folder
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class FineTuneDiverged(RuntimeError):
    """The loss went NaN/inf or exploded; the run is recorded as diverged."""

    def __init__(self, step: int, loss: float, reason: str):
        super().__init__(f"fine-tune diverged at step {step}: loss={loss} ({reason})")
        self.step, self.loss = step, loss


class TrainingStopped(BaseException):
    """A stop signal arrived; the fine-tune checkpointed at the step boundary after it and ends here (a
    BaseException, like KeyboardInterrupt: the run is recorded as interrupted, and a sweep does not go on)."""


class StopSignals:
    """Turns STOP_SIGNALS into a flag polled at step boundaries; `chained(signum)` runs the handler that was
    installed before (submitit's requeue), if any. Installed only in the main thread (where Python allows it)."""

    def __init__(self):
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._flag)
        return self

    def _flag(self, signum, frame) -> None:
        log.warning("%s received: checkpointing at the end of this step", signal.Signals(signum).name)
        self.received = signum

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def chained(self, signum: int) -> None:
        handler = self.previous.get(signum)
        if callable(handler):
            handler(signum, None)  # submitit: requeue, then exit (rank 0) or return (the other tasks)
        raise TrainingStopped(f"{signal.Signals(signum).name}: checkpointed for a relaunch to resume")


class FineTuneRecipe:
    """One fine-tune of `model` on `rows` (a `data.rows` source) under the `train` section; `run()` executes the
    steps below in order."""

    def __init__(
        self,
        model,
        rows,
        train: TrainConfig,
        checkpoint_root: Path,
        *,
        precision: Precision,
        seed: int,
        objective: Objective | ObjectiveConfig | None = None,
        teacher=None,
        pretrain_tokens: float | None = None,
        on_log=None,
        probe=None,
        fail_at_step: int | None = None,
        device: torch.device | None = None,
    ):
        self.model, self.rows, self.train = model, rows, train
        # where to train: the model's own device unless given (under FSDP the other processes' model is on meta)
        self.device = device
        self.ckpt = Path(checkpoint_root) / CHECKPOINT_DIR
        self.precision, self.seed, self.pretrain_tokens = precision, seed, pretrain_tokens
        self.objective = (
            objective if isinstance(objective, Objective) else build_objective(objective or ObjectiveConfig())
        )
        if self.objective.needs_teacher and teacher is None:
            raise ValueError(f"objective {self.objective.name!r} needs the original model as teacher")
        self.teacher = teacher if self.objective.needs_teacher else None
        self.on_log, self.probe, self.fail_at_step = on_log, probe, fail_at_step
        self.step_count, self.first_loss, self.last_loss = 0, None, float("nan")
        self.elapsed_before, self.probe_seconds = 0.0, 0.0
        self.probe_results: dict[int, dict] = {}
        self.resumed_from: int | None = None
        self.sharded = False  # FSDP: set by setup() where train.strategy=fsdp in a launch with a process group
        self.checkpointed_at: int | None = None

    # -------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        train, precision = self.train, self.precision
        # precision is ours (train.precision), never accelerate's: mixed_precision="no" and our own autocast
        device = (
            self.device or next(self.model.parameters()).device
        )  # the runner placed it (device=cpu on a GPU host too)
        self.accelerator = acc = Accelerator(mixed_precision="no", cpu=device.type == "cpu")
        set_seed(self.seed)  # anything the step draws (dropout, sampling); resume restores the RNG states after it
        self.budget = plan_budget(train, pretrain_tokens=self.pretrain_tokens, num_processes=acc.num_processes)
        if acc.num_processes > 1 and hasattr(self.rows, "read_on_main_process_only"):  # a stream: read it once
            import torch.distributed as td

            self.rows.read_on_main_process_only(acc.is_main_process, td.new_group(backend="gloo"))
        model = self.model.to(dtype=precision.param_dtype)
        if train.activation_checkpointing:  # recompute each layer in the backward: memory for compute
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if train.freeze_non_attention:
            for name, p in model.named_parameters():
                p.requires_grad_(".self_attn." in name)
        self.sharded = sharding.shards(train)
        if self.sharded:  # before the optimizer: sharding replaces the parameters
            # the main process's weights, taken before sharding (the others hold the model on the meta device)
            main_weights = model.state_dict() if acc.is_main_process else None
            sharding.shard(model, acc.device.type, acc.num_processes)
            if acc.num_processes > 1:
                sharding.take_shards_from_main(model, main_weights, acc.device)
            main_weights = None
        trained = [p for p in model.parameters() if p.requires_grad]
        self.master = MasterWeights(trained) if precision.separate_master_copy else None
        targets = self.master.master if self.master else trained
        decay = [t for p, t in zip(trained, targets) if p.dim() >= 2]  # no decay on biases and norm weights
        no_decay = [t for p, t in zip(trained, targets) if p.dim() < 2]
        optimizer = adamw(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], train
        )
        schedule = schedule_for(train, self.budget.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.multiplier(step))
        model.train()
        self.loss_head = loss_head_for(model, train.fused_loss)
        if train.compile:  # inductor: fused kernels on CPU and GPU; the first steps pay the compilation.
            # The decoder, not the whole causal LM: the output layer and the loss stay eager (train/loss_head.py)
            model.model.forward = torch.compile(model.model.forward, dynamic=False)
        if self.master:  # the optimizer steps on the master copies, which no process shares: checkpointed by us
            self.model = acc.prepare(model)
            self.optimizer = optimizer
        elif self.sharded:  # FSDP2 syncs its own gradients; the checkpoint holds each process's shards
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)
        if self.teacher is not None:
            self.teacher.eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------------- resume
    def resume(self) -> None:
        if self.accelerator.is_main_process:
            recover_checkpoint(self.ckpt)
        self.accelerator.wait_for_everyone()
        progress = self.ckpt / "progress.json"
        if not progress.exists():
            return
        self.accelerator.load_state(str(self.ckpt))
        if self.sharded:
            sharding.load_sharded(self.model, self.optimizer, self.ckpt / sharding.SHARDED_STATE_DIR)
        state = json.loads(progress.read_text())
        own = self._own_state()
        for index, (name, obj) in enumerate(own.items()):
            path = self.ckpt / f"{name}.pt"
            if not path.exists():  # written before resume stopped unpickling: the same plain state dict
                path = self.ckpt / f"custom_checkpoint_{index}.pkl"
            obj.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        else:  # an older checkpoint: accelerate's pickle of the same state, read weights-only
            legacy = self.ckpt / f"custom_checkpoint_{len(own)}.pkl"
            self.scheduler.load_state_dict(torch.load(legacy, map_location="cpu", weights_only=True))
        self.step_count, self.first_loss, self.elapsed_before = state["step"], state["first_loss"], state["elapsed_s"]
        self.probe_results = {int(k): v for k, v in state.get("probes", {}).items()}
        self.rows.load_state_dict(state.get("rows", {}))
        self.resumed_from = self.step_count
        log.info("resuming fine-tune from step %d/%d", self.step_count, self.budget.steps)

    def _own_state(self) -> dict:
        """What accelerate does not checkpoint here (bf16-master's optimizer and fp32 copies), by file name."""
        return {"optimizer": self.optimizer, "master_weights": self.master} if self.master else {}

    # --------------------------------------------------------------------------------------------- step
    def _compute(self):
        if self.precision.autocast:
            return torch.autocast(self.accelerator.device.type, dtype=self.precision.compute_dtype)
        return contextlib.nullcontext()

    def step(self) -> float:
        """One optimizer update over `grad_accum` micro-batches; returns the mean loss over all processes."""
        acc, train = self.accelerator, self.train
        rows = self.rows.step_rows(self.step_count, self.budget.rows_per_step)
        total = torch.zeros((), device=acc.device)
        for micro in range(train.grad_accum):
            batch = local_rows(rows, micro, acc.process_index, acc.num_processes, train.micro_batch_size)
            batch = batch.to(acc.device)
            teacher_outputs = None
            if self.teacher is not None:
                with torch.no_grad(), record_function("teacher"):
                    teacher_outputs = self.loss_head.teacher_outputs(self.teacher, batch)
            last = micro == train.grad_accum - 1
            if self.sharded:
                self.model.set_requires_gradient_sync(last)
            no_sync = contextlib.nullcontext() if last or self.sharded else acc.no_sync(self.model)
            with no_sync, self._compute(), record_function("forward"):
                loss = self.loss_head(self.model, batch, self.objective, teacher_outputs) / train.grad_accum
            with record_function("backward"):
                acc.backward(loss)
            total += loss.detach().float()
        with record_function("optimizer"):
            if self.master:
                self.master.grads_to_master()
                torch.nn.utils.clip_grad_norm_(self.master.master, train.clip)
            elif self.sharded:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.clip)
            else:
                acc.clip_grad_norm_(self.model.parameters(), train.clip)
            self.step_lr = self.scheduler.get_last_lr()[0]  # the lr this update used (logged with it)
            self.optimizer.step()
            if self.master:
                self.master.master_to_model()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
        self.step_count += 1
        return acc.reduce(total, "mean").item()

    # ---------------------------------------------------------------------------------------------- log
    def log(self, loss: float, elapsed: float, probe: dict | None = None) -> None:
        """One line per logged step (every `log_every` steps, the last one, and any step that was probed)."""
        if self.step_count % self.train.log_every and self.step_count != self.budget.steps and not probe:
            return
        record = {
            "step": self.step_count,
            "tokens": self.budget.tokens_after(self.step_count),
            "loss": loss,
            "lr": self.step_lr,
            "elapsed_s": round(elapsed, 3),
        } | (probe or {})
        if self.on_log and self.accelerator.is_main_process:
            self.on_log(record)

    def divergence(self, loss: float) -> str | None:
        """Why the loss counts as diverged (NaN/inf, or `divergence_factor` x the first loss), or None."""
        if not math.isfinite(loss):
            return "not finite"
        # the floor keeps a distillation that starts near 0 (a near-exact conversion) from counting as diverged
        if loss > self.train.divergence_factor * max(self.first_loss, DIVERGENCE_FLOOR):
            return f"above {self.train.divergence_factor} x first loss {self.first_loss:.3f}"
        return None

    def maybe_probe(self) -> dict | None:
        """Held-out perplexity before the first step, every `eval_every` steps and after the last (main process;
        every process when sharded, since each holds a piece of every weight)."""
        every = self.train.eval_every
        at = self.step_count
        due = at in (0, self.budget.steps) or (every and at % every == 0)
        here = self.accelerator.is_main_process or self.sharded
        if not self.probe or not due or at in self.probe_results or not here:
            return None
        t = time.perf_counter()
        model = self.model if self.sharded else self.accelerator.unwrap_model(self.model)
        model.eval()
        with torch.no_grad():  # in the weights' own dtype, never under autocast
            result = self.probe(model)
        model.train()
        self.probe_results[at] = result
        self.probe_seconds += time.perf_counter() - t
        return result

    # --------------------------------------------------------------------------------------- checkpoint
    def checkpoint(self, elapsed: float) -> None:
        """All processes write into checkpoint.tmp; the main one swaps it in: a crash keeps the previous one."""
        acc = self.accelerator
        tmp = self.ckpt.with_name(CHECKPOINT_DIR + ".tmp")
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=False)  # tied embeddings share storage
        if self.sharded:  # collective: each process writes its own shards, none the whole state
            sharding.save_sharded(self.model, self.optimizer, tmp / sharding.SHARDED_STATE_DIR)
        if acc.is_main_process:  # the same on every process: written once, read by all
            for name, obj in self._own_state().items():
                torch.save(obj.state_dict(), tmp / f"{name}.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            fault_point("checkpoint.written")
            progress = {
                "step": self.step_count,
                "first_loss": self.first_loss,
                "elapsed_s": elapsed,
                "probes": self.probe_results,
                "rows": self.rows.state_dict(),
                "scheduler": self.scheduler.state_dict(),  # plain numbers: no pickle to load on resume
            }
            atomic.write_text(tmp / "progress.json", json.dumps(progress))
            fault_point("checkpoint.progress_written")
            old = self.ckpt.with_name(CHECKPOINT_DIR + ".old")
            if self.ckpt.exists():
                self.ckpt.rename(old)
                fault_point("checkpoint.moved_aside")
            tmp.rename(self.ckpt)
            fault_point("checkpoint.swapped")
            if old.exists():
                shutil.rmtree(old)
        acc.wait_for_everyone()
        self.checkpointed_at = self.step_count

    # ------------------------------------------------------------------------------------------- finish
    def finish(self, seconds: float) -> dict:
        acc = self.accelerator
        model = acc.unwrap_model(self.model)
        flops_per_token = train_flops_per_token(model, self.train.seq_len)  # a DTensor counts its whole shape
        if self.sharded:  # gathered to the main process alone, which keeps a plain copy on the training device
            self.optimizer.state.clear()  # AdamW's moments are done with: room on the device for the plain copy
            model = sharding.gathered_copy(self.model, acc.device, acc.is_main_process)  # None on the others
        if model is None:  # the other processes keep nothing: the runner evaluates on the main one
            self.model = self.optimizer = None
        else:
            self._plain_for_evaluation(model)
        note_peak_rss("after_training")
        step, budget = self.step_count, self.budget
        tokens = budget.tokens_after(step)
        throughput = tokens / max(seconds, 1e-9)
        flops = flops_per_token * throughput
        rows_read = step * budget.rows_per_step
        epochs = self.rows.epochs(rows_read)
        return {
            "tokens": tokens,
            "steps": step,
            "final_loss": self.last_loss,
            "first_loss": self.first_loss,
            "objective": self.objective.name,
            "pretrain_share_pct": pretrain_share_pct(tokens, self.pretrain_tokens or None),
            "seconds": round(seconds, 3),
            "tokens_per_s": round(throughput, 1),
            "achieved_tflops": round(flops / 1e12, 4),
            "mfu": _mfu(flops, acc),
            "precision": self.precision.to_record(),
            "processes": acc.num_processes,
            "strategy": "fsdp" if self.sharded else "ddp" if acc.num_processes > 1 else "single",
            "compiled": self.train.compile,
            "loss_path": self.loss_head.name,
            "optimizer_impl": self.train.optimizer_impl,
            "resumed_from_step": self.resumed_from,
            "load_avg_5m": _load_avg(),  # a shared machine slows every timing: say how shared it was
            "data": {"rows_read": rows_read, "epochs": epochs, "fresh_tokens": epochs is None or epochs <= 1.0}
            | _mixture_read(self.rows),
            "heldout_ppl_probe": {str(k): v.get("heldout_ppl_probe") for k, v in sorted(self.probe_results.items())}
            or None,
            "probe_dtype": str(self.precision.param_dtype).removeprefix("torch."),  # the weights' own, no autocast
        }

    def _plain_for_evaluation(self, model) -> None:
        """`model` (unwrapped or unsharded) as the runner keeps and evaluates it."""
        if "forward" in vars(model.model):  # the compiled forward: evaluation's many shapes would recompile it
            del model.model.forward
        if self.master:
            self.master.restore_fp32(model)  # keep the exact trained weights, not their bf16 rounding
        model.eval()
        self.model = model

    # ---------------------------------------------------------------------------------------------- run
    def run(self) -> dict:
        self.setup()
        self.resume()
        acc, total = self.accelerator, self.budget.steps
        start = time.perf_counter()

        def elapsed() -> float:
            return self.elapsed_before + time.perf_counter() - start - self.probe_seconds

        before = self.maybe_probe()
        if before and self.on_log and acc.is_main_process:
            self.on_log({"step": 0, "tokens": 0, "elapsed_s": 0.0} | before)
        bar = tqdm(total=total, initial=self.step_count, desc="fine-tune", unit="step", disable=not acc.is_main_process)
        with StopSignals() as stop:
            while self.step_count < total:
                self._advance(bar, elapsed)
                if self._stop_requested(stop) and self.step_count < total:
                    if self.checkpointed_at != self.step_count:
                        self.checkpoint(elapsed())
                    bar.close()
                    stop.chained(stop.received or STOP_SIGNALS[0])
        bar.close()
        return self.finish(elapsed())

    def _stop_requested(self, stop: StopSignals) -> bool:
        """Whether any process got a stop signal (they checkpoint together, so they must agree)."""
        flag = torch.tensor(float(stop.received is not None), device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item())

    def _advance(self, bar, elapsed) -> None:
        """One step, its log line and probe, the divergence check and the periodic checkpoint."""
        total = self.budget.steps
        loss = self.step()
        self.last_loss = loss
        self.first_loss = loss if self.first_loss is None else self.first_loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        diverged = self.divergence(loss)
        self.log(loss, elapsed(), None if diverged else self.maybe_probe())
        if diverged:
            raise FineTuneDiverged(self.step_count, loss, diverged)
        every = self.train.checkpoint_every
        if every and self.step_count % every == 0 and self.step_count < total:
            self.checkpoint(elapsed())
        if self.fail_at_step is not None and self.step_count == self.fail_at_step:
            raise RuntimeError(f"simulated crash at step {self.step_count}")
        if os.environ.get(KILL_AT_STEP_ENV) == str(self.step_count):
            os.kill(os.getpid(), signal.SIGKILL)  # a hard kill: no handler, no cleanup (tests of resume)


def finetune(model, rows, train: TrainConfig, checkpoint_root: Path, **kwargs) -> tuple[torch.nn.Module, dict]:
    """Run a `FineTuneRecipe`; returns (the trained, unwrapped model, the record's `train` block)."""
    recipe = FineTuneRecipe(model, rows, train, checkpoint_root, **kwargs)
    record = recipe.run()
    return recipe.model, record


def recover_checkpoint(ckpt: Path) -> None:
    """Make `ckpt` the newest complete checkpoint. A process stopped inside the swap of `checkpoint()` leaves
    `checkpoint.tmp` complete (its progress.json is written last) and `checkpoint.old` holding the previous one,
    with no `checkpoint`; resume takes the newer of the two instead of starting again from step 0."""
    if not (ckpt / "progress.json").exists():
        for name in (CHECKPOINT_DIR + ".tmp", CHECKPOINT_DIR + ".old"):
            candidate = ckpt.with_name(name)
            if (candidate / "progress.json").exists():
                if ckpt.exists():
                    shutil.rmtree(ckpt)
                candidate.rename(ckpt)
                log.info("recovered the checkpoint from %s (its swap was interrupted)", candidate.name)
                break
    old = ckpt.with_name(CHECKPOINT_DIR + ".old")
    if old.exists() and (ckpt / "progress.json").exists():  # the next swap renames `checkpoint` onto it
        shutil.rmtree(old)


def note_peak_rss(stage: str) -> None:
    """Tests only (`PEAK_RSS_DIR_ENV`): this process's peak resident memory so far, as `<stage>` of rank<N>.json."""
    folder = os.environ.get(PEAK_RSS_DIR_ENV)
    if not folder:
        return
    import resource

    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}.json"
    notes = json.loads(path.read_text()) if path.exists() else {}
    notes[stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    atomic.write_text(path, json.dumps(notes))


def remove_checkpoint(checkpoint_root: Path) -> None:
    """The resume point of a finished fine-tune (its weights are saved by the runner first)."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".tmp", CHECKPOINT_DIR + ".old"):
        path = Path(checkpoint_root) / name
        if path.exists():
            shutil.rmtree(path)


# dense bf16 tensor-core peaks (no sparsity), per device; MFU is left empty elsewhere (CPUs)
def train_flops_per_token(model, seq_len: int) -> float:
    """budget.flops_per_token of the model as built (its parameters counted)."""
    cfg = model.config
    return flops_per_token(
        parameters=sum(p.numel() for p in model.parameters()),
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        seq_len=seq_len,
    )


def _mixture_read(rows) -> dict:
    """A streamed mixture's tokens read per part (against the record's data.mixture.token_shares); {} otherwise."""
    read = getattr(rows, "mixture_read", lambda: None)()
    return {"mixture_read": read} if read is not None else {}


def _load_avg() -> float | None:
    try:
        return round(os.getloadavg()[1], 2)
    except OSError:
        return None


def _mfu(flops_per_s: float, accelerator: Accelerator) -> float | None:
    if accelerator.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(accelerator.device)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return round(flops_per_s / (peak * accelerator.num_processes), 4) if peak else None
