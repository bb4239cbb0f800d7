"""One run, end to end: validate -> load -> data -> calibrate -> convert -> fine-tune -> measure ->
evaluate -> record. Finished runs are skipped, interrupted ones resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from pathlib import Path

import safetensors.torch
import torch
from omegaconf import DictConfig, OmegaConf

from ..train import FineTuneDiverged, finetune
from . import stages
from .config import RunPlan, config_hash, describe, validate
from .record import FINAL_STATUSES, MetricsLog, machine_info, read_results, write_json_atomic

log = logging.getLogger(__name__)


def run_dir_for(cfg: DictConfig, plan: RunPlan) -> Path:
    return Path(cfg.results_dir) / cfg.experiment / f"{describe(plan, cfg)}-{config_hash(cfg)}"


def run(cfg: DictConfig, *, fail_at_step: int | None = None) -> dict:
    """Execute (or skip, or resume) the run `cfg` describes; return its results record."""
    plan = validate(cfg)  # every config error surfaces here, before any weight is touched
    run_dir = run_dir_for(cfg, plan)
    previous = read_results(run_dir)
    if previous and previous.get("status") in FINAL_STATUSES:
        log.info("skipping %s: already %s", run_dir, previous["status"])
        print(f"[mha2mla_exp] already done ({previous['status']}): {run_dir}")
        return previous

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    device = stages.resolve_device(cfg)
    torch.manual_seed(cfg.seed)
    record = {
        "run_name": run_dir.name,
        "experiment": cfg.experiment,
        "status": "running",
        "error": None,
        "resumed": previous is not None,
        "config_hash": config_hash(cfg),
        "model": {"name": cfg.model.name, "paper_name": cfg.model.get("paper_name"),
                  "pretrain_tokens": cfg.model.get("pretrain_tokens")},
        "variant": plan.table_variant,
        "mla": plan.spec.to_dict() if plan.spec else None,
        "kv_quant": plan.kv_quant,
        "kv": None, "train": None, "eval": None,
        "timings": {},
        "machine": machine_info(device),
    }
    write_json_atomic(run_dir / "results.json", record)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    tracker = _Tracker(cfg, run_dir)
    started = time.perf_counter()
    try:
        _execute(cfg, plan, run_dir, device, record, metrics, tracker, fail_at_step)
        record["status"] = "ok"
    except FineTuneDiverged as err:
        record.update(status="diverged", error=str(err))
        record["train"] = {"diverged_at_step": err.step, "loss": err.loss}
    except BaseException as err:
        record.update(status="failed" if isinstance(err, Exception) else "interrupted",
                      error="".join(traceback.format_exception_only(err)).strip())
        record["timings"]["total_s"] = round(time.perf_counter() - started, 3)
        write_json_atomic(run_dir / "results.json", record)
        tracker.finish(record)
        raise
    record["timings"]["total_s"] = round(time.perf_counter() - started, 3)
    write_json_atomic(run_dir / "results.json", record)
    tracker.finish(record)
    print(f"[mha2mla_exp] {record['status']}: {run_dir}")
    return record


def _execute(cfg, plan, run_dir, device, record, metrics, tracker, fail_at_step) -> None:
    timings = record["timings"]
    t = time.perf_counter()
    model, tokenizer = stages.load(cfg, device)
    record["model"]["params_original"] = stages.count_parameters(model)
    data = stages.prepare_data(cfg, tokenizer)
    record["data"] = dict(getattr(data, "stats", {}) or {})
    timings["load_s"] = round(time.perf_counter() - t, 3)

    t = time.perf_counter()
    calibration = stages.calibration_batches(cfg, plan, data)
    original, model = model, stages.convert(plan, model, calibration)
    timings["convert_s"] = round(time.perf_counter() - t, 3)
    if plan.spec is not None and cfg.distill.enabled:
        record["distill"] = stages.distill(cfg, original, model, data)
        timings["distill_s"] = record["distill"]["seconds"]
    del original
    record["model"]["params"] = stages.count_parameters(model)
    if plan.spec is not None:
        record["rope_pairs"] = model.config.rope_pairs

    if plan.fine_tune:
        shared = _shared_weights_dir(cfg) if cfg.train.get("share_trained") else None
        if shared is not None and (shared / "train.json").exists():
            # same conversion and fine-tune, other KV precision or eval: reuse the trained weights
            safetensors.torch.load_model(model, shared / "model.safetensors", device=str(model.device))
            record["train"] = json.loads((shared / "train.json").read_text()) | {"shared_from": str(shared)}
        else:
            progress = run_dir / "checkpoint" / "progress.json"
            metrics.truncate_after(_checkpoint_step(progress))

            def on_log(step_record):
                metrics.append(step_record)
                tracker.log(step_record)

            record["train"] = finetune(
                model, data.train, cfg.train, run_dir, seed=cfg.seed,
                pretrain_tokens=cfg.model.get("pretrain_tokens"), on_log=on_log, fail_at_step=fail_at_step,
                periodic_eval=stages.heldout_probe(cfg, data),
            )
            if shared is not None:
                shared.mkdir(parents=True, exist_ok=True)
                safetensors.torch.save_model(model, shared / "model.safetensors")
                write_json_atomic(shared / "train.json", record["train"])  # written last: marks it complete
        timings["train_s"] = record["train"]["seconds"]
        write_json_atomic(run_dir / "results.json", record)  # the expensive part is on disk
        if cfg.train.get("keep_checkpoint"):
            model.save_pretrained(run_dir / "model")
            tokenizer.save_pretrained(run_dir / "model")

    t = time.perf_counter()
    record["kv"] = stages.measure_kv(cfg, plan, model, data)
    record["eval"] = stages.evaluate(cfg, plan, model, tokenizer, data, run_dir)
    timings["eval_s"] = round(time.perf_counter() - t, 3)


def _shared_weights_dir(cfg: DictConfig) -> Path:
    """Where the fine-tuned weights of this (model, data, conversion, fine-tune, seed) are shared."""
    key = config_hash(cfg, keys=("model", "data", "rope", "svd", "distill", "train", "variant", "seed", "calibration"))
    return Path(cfg.results_dir) / "_trained" / key


def _checkpoint_step(progress: Path) -> int:
    return json.loads(progress.read_text())["step"] if progress.exists() else 0


class _Tracker:
    """W&B mirror of the record: config, curve, results. Offline by default; WANDB_MODE wins."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.run = None
        settings = cfg.logger.wandb
        mode = os.environ.get("WANDB_MODE", settings.mode)
        if not settings.enabled or mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=settings.project, entity=settings.entity, group=settings.group, name=run_dir.name,
            id=hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16], resume="allow", mode=mode,
            dir=str(run_dir), config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous",
        )

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
