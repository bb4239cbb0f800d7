"""One run, end to end, in the order this file reads: plan (`run` -> `plan_run`: each layer plans its own stage,
runner/config.py) -> skip a finished run or print the plan (`dry_run`) -> data -> (load -> calibrate -> convert ->
distill -> fine-tune -> keep) or reuse the kept trained model -> measure -> evaluate -> record. Finished runs are
skipped, interrupted ones resume. Each stage receives its own part of the plan (`plan.conversion.spec`,
`plan.training`, `plan.evaluation`) and the config sections it reads, never the whole plan.

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

from omegaconf import OmegaConf

from ..atomic import write_text
from ..data import prepare_data
from ..evaluation.run import held_out_probe
from ..faults import fault_point
from ..mla.lowrank import FACTOR_SPLIT
from ..models import load_tokenizer
from ..schema.sections import RunConfig
from ..train import FineTuneDiverged, finetune, remove_checkpoint, sharding
from ..train.recipe import CHECKPOINT_DIR, note_peak_rss, recover_checkpoint
from . import stages
from .config import ConfigError, RunPlan, validate
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


def run(config: RunConfig, *, fail_at_step: int | None = None) -> dict:
    """Execute (or skip, or resume) the run `config` describes (the typed config: `run_config` at the app's entry);
    return its results record (the main process's). From the plan on, each stage receives its own part of it."""
    dist = process_state(config.device, config.distributed.timeout_s)
    plan = plan_run(config, dist)  # every config error surfaces here, before any weight is touched
    run_dir = run_dir_for(plan)
    if config.dry_run:  # reads, writes nothing: no lock
        return _finished(run_dir, dist, rerun=False) or _plan_only(plan, run_dir, dist)
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
        return _finished(run_dir, dist, rerun=config.rerun) or _run_locked(plan, run_dir, dist, fail_at_step)
    finally:
        if dist.is_main_process:
            lock.release()


def plan_run(config: RunConfig, dist, bf16_pays=None) -> RunPlan:
    """The validated plan, `auto` precision and `eval.dtype=fastest` decided once for every process. A probe
    decides a fresh run, never a relaunch: where `train.precision=auto` on CPU finds work of this run only
    under the other mode (a checkpoint, a kept model, a record: a busier machine can time bf16 the other way),
    the run goes on in that mode, under its identity. `bf16_pays`: a verdict to use instead of the probe's."""
    bf16_pays = bf16_pays or shared_bf16_verdict(dist)
    plan = validate(config, bf16_pays=bf16_pays)
    if config.train.precision != "auto" or plan.training.precision is None or plan.launch.device_type != "cpu":
        return plan
    if same_on_every_rank(_has_work(trained_model_for(plan), run_dir_for(plan)), dist):
        return plan  # the usual case: no second validation at start-up
    other_mode = copy.deepcopy(config)
    other_mode.train.precision = "fp32" if plan.training.precision.mode == "bf16-autocast" else "bf16-autocast"
    other = validate(other_mode, bf16_pays=bf16_pays)
    if same_on_every_rank(_has_work(trained_model_for(other), run_dir_for(other)), dist):
        mode = other.training.precision.mode
        log.warning("train.precision=auto: this run's work so far is in %s; going on in it", mode)
        reason = f"auto on CPU: {mode}, the mode this run's earlier work was done in"
        precision = dataclasses.replace(other.training.precision, reason=reason)
        return dataclasses.replace(other, training=dataclasses.replace(other.training, precision=precision))
    return plan


def _has_work(trained: TrainedModel, run_dir: Path) -> bool:
    return (
        trained.complete()
        or (trained.dir / "checkpoint" / "progress.json").exists()
        or (run_dir / "results.json").exists()
    )


def run_dir_for(plan: RunPlan) -> Path:
    identity = plan.identity
    return Path(plan.config.results_dir) / plan.config.experiment / f"{identity.name}-{identity.run_hash}"


def trained_model_for(plan: RunPlan) -> TrainedModel:
    return TrainedModel(plan.config.results_dir, plan.identity.trained_name, plan.identity.trained_hash)


def _finished(run_dir: Path, dist, *, rerun: bool) -> dict | None:
    """The run's finished record, unless `rerun` asks for it to be made again; None: there is work."""
    previous = read_results(run_dir)
    if not previous or previous.get("status") not in FINAL_STATUSES:
        return None
    if rerun:
        log.warning("rerun=true: replacing the finished (%s) record of %s", previous["status"], run_dir)
        return None
    if dist.is_main_process:
        print(f"[mha2mla_exp] already done ({previous['status']}): {run_dir}")
    return previous | {"run_dir": str(run_dir)}


def _plan_only(plan: RunPlan, run_dir: Path, dist) -> dict:
    """`dry_run=true`: what the run would do, part by part as each layer describes its own (nothing loaded,
    nothing written)."""
    config = plan.config
    trained = trained_model_for(plan)
    kept = f"trained model: {trained.dir} ({'kept: reused' if trained.complete() else 'to train'})"
    corpus = config.train.data or config.data
    parts = {
        "conversion": plan.conversion.describe(),
        "training": plan.training.describe(config.train, config.distill.sequences, config.distill.epochs)
        + ([kept] if plan.training.trains else [])
        + (_mixture_shares(corpus, config.model) if plan.training.fine_tune and corpus.mixture else []),
        "evaluation": plan.evaluation.describe(config.eval),
        "launch": plan.launch.describe() + [f"REFUSED as launched: {why}" for why in plan.training.refused],
    }
    lines = [f"[mha2mla_exp] plan: {run_dir}"]
    for part, described in parts.items():
        lines.append(f"  {part}:")
        lines += [f"    {line}" for line in described]
    if dist.is_main_process:
        print("\n".join(lines))
    status = "refused" if plan.training.refused else "blocked" if plan.launch.blocked else "planned"
    return {
        "status": status,
        "error": "; ".join(plan.training.refused + plan.launch.blocked) or None,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
    }


def _mixture_shares(corpus, model) -> list[str]:
    """A streamed mixture's token shares (and where the paper's mixture was released)."""
    from ..data.sources import mixture_token_shares

    source = model.paper_recipe.mixture_source if model.paper_recipe else None
    return [
        "mixture, token shares: "
        + ", ".join(f"{name} {share:.1%}" for name, share in mixture_token_shares(corpus))
        + (f" (released: {source})" if source and corpus.name == "smollm-corpus" else "")
    ]


def _run_locked(plan: RunPlan, run_dir: Path, dist, fail_at_step) -> dict:
    """The run itself, under its folder's lock."""
    config = plan.config
    previous = read_results(run_dir)
    for note in plan.launch.notes:
        log.warning("not checked before loading: %s", note)

    # the inputs before any weight: a budget the corpus cannot hold is a config error, found in seconds
    tokenizer = load_tokenizer(config.model)  # the tokenizer alone: data and budget checked before any weight
    with dist.main_process_first():  # the token cache is written once
        data = prepare_data(config.data, tokenizer)
        # the fine-tune's own corpus where `train.data` names one (e.g. text the teacher writes); else it reads `data`
        train_data = (
            prepare_data(config.train.data, tokenizer)
            if plan.training.fine_tune and config.train.data is not None
            else None
        )
    rows, also = None, {}
    if plan.training.fine_tune:
        try:
            rows = stages.training_rows(config.train, plan.training.budget.tokens, train_data or data, config.seed)
            also = stages.also_held_out(data, train_data)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    main = dist.is_main_process
    trained = trained_model_for(plan)
    placement = plan.evaluation.placement(dist.device)
    placement.apply_matmul_precision()  # from here on: calibration, training and perplexity alike
    record = {
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "experiment": config.experiment,
        "status": "running",
        "error": None,
        "resumed": previous is not None,
        "config_hash": plan.identity.run_hash,
        "trained_hash": plan.identity.trained_hash,
        "eval_hash": plan.identity.eval_hash,
        "setting_hash": plan.identity.setting_hash,
        "model": {
            "name": config.model.name,
            "paper_name": config.model.paper_name,
            "pretrain_tokens": config.model.pretrain_tokens,
        },
        "variant": plan.conversion.table_variant,
        "mla": plan.conversion.spec.to_dict() if plan.conversion.spec else None,
        "kv_quant": plan.evaluation.kv_quant.to_dict() if plan.evaluation.kv_quant else None,
        "data": dict(data.stats),
        "train_data": dict(train_data.stats) if train_data is not None else None,
        "trained_model": str(trained.dir) if plan.training.trains else None,
        "kv": None,
        "train": None,
        "eval": None,
        "timings": {},
        "machine": machine_info(dist.device, processes=dist.num_processes),
        "placement": placement.to_record() | {"evaluating_processes": dist.num_processes},
        "notes": list(plan.launch.notes),
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
                if plan.training.trains and trained.metrics_path.exists():
                    write_text(run_dir / "metrics.jsonl", trained.metrics_path.read_text())
                write_json_atomic(run_dir / "results.json", record)  # the expensive part is on disk
                fault_point("record.model_ready")
            _evaluate(plan, model, tokenizer, data, record, run_dir, also, dist)
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


def _model_for_evaluation(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step):
    """The model this run evaluates, on every process: converted (untrained runs), or trained and kept, or the
    kept one reused. A model trained here is evaluated as it was kept (loaded back by every process, as a reuse
    loads it), so neither where the training left its copy (FSDP: the host, or nowhere but the main process) nor
    its training dtype decides the evaluation."""
    timings = record["timings"]
    if not plan.training.trains:
        t = time.perf_counter()
        model, _ = stages.load(plan.config.model, plan.evaluation.placement(dist.device), dist.device)
        record["model"]["params_original"] = stages.count_parameters(model)
        record["model"].update(stages.source_commit(plan.config.model.source, model))
        timings["load_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        model = stages.convert(plan.conversion.spec, plan.config, model, data)
        timings["convert_s"] = round(time.perf_counter() - t, 3)
        _describe_model(record, model)
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
            _describe_model(record, model)  # the conversion's facts live in the kept model's config
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
                        "trained_hash": plan.identity.trained_hash,
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
        TrainedModel(config.results_dir, plan.identity.conversion_name, plan.identity.conversion_hash)
        if plan.identity.conversion_hash
        else None
    )
    from ..train.objectives import build_objective

    needs_teacher = build_objective(config.objective).needs_teacher
    from_main = plan.training.fine_tune and sharding.shards(config.train)  # the weights come from the main process
    holds_weights = dist.is_main_process or not from_main
    keeps_original = needs_teacher or (plan.training.distill and holds_weights)  # the teacher, or distillation's
    # the reuse check, the read and the save under the conversion's lock: no other process converts it twice,
    # replaces it or prunes it meanwhile
    lock = kept.lock() if kept is not None and dist.is_main_process else contextlib.nullcontext()
    with lock:
        reuse = kept is not None and same_on_every_rank(kept.complete(), dist)
        original = None
        if (holds_weights and not reuse) or keeps_original:
            original, _ = stages.load(config.model, plan.evaluation.placement(dist.device), dist.device)
            record["model"]["params_original"] = stages.count_parameters(original)
            record["model"].update(stages.source_commit(config.model.source, original))
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
            model = stages.convert(plan.conversion.spec, config, original, data)
            if kept is not None and dist.is_main_process:
                kept.save(
                    model,
                    tokenizer,
                    {
                        "model": {k: v for k, v in record["model"].items() if k in ("params_original", "hub_commit")}
                        | {"params": stages.count_parameters(model)},
                        "rope_pairs": model.config.rope_pairs,
                        "status": "ok",
                        "conversion_hash": plan.identity.conversion_hash,
                    },
                )
                fault_point("conversion.kept")
        if reuse and not from_main:
            dist.wait_for_everyone()  # every process has read the kept conversion before the lock is let go
    if from_main:
        _wait_for_main_process_alone(config.distributed.eval_wait_s, dist)
        model_config = same_on_every_rank(model.config if dist.is_main_process else None, dist)
        model = model if holds_weights else sharding.empty_like_main(model_config)
    elif not reuse:
        dist.wait_for_everyone()
    timings["convert_s"] = round(time.perf_counter() - t, 3)
    return (original if keeps_original else None), model


def _train(plan, trained, tokenizer, data, rows, record, dist, tracker, fail_at_step):
    config = plan.config
    if dist.is_main_process:  # a swap cut by a kill is mended before anything reads the checkpoint's step
        recover_checkpoint(trained.dir / CHECKPOINT_DIR)
    dist.wait_for_everyone()
    original, model = _converted(plan, tokenizer, data, record, dist)
    if plan.training.distill:
        done = trained.dir / "distill.json"
        from_main = plan.training.fine_tune and sharding.shards(config.train)  # FSDP: the main process distills alone
        if done.exists() and _checkpoint_step(trained.dir) >= 0:  # the checkpoint holds the distilled weights
            record["distill"] = json.loads(done.read_text())
        elif dist.is_main_process or not from_main:
            record["distill"] = stages.distill(plan.conversion.spec, config, original, model, data)
            if dist.is_main_process:
                write_json_atomic(done, record["distill"])
        if from_main:
            _wait_for_main_process_alone(config.distributed.eval_wait_s, dist)
        _stage_seconds(record)
    _describe_model(record, model)

    if plan.training.fine_tune:
        from ..train.objectives import build_objective

        objective = build_objective(config.objective)
        teacher = (
            stages.teacher_for(plan.training.precision.compute_dtype, original) if objective.needs_teacher else None
        )
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
            precision=plan.training.precision,
            seed=config.seed,
            objective=objective,
            teacher=teacher,
            pretrain_tokens=config.model.pretrain_tokens,
            on_log=on_log,
            probe=held_out_probe(config.eval.perplexity, config.train.eval_batches, data),
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
            | {"status": "ok", "trained_hash": plan.identity.trained_hash},
        )
        fault_point("trained.kept")
        remove_checkpoint(trained.dir)  # the weights are kept, the resume point is no longer needed
    return model


def _wait_for_main_process_alone(timeout_s: float, dist) -> None:
    """The other processes wait while the main one alone loads, converts or distills (FSDP): on the barrier that
    outlasts the main process's long work (`ranks.wait_for_main_process`), not in a training collective, whose
    timeout (`distributed.timeout_s`) is meant to catch hangs."""
    wait_for_main_process(dist, timeout_s)


def _stage_seconds(record: dict) -> None:
    """timings.distill_s / train_s: what each stage of the trained model cost, as the stage recorded it."""
    for stage in ("distill", "train"):
        if isinstance(record.get(stage), dict) and "seconds" in record[stage]:
            record["timings"][f"{stage}_s"] = record[stage]["seconds"]


def _describe_model(record: dict, model) -> None:
    """The evaluated model's parameters and, for a conversion, its facts as its config states them."""
    record["model"]["params"] = stages.count_parameters(model)
    if getattr(model.config, "model_type", None) == "mha2mla":
        record["rope_pairs"] = model.config.rope_pairs
        record["conversion"] = model.config.conversion_facts()
        if model.config.mla["svd"] != "none":  # how the low-rank factors were split between down and up
            record["conversion"]["lowrank_factors"] = FACTOR_SPLIT


def _checkpoint_step(root: Path) -> int:
    """The step the fine-tune resumes after (-1: it starts afresh, so no line of an earlier attempt is kept);
    read after `recover_checkpoint`, so a swap cut between its renames counts its newest complete checkpoint."""
    progress = Path(root) / CHECKPOINT_DIR / "progress.json"
    return json.loads(progress.read_text())["step"] if progress.exists() else -1


def _evaluate(plan, model, tokenizer, data, record, run_dir, also, dist) -> None:
    """On every process: the KV measurement and held-out perplexity whole (cheap; so that all enter the suites
    together), the lm-eval suites each on its share of the documents, gathered onto the main process, whose
    record holds them. The suites' collectives wait on the long-timeout group: shares end minutes apart."""
    t = time.perf_counter()
    record["eval_dtype"] = plan.evaluation.dtype  # the lm-eval suites'; held-out perplexity runs in the weights' dtype
    record["eval_dtype_reason"] = plan.evaluation.dtype_reason
    config = plan.config
    record["kv"] = stages.measure_kv(plan.evaluation.kv_quant, config.kv_measure_tokens, model, data)
    record["eval"] = stages.evaluate(
        plan.evaluation,
        config.eval,
        model,
        tokenizer,
        data,
        window=config.model.finetune_length,
        run_dir=run_dir if dist.is_main_process else None,
        also=also,
        process_group=long_wait_group(dist, config.distributed.eval_wait_s),
    )
    if dist.is_main_process:
        fault_point("eval.written")  # its per-document results are on disk, the record not yet
    if dist.is_main_process:
        time.sleep(float(os.environ.get(SLOW_EVAL_ENV, 0)))
    record["timings"]["eval_s"] = round(time.perf_counter() - t, 3)


def _finish(record: dict, run_dir: Path, started: float, tracker, main: bool) -> None:
    record["timings"]["total_s"] = round(time.perf_counter() - started, 3)
    if main:
        write_json_atomic(run_dir / "results.json", record)
        fault_point(f"record.{record['status']}")
        tracker.finish(record)


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
