"""One run, end to end: validate -> data -> (load -> calibrate -> convert -> distill -> fine-tune -> keep) or
reuse the kept trained model -> measure -> evaluate -> record. Finished runs are skipped, interrupted ones resume.

One lock per run folder (runner/lock.py) is taken before the record is read and held to the final record: a second
launch of a setting that runs ends at once with status `busy` (`run_busy=wait`: it waits), a dead run's lock is
taken over, and a finished record is replaced only when asked (`rerun=true`).

Rank-aware: under `torchrun` / `accelerate launch` every process validates, loads, trains and evaluates (each
its share of the lm-eval suites' documents, on its own device); only the main process writes the record, the
training curve and W&B, while the others wait for it (`ranks.wait_for_main_process`), so that a multirun's
processes enter each cell together. Every model evaluated is placed by one `EvalPlacement` (device, dtype per
stage, TF32; evaluation/placement.py), whatever made it, and a freshly trained one is evaluated as it was kept.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..atomic import write_text
from ..data import prepare_data
from ..faults import fault_point
from ..mla.lowrank import FACTOR_SPLIT
from ..models import load_tokenizer
from ..schema.sections import DistributedConfig, RunConfig
from ..train import FineTuneDiverged, finetune, remove_checkpoint, sharding
from ..train.recipe import CHECKPOINT_DIR, note_peak_rss, recover_checkpoint
from . import stages
from .config import ConfigError, RunPlan, describe, describe_conversion, describe_trained, run_config, validate
from .lock import FolderBusy, FolderLock
from .ranks import (
    SLOW_EVAL_ENV,
    long_wait_group,
    process_state,
    same_on_every_rank,
    shared_bf16_verdict,
    wait_for_main_process,
)
from .record import BUSY, FINAL_STATUSES, MetricsLog, headline, machine_info, read_results, write_json_atomic
from .trained import TrainedModel

log = logging.getLogger(__name__)


def run_dir_for(plan: RunPlan) -> Path:
    return Path(plan.config.results_dir) / plan.config.experiment / f"{describe(plan)}-{plan.run_hash}"


def trained_model_for(plan: RunPlan) -> TrainedModel:
    return TrainedModel(plan.config.results_dir, describe_trained(plan), plan.trained_hash)


def run(cfg: DictConfig | RunConfig, *, fail_at_step: int | None = None) -> dict:
    """Execute (or skip, or resume) the run `cfg` describes; return its results record (the main process's).
    The composed config becomes the typed RunConfig here, once; from the plan on, each stage reads the sections
    it needs from `plan.config` (the typed config with what this machine resolved)."""
    config = run_config(cfg)
    dist = process_state(config.device, config.distributed)
    plan = plan_run(config, dist)  # every config error surfaces here, before any weight is touched
    run_dir = run_dir_for(plan)
    if plan.config.dry_run:  # reads, writes nothing: no lock
        return _finished(plan, run_dir, dist) or _plan_only(plan, run_dir, dist)
    lock, busy = FolderLock(run_dir), None
    if dist.is_main_process:
        try:
            lock.acquire(wait=plan.config.run_busy == "wait")
        except FolderBusy as err:
            busy = str(err)
    busy = same_on_every_rank(busy, dist)
    if busy:
        if dist.is_main_process:
            print(f"[mha2mla_exp] {busy}")
        return {"status": BUSY, "error": busy, "run_name": run_dir.name, "run_dir": str(run_dir)}
    try:
        return _finished(plan, run_dir, dist) or _run_locked(plan, run_dir, dist, fail_at_step)
    finally:
        if dist.is_main_process:
            lock.release()


def _finished(plan: RunPlan, run_dir: Path, dist) -> dict | None:
    """The run's finished record, unless `rerun=true` asks for it to be made again; None: there is work."""
    previous = read_results(run_dir)
    if not previous or previous.get("status") not in FINAL_STATUSES:
        return None
    if plan.config.rerun and not plan.config.dry_run:
        log.warning("rerun=true: replacing the finished (%s) record of %s", previous["status"], run_dir)
        return None
    if dist.is_main_process:
        print(f"[mha2mla_exp] already done ({previous['status']}): {run_dir}")
    return previous | {"run_dir": str(run_dir)}


def _run_locked(plan: RunPlan, run_dir: Path, dist, fail_at_step) -> dict:
    """The run itself, under its folder's lock."""
    config = plan.config
    previous = read_results(run_dir)
    for note in plan.notes:
        log.warning("not checked before loading: %s", note)

    # the inputs before any weight: a budget the corpus cannot hold is a config error, found in seconds
    tokenizer = load_tokenizer(config.model)  # the tokenizer alone: data and budget checked before any weight
    with dist.main_process_first():  # the token cache is written once
        data = prepare_data(config.data, tokenizer)
        train_data = stages.prepare_training_data(config.train, tokenizer)  # None: the fine-tune reads `data`
    rows, also = None, {}
    if plan.fine_tune:
        try:
            rows = stages.training_rows(plan, train_data or data, dist.num_processes)
            also = stages.also_held_out(data, train_data)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    main = dist.is_main_process
    trained = trained_model_for(plan)
    placement = stages.placement(config.model, plan.eval_dtype, dist.device)
    placement.apply_matmul_precision()  # from here on: calibration, training and perplexity alike
    record = {
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "experiment": config.experiment,
        "status": "running",
        "error": None,
        "resumed": previous is not None,
        "config_hash": plan.run_hash,
        "trained_hash": plan.trained_hash,
        "eval_hash": plan.eval_hash,
        "setting_hash": plan.setting_hash,
        "model": {
            "name": config.model.name,
            "paper_name": config.model.paper_name,
            "pretrain_tokens": config.model.pretrain_tokens,
        },
        "variant": plan.table_variant,
        "mla": plan.spec.to_dict() if plan.spec else None,
        "kv_quant": plan.kv_quant.to_dict() if plan.kv_quant else None,
        "data": dict(data.stats),
        "train_data": dict(train_data.stats) if train_data is not None else None,
        "trained_model": str(trained.dir) if plan.trains else None,
        "kv": None,
        "train": None,
        "eval": None,
        "timings": {},
        "machine": machine_info(dist.device, processes=dist.num_processes),
        "placement": placement.to_record() | {"evaluating_processes": dist.num_processes},
        "notes": list(plan.notes),
    }
    tracker = _Tracker(config, run_dir, {k: record[k] for k in IDENTITY_FIELDS}) if main else _Tracker.off()
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # the typed config with what this machine resolved (device, precision, eval dtype): what ran, its identity
        write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(config)))
        write_json_atomic(run_dir / "results.json", record)
        fault_point("record.running")
    started = time.perf_counter()
    try:
        model = placement.place(
            _model_for_evaluation(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step)
        )
        try:
            if main:
                if plan.trains and trained.metrics_path.exists():
                    write_text(run_dir / "metrics.jsonl", trained.metrics_path.read_text())
                write_json_atomic(run_dir / "results.json", record)  # the expensive part is on disk
                fault_point("record.model_ready")
            _evaluate(plan, model, tokenizer, data, record, run_dir, also, placement, dist)
        finally:  # also when the evaluation fails: the sweep's next cell starts on every process together
            wait_for_main_process(dist, config.distributed.eval_wait_s)
        record["status"] = "ok"
    except FineTuneDiverged as err:
        record.update(status="diverged", error=str(err))
        record["train"] = {"diverged_at_step": err.step, "loss": err.loss}
    except TrainedModelBusy as err:
        record.update(status="deferred", error=str(err))
    except BaseException as err:
        record.update(
            status="failed" if isinstance(err, Exception) else "interrupted",
            error="".join(traceback.format_exception_only(err)).strip(),
        )
        _finish(record, run_dir, started, tracker, main)
        raise
    _finish(record, run_dir, started, tracker, main)
    if main:
        print(f"[mha2mla_exp] {record['status']}: {run_dir}")
        if record["status"] == "ok":
            print(headline(record))
    return record


def plan_run(cfg: DictConfig | RunConfig, dist, bf16_pays=None) -> RunPlan:
    """The validated plan, `auto` precision and `eval.dtype=fastest` decided once for every process. A probe
    decides a fresh run, never a relaunch: where `train.precision=auto` on CPU finds work of this run only
    under the other mode (a checkpoint, a kept model, a record: a busier machine can time bf16 the other way),
    the run goes on in that mode, under its identity. `bf16_pays`: a verdict to use instead of the probe's."""
    bf16_pays = bf16_pays or shared_bf16_verdict(dist)
    config = run_config(cfg)
    plan = validate(config, bf16_pays=bf16_pays)
    if config.train.precision != "auto" or plan.precision is None or plan.device_type != "cpu":
        return plan
    if same_on_every_rank(_has_work(plan), dist):  # the usual case: no second validation at start-up
        return plan
    other_mode = copy.deepcopy(config)
    other_mode.train.precision = "fp32" if plan.precision.mode == "bf16-autocast" else "bf16-autocast"
    other = validate(other_mode, bf16_pays=bf16_pays)
    if same_on_every_rank(_has_work(other), dist):
        log.warning("train.precision=auto: this run's work so far is in %s; going on in it", other.precision.mode)
        reason = f"auto on CPU: {other.precision.mode}, the mode this run's earlier work was done in"
        return dataclasses.replace(other, precision=dataclasses.replace(other.precision, reason=reason))
    return plan


def _has_work(plan: RunPlan) -> bool:
    trained = trained_model_for(plan)
    return (
        trained.complete()
        or (trained.dir / "checkpoint" / "progress.json").exists()
        or (run_dir_for(plan) / "results.json").exists()
    )


def _plan_only(plan: RunPlan, run_dir: Path, dist) -> dict:
    """`dry_run=true`: what the run would do, from the config alone (nothing loaded, nothing written)."""
    config = plan.config
    lines = [f"[mha2mla_exp] plan: {run_dir}"]
    if plan.trains:
        trained = trained_model_for(plan)
        lines.append(f"  trained model: {trained.dir} ({'kept: reused' if trained.complete() else 'to train'})")
    if plan.fine_tune:
        from ..train import plan_budget

        budget = plan_budget(
            config.train, pretrain_tokens=config.model.pretrain_tokens, num_processes=dist.num_processes
        )
        lines.append(
            f"  fine-tune: {budget.steps:,} steps x {budget.tokens_per_step:,} tokens = {budget.tokens:,} "
            f"tokens on {dist.num_processes} process(es), {plan.precision.mode} ({plan.precision.reason})"
        )
        lines.append(
            f"  step: {'chunked loss' if config.train.fused_loss else 'full logits'}, "
            f"{config.train.optimizer_impl} AdamW (train.fused_loss, train.optimizer_impl)"
        )
        lines.append(f"  lr schedule: {plan.schedule.describe()} (peak lr {float(config.train.lr):g})")
        if plan.launch is not None:
            lines.append(f"  processes: {plan.launch.describe()}")
            lines.append(f"  wall time: {plan.launch.expected_wall.describe()}")
        if plan.memory is not None:
            lines.append(f"  GPU memory: {plan.memory.describe()}")
        if plan.host_memory is not None:
            from ..train.memory import checkpoint_bytes_per_process

            lines.append(f"  host memory: {plan.host_memory.describe()}")
            written = checkpoint_bytes_per_process(
                parameters=plan.memory.parameters, processes=plan.memory.processes, strategy=plan.memory.strategy
            )
            lines.append(
                f"  checkpoint: {written / 1e9:.1f} GB from the busiest process every "
                f"{config.train.checkpoint_every} steps and at a stop signal"
            )
    corpus = config.train.data or config.data
    if plan.fine_tune and corpus.mixture:
        from ..data.sources import mixture_token_shares

        shares = mixture_token_shares(corpus)
        source = config.model.paper_recipe.mixture_source if config.model.paper_recipe else None
        lines.append(
            "  mixture, token shares: "
            + ", ".join(f"{name} {share:.1%}" for name, share in shares)
            + (f" (released: {source})" if source and corpus.name == "smollm-corpus" else "")
        )
    lines.append(f"  evaluation dtype: {plan.eval_dtype} ({plan.eval_dtype_reason})")
    lines += [f"  note: {note}" for note in plan.notes]
    lines += [f"  blocked on this machine: {why}" for why in plan.blocked]
    lines += [f"  REFUSED as launched: {why}" for why in plan.refused]
    if dist.is_main_process:
        print("\n".join(lines))
    status = "refused" if plan.refused else "blocked" if plan.blocked else "planned"
    return {
        "status": status,
        "error": "; ".join(plan.refused + plan.blocked) or None,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
    }


def _finish(record: dict, run_dir: Path, started: float, tracker, main: bool) -> None:
    record["timings"]["total_s"] = round(time.perf_counter() - started, 3)
    if main:
        write_json_atomic(run_dir / "results.json", record)
        fault_point(f"record.{record['status']}")
        tracker.finish(record)


def _model_for_evaluation(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step):
    """The model this run evaluates, on every process: converted (untrained runs), or trained and kept, or the
    kept one reused. A model trained here is evaluated as it was kept (loaded back by every process, as a reuse
    loads it), so neither where the training left its copy (FSDP: the host, or nowhere but the main process) nor
    its training dtype decides the evaluation."""
    timings = record["timings"]
    if not plan.trains:
        t = time.perf_counter()
        where = stages.placement(plan.config.model, plan.eval_dtype, dist.device)
        model, _ = stages.load(plan.config.model, where, dist.device)
        record["model"]["params_original"] = stages.count_parameters(model)
        record["model"].update(stages.source_commit(plan.config.model, model))
        timings["load_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        model = stages.convert(
            plan, model, stages.calibration_batches(plan, data), stages.selection_batches(plan, data)
        )
        timings["convert_s"] = round(time.perf_counter() - t, 3)
        _describe_model(record, plan, model)
        return model

    if (
        plan.config.trained_model_busy == "defer"
        and not trained.complete()
        and same_on_every_rank(dist.is_main_process and _made_elsewhere(trained), dist)
    ):
        raise TrainedModelBusy(
            f"another process is making {trained.dir.name}; relaunch to evaluate it once it "
            "is kept (trained_model_busy=defer)"
        )
    lock = trained.lock() if dist.is_main_process else contextlib.nullcontext()
    with lock:  # two evaluations of one trained model (a parallel sweep) never train it twice
        info = same_on_every_rank(_kept_info(trained), dist)
        if info is not None and info.get("status") == "diverged":
            raise FineTuneDiverged(info["train"]["diverged_at_step"], info["train"]["loss"], "kept record")
        if info is not None:
            if dist.is_main_process:  # a kill between trained.json and the checkpoint's removal left it
                remove_checkpoint(trained.dir)
            t = time.perf_counter()
            model, _ = stages.load_trained(trained.model_dir, dist.device)
            timings["load_s"] = round(time.perf_counter() - t, 3)
            record.update({k: v for k, v in info.items() if k in ("train", "distill", "rope_pairs")})
            record["model"].update(info["model"])
            _describe_model(record, plan, model)  # the conversion's facts live in the kept model's config
            _stage_seconds(record)
            record["reused_trained_model"] = True
            log.info("reusing the kept trained model %s", trained.dir)
            return model
        try:
            model = _train(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step)
        except FineTuneDiverged as err:  # a result of the trained model: its other evaluations need not retry it
            if dist.is_main_process:
                write_json_atomic(
                    trained.dir / "trained.json",
                    {
                        "status": "diverged",
                        "trained_hash": plan.trained_hash,
                        "train": {"diverged_at_step": err.step, "loss": err.loss},
                    },
                )
            raise
        del model  # the training copy: each process loads the kept model instead
        dist.wait_for_everyone()  # the main process has saved it
        model, _ = stages.load_trained(trained.model_dir, dist.device)
        dist.wait_for_everyone()  # every process has read it before the lock is let go
    return model


class TrainedModelBusy(Exception):
    """Another process is making this run's trained model and `trained_model_busy=defer`: the cell ends at
    once (its GPU freed) instead of waiting out the fine-tune; a relaunch evaluates the kept model."""


def _made_elsewhere(trained: TrainedModel) -> bool:
    """Whether another process holds the trained model's lock now (it is making the model)."""
    lock = trained.lock()
    if not lock.try_acquire():
        return True
    lock.release()
    return False


def _kept_info(trained: TrainedModel) -> dict | None:
    if trained.complete():
        return trained.info()
    if (trained.dir / "trained.json").is_file() and trained.info().get("status") == "diverged":
        return trained.info()
    return None


def _converted(plan, tokenizer, data, record, dist):
    """(original, converted) for a run that trains: the conversion is kept under its own identity, so recipes
    that start from the same conversion (a recovery study, a second seed) convert once. `original` is None when
    nothing needs it (no teacher, no distillation) and the conversion was reused.

    Under FSDP (`train.sharding.shards`) only the main process loads and converts: the others wait for it and
    build the converted model on the meta device from its config, and receive their shards of its weights when
    the fine-tune shards it (train/sharding.py), so no other process holds the whole model on the host. A teacher
    (objective kd) is still loaded whole by every process."""
    note_peak_rss("before_load")
    timings = record["timings"]
    t = time.perf_counter()
    config = plan.config
    kept = (
        TrainedModel(config.results_dir, describe_conversion(plan), plan.conversion_hash)
        if plan.conversion_hash
        else None
    )
    from ..train.objectives import build_objective

    needs_teacher = build_objective(config.objective).needs_teacher
    from_main = plan.fine_tune and sharding.shards(config.train)  # the weights come from the main process
    holds_weights = dist.is_main_process or not from_main
    keeps_original = needs_teacher or (plan.distill and holds_weights)  # the teacher, or distillation's
    # the reuse check, the read and the save under the conversion's lock: no other process converts it twice,
    # replaces it or prunes it meanwhile
    lock = kept.lock() if kept is not None and dist.is_main_process else contextlib.nullcontext()
    with lock:
        reuse = kept is not None and same_on_every_rank(kept.complete(), dist)
        original = None
        if (holds_weights and not reuse) or keeps_original:
            where = stages.placement(config.model, plan.eval_dtype, dist.device)
            original, _ = stages.load(config.model, where, dist.device)
            record["model"]["params_original"] = stages.count_parameters(original)
            record["model"].update(stages.source_commit(config.model, original))
        timings["load_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        model = None
        if holds_weights and reuse:
            model, _ = stages.load_trained(kept.model_dir, dist.device)
            record["model"].update(
                {k: v for k, v in kept.info()["model"].items() if k in ("params_original", "hub_commit")}
            )
            record["reused_conversion"] = str(kept.dir)
        elif holds_weights:
            model = stages.convert(
                plan, original, stages.calibration_batches(plan, data), stages.selection_batches(plan, data)
            )
            if kept is not None and dist.is_main_process:
                kept.save(
                    model,
                    tokenizer,
                    {
                        "model": {k: v for k, v in record["model"].items() if k in ("params_original", "hub_commit")}
                        | {"params": stages.count_parameters(model)},
                        "rope_pairs": model.config.rope_pairs,
                        "status": "ok",
                        "conversion_hash": plan.conversion_hash,
                    },
                )
                fault_point("conversion.kept")
        if reuse and not from_main:
            dist.wait_for_everyone()  # every process has read the kept conversion before the lock is let go
    if from_main:
        _wait_for_the_main_process_to_convert(config.distributed, dist)
        model_config = same_on_every_rank(model.config if dist.is_main_process else None, dist)
        model = model if holds_weights else sharding.empty_like_main(model_config)
    elif not reuse:
        dist.wait_for_everyone()
    timings["convert_s"] = round(time.perf_counter() - t, 3)
    return (original if keeps_original else None), model


def _wait_for_the_main_process_to_convert(distributed: DistributedConfig, dist) -> None:
    """The other processes wait while the main one alone loads, converts or distills (FSDP): on the barrier that
    outlasts the main process's long work (`ranks.wait_for_main_process`), not in a training collective, whose
    timeout (`distributed.timeout_s`) is meant to catch hangs."""
    wait_for_main_process(dist, distributed.eval_wait_s)


def _train(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step):
    config = plan.config
    if dist.is_main_process:  # a swap cut by a kill is mended before anything reads the checkpoint's step
        recover_checkpoint(trained.dir / CHECKPOINT_DIR)
    dist.wait_for_everyone()
    original, model = _converted(plan, tokenizer, data, record, dist)
    if plan.distill:
        done = trained.dir / "distill.json"
        from_main = plan.fine_tune and sharding.shards(config.train)  # FSDP: the main process distills alone
        if done.exists() and _checkpoint_step(trained.dir) >= 0:  # the checkpoint holds the distilled weights
            record["distill"] = json.loads(done.read_text())
        elif dist.is_main_process or not from_main:
            record["distill"] = stages.distill(plan, original, model, data)
            if dist.is_main_process:
                write_json_atomic(done, record["distill"])
        if from_main:
            _wait_for_the_main_process_to_convert(config.distributed, dist)
        _stage_seconds(record)
    _describe_model(record, plan, model)

    if plan.fine_tune:
        from ..train.objectives import build_objective

        objective = build_objective(config.objective)
        teacher = stages.teacher_for(plan, original) if objective.needs_teacher else None
        original = None  # only the teacher (if any) keeps the original weights alive
        metrics = MetricsLog(trained.metrics_path)
        if dist.is_main_process:
            metrics.truncate_after(_checkpoint_step(trained.dir))

        def on_log(step_record):
            metrics.append(step_record)
            tracker.log(step_record)

        model, record["train"] = finetune(
            model,
            rows,
            config.train,
            trained.dir,
            precision=plan.precision,
            seed=config.seed,
            objective=objective,
            teacher=teacher,
            pretrain_tokens=config.model.pretrain_tokens,
            on_log=on_log,
            probe=stages.heldout_probe(plan, data),
            fail_at_step=fail_at_step,
            device=dist.device,
        )
        _stage_seconds(record)
        teacher = None
    original = None
    if dist.is_main_process:
        trained.save(
            model,
            tokenizer,
            {k: record.get(k) for k in ("model", "train", "distill", "rope_pairs")}
            | {"status": "ok", "trained_hash": plan.trained_hash},
        )
        fault_point("trained.kept")
        remove_checkpoint(trained.dir)  # the weights are kept, the resume point is no longer needed
    return model


def _stage_seconds(record: dict) -> None:
    """timings.distill_s / train_s: what each stage of the trained model cost, as the stage recorded it."""
    for stage in ("distill", "train"):
        if isinstance(record.get(stage), dict) and "seconds" in record[stage]:
            record["timings"][f"{stage}_s"] = record[stage]["seconds"]


def _describe_model(record: dict, plan: RunPlan, model) -> None:
    record["model"]["params"] = stages.count_parameters(model)
    if plan.spec is not None:
        record["rope_pairs"] = model.config.rope_pairs
        record["conversion"] = model.config.conversion_facts()
        if plan.spec.svd != "none":  # how the low-rank factors were split between down and up (mla/lowrank.py)
            record["conversion"]["lowrank_factors"] = FACTOR_SPLIT


def _evaluate(plan, model, tokenizer, data, record, run_dir, also, placement, dist) -> None:
    """On every process: the KV measurement and held-out perplexity whole (cheap; so that all enter the suites
    together), the lm-eval suites each on its share of the documents, gathered onto the main process, whose
    record holds them. The suites' collectives wait on the long-timeout group: shares end minutes apart."""
    t = time.perf_counter()
    record["eval_dtype"] = plan.eval_dtype  # the lm-eval suites'; held-out perplexity runs in the weights' dtype
    record["eval_dtype_reason"] = plan.eval_dtype_reason
    record["kv"] = stages.measure_kv(plan, model, data)
    record["eval"] = stages.evaluate(
        plan,
        model,
        tokenizer,
        data,
        run_dir if dist.is_main_process else None,
        also=also,
        where=placement,
        process_group=long_wait_group(dist, plan.config.distributed.eval_wait_s),
    )
    if dist.is_main_process:
        fault_point("eval.written")  # its per-document results are on disk, the record not yet
    if dist.is_main_process:
        time.sleep(float(os.environ.get(SLOW_EVAL_ENV, 0)))
    record["timings"]["eval_s"] = round(time.perf_counter() - t, 3)


def _checkpoint_step(root: Path) -> int:
    """The step the fine-tune resumes after (-1: it starts afresh, so no line of an earlier attempt is kept);
    read after `recover_checkpoint`, so a swap cut between its renames counts its newest complete checkpoint."""
    progress = Path(root) / CHECKPOINT_DIR / "progress.json"
    return json.loads(progress.read_text())["step"] if progress.exists() else -1


IDENTITY_FIELDS = ("config_hash", "trained_hash", "eval_hash", "setting_hash")


class _Tracker:
    """W&B mirror of the record: the resolved config with the run's hashes (so the aggregate counts a run on disk
    and in W&B once), curve, results. Offline by default; WANDB_MODE wins."""

    def __init__(self, config: RunConfig | None, run_dir: Path | None, identity: dict | None = None):
        self.run = None
        if config is None:
            return
        settings = config.logger.wandb
        mode = os.environ.get("WANDB_MODE", settings.mode)
        if not settings.enabled or mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            name=run_dir.name,
            id=hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16],
            resume="allow",
            mode=mode,
            dir=str(run_dir),
            config=dataclasses.asdict(config) | (identity or {}),
            reinit="finish_previous",
        )

    @classmethod
    def off(cls) -> "_Tracker":
        return cls(None, None)

    def log(self, record: dict) -> None:
        if self.run:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self, record: dict) -> None:
        if not self.run:
            return
        flat = {}
        for key in ("status", "kv", "train", "eval", "timings"):
            _flatten(record.get(key), key, flat)
        self.run.summary.update(flat)
        self.run.finish(exit_code=0 if record["status"] == "ok" else 1)


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}/{k}", out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out[prefix] = value
