"""From a composed Hydra config to a validated run plan, before any weight is loaded: the config becomes the typed
RunConfig here, once (`run_config`), and every layer after receives its own section of the plan's resolved copy."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from omegaconf import DictConfig

from ..confutil import typed_section
from ..data.sources import check_data_config, mixture_parts, probe_hub_datasets
from ..evaluation.kv import KVQuant
from ..mla.families import SUPPORTED_MODEL_TYPES, attention_windows, unsupported_features
from ..mla.lowrank import FACTOR_SPLIT
from ..mla.spec import MLASpec, ModelShape, converted_layers, default_r
from ..models import DTYPES, check_model_config, folder_config, probe_architecture, shape_of
from ..schema.identity import digest, evaluation_identity, setting_identity, trained_identity
from ..schema.sections import (
    DataConfig,
    EvalConfig,
    KVQuantConfig,
    ModelConfig,
    RopeConfig,
    RunConfig,
    ShapeConfig,
    SizesConfig,
    SvdConfig,
    TrainConfig,
)
from ..train.budget import PEAK_BF16_FLOPS, WallTime, flops_per_token, gpu_kind_of, plan_budget
from ..train.memory import (
    HostEstimate,
    LaunchCheck,
    MemoryEstimate,
    estimate_host_memory,
    estimate_memory,
    processes_needed,
)
from ..train.objectives import build_objective
from ..train.precision import Precision, cpu_bf16_pays, precision_for
from ..train.schedule import Schedule, schedule_for


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the offending field."""


@dataclass(frozen=True)
class RunPlan:
    variant: str  # original | finetuned_full_attention | mla
    shape: ModelShape
    spec: MLASpec | None  # None: the model is not converted
    fine_tune: bool
    distill: bool  # layer-wise distillation before the fine-tune (converted models only)
    kv_quant: KVQuant | None  # the evaluation's KV-cache quantization, or None
    device_type: str  # cuda | cpu: part of the identity (numbers differ between devices)
    precision: Precision | None  # the training precision; None when nothing is trained
    eval_dtype: str  # the dtype the evaluation runs in
    eval_dtype_reason: str  # why (`fastest` is decided by a measurement on CPU)
    trained_hash: str  # the trained (or converted) model's identity
    conversion_hash: str | None  # the untrained conversion's identity: recipes trained from it share it
    eval_hash: str  # this evaluation's identity
    setting_hash: str  # the trained and evaluation identities but the seed: one row of a table
    config: RunConfig  # the typed config, with what the entry resolves (device, precision, eval dtype)
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


def run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The run's typed config: a composed (or recorded) config merged onto the schema, its types and declared
    constraints checked, ConfigError naming the field; a RunConfig as it is. The one conversion, at the entry."""
    if isinstance(cfg, RunConfig):
        return cfg
    try:
        config = typed_section(RunConfig, cfg)
        for group, data in (("data", config.data), ("train.data", config.train.data)):
            # `teacher: ${model}` arrives typed when composed, a plain mapping from a recorded config.yaml: one form
            if data is not None and isinstance(data.teacher, dict):
                data.teacher = typed_section(ModelConfig, data.teacher, f"{group}.teacher")
        return config
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate(cfg: DictConfig | RunConfig, *, bf16_pays=None) -> RunPlan:
    """Check the config (types and value constraints by the schema, then what depends on several fields: shapes
    against r and d_kv, memory plans, data access) and resolve what depends on this machine (device,
    `train.precision=auto`, `eval.dtype`) into a copy, the plan's `config`; raise ConfigError naming the field. No
    weight is loaded; a hub id's config.json may be read when the hub is reachable. `bf16_pays(hidden,
    intermediate) -> (fast, why)`: what decides `auto` and `eval.dtype=fastest` on CPU (default: this process's own
    timing, `cpu_bf16_pays`)."""
    bf16_pays = bf16_pays or cpu_bf16_pays
    config = copy.deepcopy(run_config(cfg))  # what this machine resolves is written into the plan's own copy
    model, train = config.model, config.train
    _check_source("model", check_model_config, model)
    # a local folder's config.json: its shape facts when the config gives none, or a saved conversion
    saved = folder_config(model.id) if model.source == "local" else None
    shape = _model_shape(model, saved)
    saved_mla = getattr(saved, "model_type", None) == "mha2mla"
    if saved_mla and config.variant != "mla":
        raise ConfigError(
            f"variant: {model.id!r} holds a saved MLA conversion; evaluate it with variant=mla "
            "(its rope/svd settings are read from its config.json, not converted again)"
        )
    # a dry run plans for the machine that will run it: what this one lacks to read the data is said, not fatal
    blocked = [] if config.dry_run else None
    _check_source("data", lambda data: check_data_config(data, missing_access=blocked), config.data)
    if train.data is not None:  # recovery text other than the run's corpus (calibration, held-out)
        try:
            check_data_config(train.data, missing_access=blocked)
        except ValueError as err:
            raise ConfigError(f"train.{err}" if str(err).startswith("data.") else f"train.data: {err}") from err
    _check_eval(config.eval, model)
    notes = []

    spec = None
    if saved_mla:  # its spec as the conversion recorded it
        spec = MLASpec.create(shape, **MLASpec.recorded(saved.mla).to_dict())
    elif config.variant == "mla":
        spec = _conversion_spec(config.rope, config.svd, shape)
        notes += _check_architecture(model, spec, shape)

    kv_quant = _kv_quantization(config.kv_quant, converted=config.variant == "mla")
    fine_tune = train.enabled and config.variant != "original"
    if train.data is not None and not fine_tune:
        raise ConfigError(
            "train.data: recovery text is set, but this run fine-tunes nothing "
            f"(train.enabled={train.enabled}, variant={config.variant})"
        )
    distill = spec is not None and config.distill.enabled
    if config.variant == "finetuned_full_attention" and not train.enabled:
        raise ConfigError("train.enabled: the full-attention fine-tune baseline needs fine-tuning enabled")
    device_type = _device_type(config.device, dry_run=config.dry_run)
    precision = memory = host_memory = launch = schedule = None
    refused = [] if config.dry_run else None
    if fine_tune:
        schedule = _check_train(train, model)
        try:
            objective = build_objective(config.objective)
            precision = precision_for(
                train.precision,
                device_type,
                hidden_size=shape.hidden_size,
                intermediate_size=intermediate_size(model, shape),
                bf16_pays=bf16_pays,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        if objective.needs_teacher and config.variant != "mla":
            raise ConfigError(
                f"objective.name: {objective.name!r} distils the original model into its conversion; "
                f"variant={config.variant!r} has no conversion"
            )
        memory, host_memory, launch = _check_memory(
            train,
            train.data or config.data,
            model,
            shape,
            precision,
            teacher=objective.needs_teacher,
            device_type=device_type,
            dry_run=config.dry_run,
            refused=refused,
        )
    if config.data.source == "hub":
        notes += _probe(lambda: probe_hub_datasets(config.data.mixture), "data")
    eval_dtype, eval_dtype_reason = resolve_eval_dtype(
        config.eval.dtype, device_type, bf16_pays=lambda: bf16_pays(shape.hidden_size, intermediate_size(model, shape))
    )

    # what this machine resolved is written into the config: the run's config.yaml says what ran
    config.device = device_type if config.device == "auto" else config.device
    config.eval.dtype = eval_dtype
    config.data.dropped_parts = _dropped_mixture_parts(config.data)
    if train.data is not None:
        train.data.dropped_parts = _dropped_mixture_parts(train.data)
    if precision is not None:
        train.precision = precision.mode
        train.global_batch_rows = global_batch_rows(train)
    calibrates = spec is not None and spec.needs_calibration
    whitened = (
        FACTOR_SPLIT
        if (fine_tune or distill) and spec is not None and spec.svd != "none" and config.svd.init != "weight"
        else None
    )  # how whitened factors are split changes the training
    trained = trained_identity(
        config,
        converts=spec is not None,
        trains=fine_tune,
        distills=distill,
        calibrates=calibrates,
        whitened_factors=whitened,
    )
    conversion = (
        trained_identity(
            config, converts=True, trains=False, distills=False, calibrates=calibrates, whitened_factors=whitened
        )
        if spec is not None
        else None
    )
    evaluation = evaluation_identity(config)
    return RunPlan(
        variant=config.variant,
        shape=shape,
        spec=spec,
        fine_tune=fine_tune,
        distill=distill,
        kv_quant=kv_quant,
        device_type=device_type,
        precision=precision,
        eval_dtype=eval_dtype,
        eval_dtype_reason=eval_dtype_reason,
        trained_hash=digest(trained),
        conversion_hash=digest(conversion) if conversion else None,
        eval_hash=digest(evaluation),
        setting_hash=digest(setting_identity(trained, evaluation)),
        config=config,
        notes=tuple(notes),
        memory=memory,
        host_memory=host_memory,
        launch=launch,
        schedule=schedule,
        blocked=tuple(blocked or ()),
        refused=tuple(refused or ()),
    )


def _model_shape(model: ModelConfig, saved) -> ModelShape:
    """The shape facts the conversion and the memory plan read: the config's, else the local folder's config.json."""
    facts = model.shape if model.shape is not None or saved is None else ShapeConfig(**shape_of(saved))
    if facts is None:
        raise ConfigError(
            f"model.shape: no shape facts for model {model.name!r}: give model.shape, or a local "
            "folder whose config.json holds them"
        )
    return ModelShape.from_facts(facts)


def _conversion_spec(rope: RopeConfig, svd: SvdConfig, shape: ModelShape) -> MLASpec:
    """The MLA conversion the rope and svd sections describe, checked against the shape; ConfigError naming the
    field an MLASpec error came from."""
    r = rope.r if rope.r is not None else default_r(rope.strategy, shape.head_dim)
    try:
        return MLASpec.create(
            shape,
            rope=rope.strategy,
            r=r,
            svd=svd.method,
            d_kv=svd.d_kv,
            score=rope.score,
            sigma=svd.sigma,
            init=svd.init,
            allocation=svd.allocation,
            kv_elements=svd.kv_elements,
            rope_pairs=svd.rope_pairs,
            nope_keys=rope.nope_keys,
            key_weight=svd.key_weight,
            convert_layers=svd.convert_layers,
        )
    except ValueError as err:
        raise ConfigError(_field_for(str(err)) + str(err)) from err


def _kv_quantization(section: KVQuantConfig, *, converted: bool) -> KVQuant | None:
    """The evaluation's KV-cache quantization: bits and group size for the backend, and the grouping for the
    architecture, checked before any training."""
    try:
        kv_quant = KVQuant.from_config(section)
        if kv_quant is not None:
            kv_quant.check_model(converted=converted)
    except ValueError as err:
        raise ConfigError(str(err) if str(err).startswith("kv_quant") else f"kv_quant: {err}") from err
    return kv_quant


def _dropped_mixture_parts(data: DataConfig) -> list[str]:
    """The hub mixture parts that `missing_parts: renormalise` drops on this machine: which text a model trains on
    depends on them, so they are written into the config (`data.dropped_parts`) and its identity."""
    if data.source != "hub":
        return []
    return sorted(part["name"] for part in mixture_parts(data)[1])


def world_size() -> int:
    """Processes of this launch (torchrun / accelerate launch set WORLD_SIZE); known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_batch_rows(train: TrainConfig) -> int:
    return int(train.micro_batch_size) * int(train.grad_accum) * world_size()


def resolve_eval_dtype(dtype: str, device_type: str, *, bf16_pays=None) -> tuple[str, str]:
    """The lm-eval suites' dtype and why. `auto`: bf16 on CUDA (as the paper evaluates), fp32 on CPU.
    `fastest`: bf16 on CUDA; on CPU bf16 where `bf16_pays()` (a timing of the model's matmuls) says it is
    worth it, else fp32: an AVX2-only CPU runs bf16 tens of times slower, an AMX one several times faster.
    `dtype` was checked by the schema."""
    if dtype in DTYPES:
        return dtype, "set in the config"
    if device_type == "cuda":
        return "bfloat16", f"{dtype} on CUDA: bf16 (as the paper evaluates)"
    if dtype == "auto":
        return "float32", "auto on CPU: fp32"
    fast, why = bf16_pays()
    return ("bfloat16" if fast else "float32"), f"fastest on CPU: {why}"


def intermediate_size(model: ModelConfig, shape: ModelShape) -> int:
    sizes = model.sizes or SizesConfig()
    return int(sizes.intermediate_size or model.intermediate_size or 4 * shape.hidden_size)


def _check_memory(
    train: TrainConfig,
    data: DataConfig,
    model: ModelConfig,
    shape: ModelShape,
    precision: Precision,
    *,
    teacher: bool,
    device_type: str,
    dry_run: bool,
    refused: list | None,
) -> tuple[MemoryEstimate | None, HostEstimate | None, LaunchCheck | None]:
    """The fine-tune's per-GPU and host memory and its wall time where the train config states the GPU's memory
    (`train.gpu_memory_gb`), for the processes the plan is laid out for (`train.gpus`, or this launch's where it
    has more). A plan above the GPU's memory is refused, on a GPU and in a dry run (which plans a GPU launch from
    anywhere); so is a launch with fewer processes than the plan's, for memory where it would not fit (one process
    of an 8-GPU FSDP plan trains unsharded) and for time where it would (train.allow_fewer_processes=true: intended),
    naming the command that launches it right: a real run raises, a dry run says so in `refused`."""
    strategy = train.strategy
    if strategy == "fsdp" and precision.separate_master_copy:
        raise ConfigError(
            f"train.strategy: fsdp shards the fp32 weights themselves; {precision.mode} keeps a "
            "separate master copy it cannot shard (use bf16-autocast or fp32)"
        )
    if train.gpu_memory_gb is None:
        return None, None, None
    sizes = model.sizes or SizesConfig()
    vocab_size = sizes.vocab_size or model.vocab_size
    if vocab_size is None:
        raise ConfigError(
            f"model.sizes.vocab_size: the memory estimate (train.gpu_memory_gb) needs model "
            f"{model.name!r}'s vocabulary size"
        )
    launched, limit = world_size(), float(train.gpu_memory_gb)
    planned = max(launched, train.gpus)  # more processes than the plan's: the launch's own layout

    def per_gpu(processes: int) -> MemoryEstimate:
        return estimate_memory(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate_size=intermediate_size(model, shape),
            vocab_size=int(vocab_size),
            tied_embeddings=sizes.tied_embeddings,
            micro_batch_size=train.micro_batch_size,
            seq_len=train.seq_len,
            processes=processes,
            strategy=strategy,
            activation_checkpointing=train.activation_checkpointing,
            precision_mode=precision.mode,
            teacher=teacher,
            fused_loss=train.fused_loss,
        )

    try:
        memory = per_gpu(planned)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    host = estimate_host_memory(
        parameters=memory.parameters,
        processes=planned,
        strategy=strategy,
        largest_tensor=int(vocab_size) * shape.hidden_size,
        stream_parts=len(data.mixture or ()) if data.source == "hub" else 0,
        stream_window_tokens=data.shuffle_rows * train.seq_len if data.source == "hub" else 0,
        device_type=device_type,
        on_device=memory,
    )
    budget = plan_budget(train, pretrain_tokens=model.pretrain_tokens, num_processes=launched)
    wall = WallTime(
        tokens=budget.tokens,
        flops_per_token=flops_per_token(
            parameters=memory.parameters,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            head_dim=shape.head_dim,
            seq_len=train.seq_len,
        ),
        processes=planned,
        gpu=_gpu_kind(train.gpu_kind, device_type),
    )
    launch = LaunchCheck(
        planned=planned,
        launched=launched,
        needed=processes_needed(per_gpu, limit),
        on_launch=per_gpu(launched),
        limit_gb=limit,
        wall=wall,
        fewer_intended=train.allow_fewer_processes,
    )
    if device_type != "cuda" and not dry_run:
        return memory, host, launch
    if memory.total_gb > limit:
        raise ConfigError(
            f"train.gpu_memory_gb: the fine-tune needs about {memory.describe()}, above the "
            f"{train.gpu_memory_gb} GB stated; use more GPUs (train.gpus), train.strategy=fsdp, "
            "train.activation_checkpointing=true or a smaller train.micro_batch_size"
        )
    why = launch.refusal()
    if why is not None:
        if refused is None:
            raise ConfigError(why)
        refused.append(why)
    return memory, host, launch


def _gpu_kind(asked: str | None, device_type: str) -> str:
    """The GPU kind the wall time is planned for: `train.gpu_kind`, else this machine's GPU, else an H100."""
    if asked is not None:
        if asked not in PEAK_BF16_FLOPS:
            raise ConfigError(f"train.gpu_kind: unknown {asked!r}; expected one of {', '.join(PEAK_BF16_FLOPS)}")
        return asked
    if device_type == "cuda" and torch.cuda.is_available():
        return gpu_kind_of(torch.cuda.get_device_name()) or "H100"
    return "H100"


def _device_type(device: str, *, dry_run: bool = False) -> str:
    """The device kind a run is planned for: `auto` is this machine's; a named one is planned for as named, and a
    dry run may name a device this machine lacks (`device=cuda` on a laptop: the GPU run's precision, evaluation
    dtype and hashes)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device: unknown {device!r}; expected auto, cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available() and not dry_run:
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device here")
    return kind


def _check_train(train: TrainConfig, model: ModelConfig) -> Schedule:
    """What the fine-tune's settings must satisfy together (the budget, the global batch, the model's context, the
    schedule within the budget's steps); each field's own range is the schema's."""
    if train.pretrain_share_pct is None and train.tokens <= 0:
        raise ConfigError("train.tokens: must be positive when fine-tuning is enabled")
    wanted = train.global_batch_rows
    if wanted is not None and global_batch_rows(train) != wanted:
        world = world_size()
        per_process = train.micro_batch_size * world
        hint = (
            f"set train.grad_accum={wanted // per_process}"
            if wanted % per_process == 0
            else f"choose micro_batch_size x processes dividing {wanted}"
        )
        raise ConfigError(
            f"train.grad_accum: micro_batch_size {train.micro_batch_size} x grad_accum "
            f"{train.grad_accum} x {world} processes = {global_batch_rows(train)} rows per step, but "
            f"global_batch_rows is {wanted}: {hint}"
        )
    if train.grad_accum <= 0:  # after the global batch: train=paper derives it, and that check says why it is 0
        raise ConfigError(f"train.grad_accum: must be positive, got {train.grad_accum}")
    context = model.shape.context_length if model.shape is not None else None
    if context and train.seq_len > context:
        raise ConfigError(
            f"train.seq_len: {train.seq_len} is longer than model {model.name!r}'s context of "
            f"{context} tokens (model.shape.context_length)"
        )
    try:
        budget = plan_budget(train, pretrain_tokens=model.pretrain_tokens, num_processes=world_size())
        return schedule_for(train, budget.steps)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _check_architecture(model: ModelConfig, spec: MLASpec, shape: ModelShape) -> list[str]:
    """The model's architecture must be one the converter handles, asking for nothing it cannot keep exactly, with
    the layers `svd.convert_layers` asks for; read from its config.json (a random model: its family's defaults at
    the shape's depth), no weights. A hub model whose config.json cannot be read is checked at conversion."""
    facts, notes = probe_architecture(model)
    model_type = facts.get("model_type") if facts else None
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.id: {model.id!r} is a {model_type!r} model; the MLA conversion handles the decoder "
            f"families {', '.join(SUPPORTED_MODEL_TYPES)} (mla/families.py)"
        )
    problems = unsupported_features(SimpleNamespace(**facts)) if facts else []
    if problems:
        raise ConfigError(f"model.id: {model.id!r} ({model_type}) cannot be converted exactly: {'; '.join(problems)}")
    if spec.convert_layers != "all" and model_type is not None:
        from transformers import AutoConfig

        fields = {"num_hidden_layers": shape.num_layers} | {k: v for k, v in facts.items() if k != "model_type"}
        try:
            converted_layers(attention_windows(AutoConfig.for_model(model_type, **fields)), spec.convert_layers)
        except ValueError as err:
            raise ConfigError(f"svd.convert_layers: {model.id or model.name!r}: {err}") from err
    return notes


def _probe(check, group: str) -> list[str]:
    try:
        return check()
    except ValueError as err:
        raise ConfigError(str(err) if str(err).startswith(group) else f"{group}: {err}") from err


def _check_source(group: str, check, section) -> None:
    """Run a layer's own config check (models, data) on its section; report its error under the group's name."""
    try:
        check(section)
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(group) else f"{group}: {message}") from err


def _check_eval(evaluation: EvalConfig, model: ModelConfig) -> None:
    """The evaluation's own checks, run here so that a bad eval setting fails before fine-tuning, not after; and
    the long-context suite's lengths against the window it is scored in (the model's fine-tuning length, else its
    context), which the suite itself checks only after the fine-tune."""
    from ..evaluation.long_context import longest
    from ..evaluation.run import check_eval_config

    try:
        check_eval_config(evaluation)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        message = str(err)
        raise ConfigError(message if message.startswith("eval") else f"eval: {message}") from err
    window = model.finetune_length or (model.shape.context_length if model.shape is not None else None)
    long_context = evaluation.long_context
    if long_context.enabled and window and longest(long_context) > window:
        raise ConfigError(
            f"eval.long_context: its longest sequence ({longest(long_context)} tokens: lengths / "
            f"ppl_lengths) exceeds the evaluation window of {window} (model.finetune_length)"
        )


_SPEC_FIELDS = {
    "rope": "rope.strategy",
    "svd": "svd.method",
    "score": "rope.score",
    "sigma": "svd.sigma",
    "init": "svd.init",
    "allocation": "svd.allocation",
    "kv_elements": "svd.kv_elements",
    "rope_pairs": "svd.rope_pairs",
    "nope_keys": "rope.nope_keys",
    "key_weight": "svd.key_weight",
    "convert_layers": "svd.convert_layers",
    "r": "rope.r",
    "d_kv": "svd.d_kv",
    "head_dim": "model.shape",
    "num_heads": "model.shape",
}


def _field_for(message: str) -> str:
    """Prefix an MLASpec error ('unknown rope=...', 'r=9 is outside...', 'd_kv is required...')
    with the config field it came from."""
    match = re.match(r"(?:unknown )?([a-z_]+)", message)
    field = _SPEC_FIELDS.get(match.group(1)) if match else None
    return f"{field}: " if field else ""


PAPER_LR = 1e-4
_PRECISION_TAGS = {"fp32": "", "bf16-autocast": "bf16a", "bf16-master": "bf16m", "bf16-pure": "bf16p"}


def describe_trained(plan: RunPlan) -> str:
    """A readable name of the trained (or converted) model: model, conversion, recovery, budget, seed."""
    config = plan.config
    parts = [config.model.name]
    if plan.spec is None:
        parts.append("original" if plan.variant == "original" else "full-attention")
    else:
        parts.extend(plan.spec.name_parts())
    if plan.distill:
        parts.append(f"distill{config.distill.sequences}x{config.distill.epochs}")
    if plan.fine_tune:
        t = config.train
        budget = _short_count(t.tokens) if t.pretrain_share_pct is None else f"{t.pretrain_share_pct}pct"
        recipe = "" if config.objective.name == "ce" else f"-{config.objective.name}"
        recipe += "-attn" if t.freeze_non_attention else ""
        recipe += f"-lr{float(t.lr):g}" if float(t.lr) != PAPER_LR else ""
        recipe += "-compiled" if t.compile else ""
        recipe += f"-{_PRECISION_TAGS[plan.precision.mode]}" if _PRECISION_TAGS[plan.precision.mode] else ""
        tag = (t.data or config.data).tag  # what it recovered on, unless the default corpus
        recipe += f"-{tag}" if tag else ""
        parts.append(f"ft{budget}{recipe}")
    parts.append(f"s{config.seed}")
    return "__".join(str(p) for p in parts)


def describe_conversion(plan: RunPlan) -> str:
    """The untrained conversion's name: model and conversion."""
    return "__".join([plan.config.model.name, *plan.spec.name_parts(), "converted"])


def describe(plan: RunPlan) -> str:
    """A readable run name: the trained model's name, then what the evaluation adds (KV quantization)."""
    name = describe_trained(plan)
    if plan.kv_quant:
        head, _, seed = name.rpartition("__")
        q = plan.kv_quant
        grouping = "" if q.grouping == "tokens" else f"-{q.grouping}"
        name = f"{head}__{q.backend}{q.nbits}{grouping}__{seed}"
    return name


def _short_count(n) -> str:
    n = float(n)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}"
