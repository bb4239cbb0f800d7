"""What a run IS, declared once: the settings that define its trained model, those that define an evaluation of
it, and the observers that change no number.

- The trained model: model, data, conversion (rope, svd, calibration), distillation, fine-tune, seed, and the
  runtime (device type, training precision, rows per optimizer step); for whitened low-rank factors that a
  training starts from, how they are split (`mla.lowrank.FACTOR_SPLIT`). Its weights are saved under this
  identity and reused by every evaluation of it: a new or failed evaluation never retrains.
- An evaluation: the eval suites, the KV-cache quantization, the cache measurement, the evaluation dtype.
- Observers (`OBSERVERS`): logging, checkpoint cadence, probes, permissions. They are in neither hash.
- A setting (`setting_identity`): both of the above but the seed. Runs of one setting are repeats of one
  measurement (a table's row, its spread over seeds); runs of two settings never share a row.

Blocks that cannot matter are left out (the conversion of an unconverted model, a disabled distillation, the
fine-tune of the original model), so that a change there does not split identical runs.
"""

from __future__ import annotations

import hashlib
import json

from omegaconf import DictConfig, OmegaConf

from ..mla.lowrank import FACTOR_SPLIT

TRAINED_MODEL_KEYS = ("model", "data", "variant", "seed", "rope", "svd", "calibration", "distill", "objective", "train")
EVALUATION_KEYS = ("eval", "kv_quant", "kv_measure_tokens")
# (group, key): settings that observe a run or permit it, and never change its numbers
OBSERVERS = (
    ("model", "paper_name"),
    # how a plan is laid on GPUs: DDP or FSDP, recomputed activations, the memory it is checked against
    ("train", "strategy"), ("train", "activation_checkpointing"), ("train", "gpus"), ("train", "gpu_memory_gb"),
    ("train", "log_every"), ("train", "checkpoint_every"), ("train", "eval_every"), ("train", "eval_batches"),
    ("train", "epochs_allowed"),
    # how a global batch is split into processes x accumulation x micro-batches changes no number (tested);
    # the global batch itself is in the runtime identity
    ("train", "micro_batch_size"), ("train", "grad_accum"), ("train", "global_batch_rows"),
    # how a step is computed: the same loss and gradients as the plain path within float rounding (tested)
    ("train", "fused_loss"), ("train", "optimizer_impl"),
)


def trained_identity(cfg: DictConfig, *, runtime: dict, converts: bool, trains: bool, distills: bool,
                     calibrates: bool, starts_training: bool | None = None) -> dict:
    """The settings (resolved) that determine the trained (or converted) model's weights. `starts_training`
    (default: trains or distills): the weights are where a training starts, so how whitened low-rank factors
    are split is part of them (a kept conversion that a fine-tune loads, as well as the fine-tuned model)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    identity = {k: container.get(k) for k in TRAINED_MODEL_KEYS if k in container}
    if not converts:
        for key in ("rope", "svd", "calibration"):
            identity.pop(key, None)
    if not calibrates:
        identity.pop("calibration", None)
    if not distills:
        identity.pop("distill", None)
    if not trains:
        identity.pop("train", None)
        identity.pop("objective", None)
    if not (trains or distills):  # an untrained model is the same on any device, in any training precision
        runtime = {k: v for k, v in runtime.items() if k != "precision"}
    svd = identity.get("svd") or {}
    starts_training = (trains or distills) if starts_training is None else starts_training
    if starts_training and svd.get("method", "none") != "none" and svd.get("init", "weight") != "weight":
        identity["lowrank_factors"] = FACTOR_SPLIT  # whitened factors: how they are split changes the training
    identity["runtime"] = runtime
    _drop_observers(identity)
    return identity


def evaluation_identity(cfg: DictConfig, *, eval_dtype: str) -> dict:
    container = OmegaConf.to_container(cfg, resolve=True)
    identity = {k: container.get(k) for k in EVALUATION_KEYS if k in container}
    identity["eval_dtype"] = eval_dtype
    block = identity.get("eval")
    if isinstance(block, dict) and "dtype" in block:
        # a dtype is identified by what it resolved to: `fastest` on a bf16 CPU is the run `bfloat16` made,
        # and `auto` (or null) is the run written before the key existed
        if block["dtype"] in (None, "auto"):
            del block["dtype"]
        else:
            block["dtype"] = eval_dtype
    _drop_observers(identity)
    return identity


def setting_identity(trained: dict, evaluation: dict) -> dict:
    """What makes two runs the same measurement up to their seed: the trained identity without its seed, and the
    evaluation's identity."""
    return {"trained": {k: v for k, v in trained.items() if k != "seed"}, "eval": evaluation}


def digest(*parts: dict) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


# keys of a model's block that its id already fixes (`sizes`) or that only lay it on GPUs (`gpu_plan`); dropped
# from the model block and from a teacher-written corpus's copy of it (`teacher: ${model}`)
MODEL_PLANNING_KEYS = ("sizes", "gpu_plan")


def _drop_observers(identity: dict) -> None:
    for group, key in OBSERVERS:
        block = identity.get(group)
        if isinstance(block, dict):
            block.pop(key, None)
    teachers = [block.get("teacher") for block in (identity.get("data"), (identity.get("train") or {}).get("data"))
                if isinstance(block, dict)]
    for block in [identity.get("model"), *teachers]:
        if isinstance(block, dict):
            for key in MODEL_PLANNING_KEYS:
                block.pop(key, None)
