"""From a composed Hydra config to a validated run plan, before any weight is loaded."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ..data.sources import check_data_config, probe_hub_datasets
from ..evaluation.kv import KVQuant
from ..mla.spec import SUPPORTED_MODEL_TYPES, MLASpec, ModelShape, default_r
from ..models import DTYPES, check_model_config, folder_config, probe_architecture, shape_of
from ..train.objectives import build_objective
from ..train.budget import plan_budget
from ..train.memory import (STRATEGIES, HostEstimate, LaunchCheck, MemoryEstimate, estimate_host_memory,
                            estimate_memory, processes_needed)
from ..train.optimizer import optimizer_impl
from ..train.schedule import Schedule, schedule_for
from ..train.precision import Precision, cpu_bf16_pays, precision_for
from ..mla.lowrank import FACTOR_SPLIT
from ..schema.fields import check_values
from ..schema.identity import digest, evaluation_identity, setting_identity, trained_identity
from ..schema.sections import RunConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the offending field."""


@dataclass(frozen=True)
class RunPlan:
    variant: str                 # original | finetuned_full_attention | mla
    shape: ModelShape
    spec: MLASpec | None         # None: the model is not converted
    fine_tune: bool
    distill: bool                # layer-wise distillation before the fine-tune (converted models only)
    kv_quant: dict | None        # {"backend", "nbits", "residual_length", "q_group_size"} or None
    device_type: str             # cuda | cpu: part of the identity (numbers differ between devices)
    precision: Precision | None  # the training precision; None when nothing is trained
    eval_dtype: str              # the dtype the evaluation runs in
    eval_dtype_reason: str       # why (`fastest` is decided by a measurement on CPU)
    trained_hash: str            # the trained (or converted) model's identity
    conversion_hash: str | None  # the untrained conversion's identity: recipes trained from it share it
    eval_hash: str               # this evaluation's identity
    setting_hash: str            # the trained and evaluation identities but the seed: one row of a table
    config: RunConfig            # the typed config, with what the entry resolves (device, precision, eval dtype)
    notes: tuple[str, ...] = ()  # what validation could not check (offline), said before heavy work
    memory: MemoryEstimate | None = None  # per-GPU memory of the fine-tune, where train.gpu_memory_gb asks
    host_memory: HostEstimate | None = None  # host memory per process of the same plan
    launch: LaunchCheck | None = None  # the processes the plan needs against this launch's
    schedule: Schedule | None = None  # the fine-tune's lr schedule on this launch's budget
    blocked: tuple[str, ...] = ()  # dry runs only: what this machine lacks to run the plan (a real run raises)
    refused: tuple[str, ...] = ()  # dry runs only: why this launch would be refused (a real run raises)

    @property
    def table_variant(self) -> str:
        """The paper's row kind: original, finetuned_full_attention, partial_rope, partial_rope+svd."""
        if self.spec is None:
            return self.variant
        return "partial_rope" if self.spec.svd == "none" else "partial_rope+svd"

    @property
    def trains(self) -> bool:
        """Whether the run produces weights of its own (worth keeping: they cost compute)."""
        return self.fine_tune or self.distill

    @property
    def run_hash(self) -> str:
        return digest({"trained": self.trained_hash, "eval": self.eval_hash})


def validate(cfg: DictConfig, *, bf16_pays=None) -> RunPlan:
    """Check the composed config (types and value constraints by the schema, then what depends on several fields:
    shapes against r and d_kv, memory plans, data access) and resolve what depends on this machine (device,
    `train.precision=auto`, `eval.dtype`); raise ConfigError naming the field. No weight is loaded; a hub id's
    config.json may be read when the hub is reachable. `bf16_pays(hidden, intermediate) -> (fast, why)`: what
    decides `auto` and `eval.dtype=fastest` on CPU (default: this process's own timing, `cpu_bf16_pays`)."""
    bf16_pays = bf16_pays or cpu_bf16_pays
    cfg = _schema_errors(lambda: OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))  # a typed one as it is
    typed = typed_config(cfg)
    _check_source("model", check_model_config, cfg.model)
    # a local folder's config.json: its shape facts when the config gives none, or a saved conversion
    saved = folder_config(cfg.model.id) if cfg.model.get("source") == "local" else None
    try:
        s = cfg.model.shape if cfg.model.get("shape") is not None or saved is None else shape_of(saved)
        shape = ModelShape(
            num_layers=int(s["num_layers"]), hidden_size=int(s["hidden_size"]), num_heads=int(s["num_heads"]),
            num_kv_heads=int(s["num_kv_heads"]), head_dim=int(s["head_dim"]),
        )
    except Exception as err:  # missing keys, None, wrong types
        raise ConfigError(f"model.shape: incomplete shape facts for model {cfg.model.get('name')!r}: {err}") from err
    saved_mla = getattr(saved, "model_type", None) == "mha2mla"
    if saved_mla and cfg.variant != "mla":
        raise ConfigError(f"variant: {cfg.model.id!r} holds a saved MLA conversion; evaluate it with variant=mla "
                          "(its rope/svd settings are read from its config.json, not converted again)")
    # a dry run plans for the machine that will run it: what this one lacks to read the data is said, not fatal
    blocked = [] if cfg.get("dry_run") else None
    _check_source("data", lambda c: check_data_config(c, missing_access=blocked), cfg.data)
    if training_data_cfg(cfg) is not None:  # recovery text other than the run's corpus (calibration, held-out)
        try:
            check_data_config(cfg.train.data, missing_access=blocked)
        except ValueError as err:
            raise ConfigError(f"train.{err}" if str(err).startswith("data.") else f"train.data: {err}") from err
    _check_eval(cfg.eval, cfg.model)
    notes = []

    spec = None
    if saved_mla:  # its spec as the conversion recorded it
        spec = MLASpec.create(shape, **MLASpec.recorded(saved.mla).to_dict())
    elif cfg.variant == "mla":
        r = cfg.rope.r if cfg.rope.r is not None else default_r(cfg.rope.strategy, shape.head_dim)
        try:
            spec = MLASpec.create(
                shape, rope=cfg.rope.strategy, r=r, svd=cfg.svd.method, d_kv=cfg.svd.d_kv,
                score=cfg.rope.score, sigma=cfg.svd.sigma, init=cfg.svd.get("init", "weight"),
                allocation=cfg.svd.get("allocation", "uniform"),
                kv_elements=cfg.svd.get("kv_elements"), rope_pairs=cfg.svd.get("rope_pairs"),
                nope_keys=cfg.rope.get("nope_keys", "plain"), key_weight=cfg.svd.get("key_weight", 1.0),
            )
        except ValueError as err:
            raise ConfigError(_field_for(str(err)) + str(err)) from err
        notes += _check_architecture(cfg.model)

    kv_quant = None
    if cfg.kv_quant.backend is not None:
        kv_quant = OmegaConf.to_container(cfg.kv_quant, resolve=True)
        try:  # bits and group size for the backend, and the grouping for the architecture: before any training
            KVQuant.from_cfg(kv_quant).check_model(converted=cfg.variant == "mla")
        except ValueError as err:
            raise ConfigError(str(err) if str(err).startswith("kv_quant") else f"kv_quant: {err}") from err

    fine_tune = bool(cfg.train.enabled) and cfg.variant != "original"
    if training_data_cfg(cfg) is not None and not fine_tune:
        raise ConfigError("train.data: recovery text is set, but this run fine-tunes nothing "
                          f"(train.enabled={cfg.train.enabled}, variant={cfg.variant})")
    distill = spec is not None and bool(cfg.distill.enabled)
    if cfg.variant == "finetuned_full_attention" and not cfg.train.enabled:
        raise ConfigError("train.enabled: the full-attention fine-tune baseline needs fine-tuning enabled")
    device_type = _device_type(cfg.device)
    precision = memory = host_memory = launch = schedule = None
    refused = [] if cfg.get("dry_run") else None
    if fine_tune:
        schedule = _check_train(cfg)
        try:
            objective = build_objective(OmegaConf.to_container(cfg.objective, resolve=True))
            precision = precision_for(cfg.train.precision, device_type, hidden_size=shape.hidden_size,
                                      intermediate_size=intermediate_size(cfg, shape), bf16_pays=bf16_pays)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        if objective.needs_teacher and cfg.variant != "mla":
            raise ConfigError(f"objective.name: {objective.name!r} distils the original model into its conversion; "
                              f"variant={cfg.variant!r} has no conversion")
        memory, host_memory, launch = _check_memory(cfg, shape, precision, teacher=objective.needs_teacher,
                                                    device_type=device_type, refused=refused)
    if cfg.data.source == "hub":
        notes += _probe(lambda: probe_hub_datasets(OmegaConf.to_container(cfg.data.mixture, resolve=True)), "data")
    eval_dtype, eval_dtype_reason = resolve_eval_dtype(
        cfg.eval.get("dtype"), device_type, bf16_pays=lambda: bf16_pays(shape.hidden_size, intermediate_size(cfg, shape)))

    # what this machine resolved is written into the config: the run's config.yaml says what ran
    typed.device = device_type if typed.device == "auto" else typed.device
    typed.eval.dtype = eval_dtype
    typed.data.dropped_parts = _dropped_mixture_parts(cfg.data)
    if typed.train.data is not None:
        typed.train.data.dropped_parts = _dropped_mixture_parts(training_data_cfg(cfg))
    if precision is not None:
        typed.train.precision = precision.mode
        typed.train.global_batch_rows = global_batch_rows(cfg.train)
    calibrates = spec is not None and spec.needs_calibration
    whitened = (FACTOR_SPLIT if (fine_tune or distill) and spec is not None and spec.svd != "none"
                and typed.svd.init != "weight" else None)  # how whitened factors are split changes the training
    trained = trained_identity(typed, converts=spec is not None, trains=fine_tune, distills=distill,
                               calibrates=calibrates, whitened_factors=whitened)
    conversion = trained_identity(typed, converts=True, trains=False, distills=False, calibrates=calibrates,
                                  whitened_factors=whitened) if spec is not None else None
    evaluation = evaluation_identity(typed)
    return RunPlan(
        variant=cfg.variant, shape=shape, spec=spec, fine_tune=fine_tune, distill=distill, kv_quant=kv_quant,
        device_type=device_type, precision=precision, eval_dtype=eval_dtype, eval_dtype_reason=eval_dtype_reason,
        trained_hash=digest(trained),
        conversion_hash=digest(conversion) if conversion else None,
        eval_hash=digest(evaluation), setting_hash=digest(setting_identity(trained, evaluation)), config=typed,
        notes=tuple(notes),
        memory=memory, host_memory=host_memory, launch=launch, schedule=schedule, blocked=tuple(blocked or ()),
        refused=tuple(refused or ()),
    )


def _dropped_mixture_parts(data: DictConfig | None) -> list[str]:
    """The hub mixture parts that `missing_parts: renormalise` drops on this machine: which text a model trains on
    depends on them, so they are written into the config (`data.dropped_parts`) and its identity."""
    from ..data.sources import available_parts

    if data is None or data.get("source") != "hub":
        return []
    return sorted(part["name"] for part in available_parts(OmegaConf.to_container(data, resolve=True))[1])


def typed_config(cfg: DictConfig) -> RunConfig:
    """The composed config as the schema's dataclasses, its constraints checked; ConfigError naming the field."""
    typed = _schema_errors(lambda: OmegaConf.to_object(cfg))
    problems = check_values(typed)
    if problems:
        raise ConfigError("; ".join(problems))
    return typed


def _schema_errors(step):
    """Run a step of OmegaConf's typing; its errors as ConfigError naming the field."""
    try:
        return step()
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key}: missing (a ??? value): set it, e.g. on the command line") from None
    except OmegaConfBaseException as err:
        key, message = getattr(err, "full_key", None), str(err).split("\n")[0]
        raise ConfigError(f"{key}: {message}" if key else message) from None


def training_data_cfg(cfg: DictConfig):
    """The fine-tune's own corpus (`train.data`, e.g. `+data@train.data=teacher_samples`), or None: the fine-tune
    reads the run's `data`, which always gives the calibration sample and the held-out rows."""
    return cfg.train.get("data") if "train" in cfg else None


def world_size() -> int:
    """Processes of this launch (torchrun / accelerate launch set WORLD_SIZE); known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_batch_rows(train_cfg) -> int:
    return int(train_cfg.micro_batch_size) * int(train_cfg.grad_accum) * world_size()


EVAL_DTYPE_MODES = ("auto", "fastest")


def resolve_eval_dtype(dtype: str | None, device_type: str, *, bf16_pays=None) -> tuple[str, str]:
    """The lm-eval suites' dtype and why. `auto` (or null): bf16 on CUDA (as the paper evaluates), fp32 on CPU.
    `fastest`: bf16 on CUDA; on CPU bf16 where `bf16_pays()` (a timing of the model's matmuls) says it is
    worth it, else fp32: an AVX2-only CPU runs bf16 tens of times slower, an AMX one several times faster.
    `dtype` was checked by the schema."""
    dtype = dtype or "auto"
    if dtype in DTYPES:
        return dtype, "set in the config"
    if device_type == "cuda":
        return "bfloat16", f"{dtype} on CUDA: bf16 (as the paper evaluates)"
    if dtype == "auto":
        return "float32", "auto on CPU: fp32"
    fast, why = bf16_pays()
    return ("bfloat16" if fast else "float32"), f"fastest on CPU: {why}"


def intermediate_size(cfg: DictConfig, shape: ModelShape) -> int:
    sizes = cfg.model.get("sizes") or {}
    return int(sizes.get("intermediate_size") or cfg.model.get("intermediate_size") or 4 * shape.hidden_size)


def _check_memory(cfg: DictConfig, shape: ModelShape, precision: Precision, *, teacher: bool, device_type: str,
                  refused: list | None) -> tuple[MemoryEstimate | None, HostEstimate | None, LaunchCheck | None]:
    """The fine-tune's per-GPU and host memory where the train config states the GPU's (`train.gpu_memory_gb`),
    for the processes the plan is laid out for (`train.gpus`, or this launch's where it has several). A plan above
    the GPU's memory is refused, on a GPU and in a dry run (which plans a GPU launch from anywhere); so is a launch
    with fewer processes than the plan needs, where the plan then would not fit (one process of an 8-GPU FSDP plan
    trains unsharded): a real run raises, a dry run says so in `refused`."""
    t = cfg.train
    strategy = t.get("strategy") or "ddp"
    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategy: unknown {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if strategy == "fsdp" and precision.separate_master_copy:
        raise ConfigError(f"train.strategy: fsdp shards the fp32 weights themselves; {precision.mode} keeps a "
                          "separate master copy it cannot shard (use bf16-autocast or fp32)")
    if t.get("gpu_memory_gb") is None:
        return None, None, None
    sizes = cfg.model.get("sizes") or {}
    if sizes.get("vocab_size") is None and cfg.model.get("vocab_size") is None:
        raise ConfigError(f"model.sizes.vocab_size: the memory estimate (train.gpu_memory_gb) needs model "
                          f"{cfg.model.get('name')!r}'s vocabulary size")
    launched, limit = world_size(), float(t.gpu_memory_gb)
    planned = launched if launched > 1 else int(t.get("gpus") or 1)

    def per_gpu(processes: int) -> MemoryEstimate:
        return estimate_memory(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, intermediate_size=intermediate_size(cfg, shape),
            vocab_size=int(sizes.get("vocab_size") or cfg.model.get("vocab_size")),
            tied_embeddings=bool(sizes.get("tied_embeddings", True)), micro_batch_size=int(t.micro_batch_size),
            seq_len=int(t.seq_len), processes=processes, strategy=strategy,
            activation_checkpointing=bool(t.get("activation_checkpointing")), precision_mode=precision.mode,
            teacher=teacher, fused_loss=bool(t.get("fused_loss")))

    try:
        memory = per_gpu(planned)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    host = estimate_host_memory(parameters=memory.parameters, processes=planned, strategy=strategy)
    launch = LaunchCheck(planned=planned, launched=launched, needed=processes_needed(per_gpu, limit),
                         on_launch=per_gpu(launched), limit_gb=limit)
    if device_type != "cuda" and not cfg.get("dry_run"):
        return memory, host, launch
    if memory.total_gb > limit:
        raise ConfigError(f"train.gpu_memory_gb: the fine-tune needs about {memory.describe()}, above the "
                          f"{t.gpu_memory_gb} GB stated; use more GPUs (train.gpus), train.strategy=fsdp, "
                          "train.activation_checkpointing=true or a smaller train.micro_batch_size")
    if not launch.fits:
        why = (f"train.gpus: this launch has {launched} process(es) but the plan is laid out for {planned} "
               f"({strategy}); on {launched} the fine-tune needs about {launch.on_launch.describe()}, above the "
               f"{limit:g} GB of train.gpu_memory_gb. Launch {planned} processes: torchrun --nproc_per_node {planned} "
               f"(on SLURM: hydra.launcher.tasks_per_node={planned} hydra.launcher.gpus_per_node={planned})")
        if refused is None:
            raise ConfigError(why)
        refused.append(why)
    return memory, host, launch


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device: unknown {device!r}; expected auto, cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device here")
    return kind


def _check_train(cfg: DictConfig) -> Schedule:
    t = cfg.train
    if t.pretrain_share_pct is None and int(t.tokens) <= 0:
        raise ConfigError("train.tokens: must be positive when fine-tuning is enabled")
    wanted = t.get("global_batch_rows")
    if wanted is not None and global_batch_rows(t) != int(wanted):
        world = world_size()
        per_process = int(t.micro_batch_size) * world
        hint = (f"set train.grad_accum={int(wanted) // per_process}" if int(wanted) % per_process == 0 else
                f"choose micro_batch_size x processes dividing {wanted}")
        raise ConfigError(f"train.grad_accum: micro_batch_size {t.micro_batch_size} x grad_accum {t.grad_accum} x "
                          f"{world} processes = {global_batch_rows(t)} rows per step, but global_batch_rows is "
                          f"{wanted}: {hint}")
    if int(t.grad_accum) <= 0:  # after the global batch: train=paper derives it, and that check says why it is 0
        raise ConfigError(f"train.grad_accum: must be positive, got {t.grad_accum}")
    try:
        optimizer_impl(t)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    context = cfg.model.shape.get("context_length")
    if context and int(t.seq_len) > int(context):
        raise ConfigError(f"train.seq_len: {t.seq_len} is longer than model {cfg.model.name!r}'s context of "
                          f"{context} tokens (model.shape.context_length)")
    try:
        budget = plan_budget(t, pretrain_tokens=cfg.model.get("pretrain_tokens"), num_processes=world_size())
        return schedule_for(t, budget.steps)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _check_architecture(model_cfg: DictConfig) -> list[str]:
    """The model's architecture must be one the converter handles; read from its config.json, no weights."""
    model_type, notes = probe_architecture(model_cfg)
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model.id: {model_cfg.id!r} is a {model_type!r} model; the MLA conversion handles "
                          f"Llama-family causal LMs ({', '.join(SUPPORTED_MODEL_TYPES)})")
    return notes


def _probe(check, group: str) -> list[str]:
    try:
        return check()
    except ValueError as err:
        raise ConfigError(str(err) if str(err).startswith(group) else f"{group}: {err}") from err


def _check_source(group: str, check, cfg_group: DictConfig) -> None:
    """Run a layer's own config check (models, data); report its error under the group's name."""
    try:
        check(cfg_group)
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(group) else f"{group}: {message}") from err


def _check_eval(eval_cfg: DictConfig, model_cfg: DictConfig) -> None:
    """The evaluation's own parser, run here so that a bad eval setting fails before fine-tuning, not after; and
    the long-context suite's lengths against the window it is scored in (the model's fine-tuning length, else its
    context), which the suite itself checks only after the fine-tune."""
    from ..evaluation import parse_eval_config

    container = OmegaConf.to_container(eval_cfg, resolve=True)
    if container.get("dtype") in EVAL_DTYPE_MODES:
        container["dtype"] = None  # a mode: resolved per device by resolve_eval_dtype, after the cheap checks
    try:
        long_context = parse_eval_config(container)["long_context"]
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        message = str(err)
        raise ConfigError(message if message.startswith("eval") else f"eval: {message}") from err
    window = model_cfg.get("finetune_length") or (model_cfg.get("shape") or {}).get("context_length")
    if long_context is not None and window and long_context.longest > int(window):
        raise ConfigError(f"eval.long_context: its longest sequence ({long_context.longest} tokens: lengths / "
                          f"ppl_lengths) exceeds the evaluation window of {window} (model.finetune_length)")


_SPEC_FIELDS = {"rope": "rope.strategy", "svd": "svd.method", "score": "rope.score", "sigma": "svd.sigma",
                "init": "svd.init", "allocation": "svd.allocation", "kv_elements": "svd.kv_elements",
                "rope_pairs": "svd.rope_pairs", "nope_keys": "rope.nope_keys",
                "key_weight": "svd.key_weight",
                "r": "rope.r", "d_kv": "svd.d_kv", "head_dim": "model.shape", "num_heads": "model.shape"}


def _field_for(message: str) -> str:
    """Prefix an MLASpec error ('unknown rope=...', 'r=9 is outside...', 'd_kv is required...')
    with the config field it came from."""
    match = re.match(r"(?:unknown )?([a-z_]+)", message)
    field = _SPEC_FIELDS.get(match.group(1)) if match else None
    return f"{field}: " if field else ""


PAPER_LR = 1e-4
_PRECISION_TAGS = {"fp32": "", "bf16-autocast": "bf16a", "bf16-master": "bf16m", "bf16-pure": "bf16p"}


def describe_trained(plan: RunPlan, cfg: DictConfig) -> str:
    """A readable name of the trained (or converted) model: model, conversion, recovery, budget, seed."""
    parts = [cfg.model.name]
    if plan.spec is None:
        parts.append("original" if plan.variant == "original" else "full-attention")
    else:
        parts.extend(plan.spec.name_parts())
    if plan.distill:
        parts.append(f"distill{cfg.distill.sequences}x{cfg.distill.epochs}")
    if plan.fine_tune:
        t = cfg.train
        budget = _short_count(t.tokens) if t.pretrain_share_pct is None else f"{t.pretrain_share_pct}pct"
        recipe = "" if cfg.objective.name == "ce" else f"-{cfg.objective.name}"
        recipe += "-attn" if t.freeze_non_attention else ""
        recipe += f"-lr{float(t.lr):g}" if float(t.lr) != PAPER_LR else ""
        recipe += "-compiled" if t.get("compile") else ""
        recipe += f"-{_PRECISION_TAGS[plan.precision.mode]}" if _PRECISION_TAGS[plan.precision.mode] else ""
        tag = (training_data_cfg(cfg) or cfg.data).get("tag")  # what it recovered on, unless the default corpus
        recipe += f"-{tag}" if tag else ""
        parts.append(f"ft{budget}{recipe}")
    parts.append(f"s{cfg.seed}")
    return "__".join(str(p) for p in parts)


def describe_conversion(plan: RunPlan, cfg: DictConfig) -> str:
    """The untrained conversion's name: model and conversion."""
    return "__".join([cfg.model.name, *plan.spec.name_parts(), "converted"])


def describe(plan: RunPlan, cfg: DictConfig) -> str:
    """A readable run name: the trained model's name, then what the evaluation adds (KV quantization)."""
    name = describe_trained(plan, cfg)
    if plan.kv_quant:
        head, _, seed = name.rpartition("__")
        q = plan.kv_quant
        grouping = "" if q.get("grouping", "tokens") == "tokens" else f"-{q['grouping']}"
        name = f"{head}__{q['backend']}{q['nbits']}{grouping}__{seed}"
    return name


def _short_count(n) -> str:
    n = float(n)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}"
