"""From a composed Hydra config to a validated run plan, before any weight is loaded. The app's entry converts the
config to the typed RunConfig once (`run_config`); `validate` composes the plan from the parts each layer makes and
checks itself: the conversion (mla/spec.py: `MLASpec.from_sections`), the training (train/plan.py) and the evaluation
(evaluation/plan.py), plus the runner's own identity and launch. Nothing below the entry sees a DictConfig."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from omegaconf import DictConfig

from ..confutil import typed_section
from ..data.sources import check_data_config, mixture_parts, probe_hub_datasets
from ..evaluation.plan import EvalPlan, plan_evaluation
from ..mla.families import SUPPORTED_MODEL_TYPES, attention_windows, unsupported_features
from ..mla.lowrank import FACTOR_SPLIT
from ..mla.spec import ConversionPlan, MLASpec, ModelShape, converted_layers
from ..models import check_model_config, folder_config, probe_architecture, shape_of
from ..schema.identity import digest, evaluation_identity, setting_identity, trained_identity
from ..schema.sections import ModelConfig, RunConfig, ShapeConfig
from ..train.objectives import build_objective
from ..train.plan import TrainingPlan, global_batch_rows, intermediate_size, plan_training, world_size
from ..train.precision import cpu_bf16_pays


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the offending field."""


@dataclass(frozen=True)
class RunIdentity:
    """The run's hashes (schema/identity.py): what its folder and its kept models are named by."""

    trained_hash: str  # the trained (or converted) model's identity
    conversion_hash: str | None  # the untrained conversion's identity: recipes trained from it share it
    eval_hash: str  # this evaluation's identity
    setting_hash: str  # the trained and evaluation identities but the seed: one row of a table
    run_hash: str  # the trained and evaluation identities together: the run's folder
    name: str  # the run's readable name: its folder is `<name>-<run_hash>`
    trained_name: str  # the kept trained model's: `_trained/<trained_name>-<trained_hash>`
    conversion_name: str | None  # the kept untrained conversion's (None: nothing converted)


@dataclass(frozen=True)
class LaunchPlan:
    """Where the run is planned to run and what could not be settled before loading."""

    device_type: str  # cuda | cpu: part of the identity (numbers differ between devices)
    processes: int  # this launch's (torchrun / SLURM tasks)
    notes: tuple[str, ...] = ()  # what validation could not check (offline), said before heavy work
    blocked: tuple[str, ...] = ()  # dry runs only: what this machine lacks to run the plan (a real run raises)

    def describe(self) -> list[str]:
        lines = [f"{self.device_type}, {self.processes} process(es)"]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"blocked on this machine: {why}" for why in self.blocked]
        return lines


@dataclass(frozen=True)
class RunPlan:
    """A validated run: each part made by the layer that owns its stage; `config` is the typed config with what
    the entry resolved on this machine (device, precision, eval dtype, global batch, dropped mixture parts)."""

    config: RunConfig
    identity: RunIdentity
    conversion: ConversionPlan  # mla/spec.py
    training: TrainingPlan  # train/plan.py
    evaluation: EvalPlan  # evaluation/plan.py
    launch: LaunchPlan


def run_config(cfg: DictConfig) -> RunConfig:
    """The run's typed config: a composed (or recorded) config merged onto the schema, its types and declared
    constraints checked, ConfigError naming the field. The one conversion, at the app's entry."""
    try:
        config = typed_section(RunConfig, cfg)
        for group, data in (("data", config.data), ("train.data", config.train.data)):
            # `teacher: ${model}` arrives typed when composed, a plain mapping from a recorded config.yaml: one form
            if data is not None and isinstance(data.teacher, dict):
                data.teacher = typed_section(ModelConfig, data.teacher, f"{group}.teacher")
        return config
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate(config: RunConfig, *, bf16_pays=None) -> RunPlan:
    """The run's plan: the config's checks that need several fields or the outside world, each in the layer that
    owns it (the conversion's in mla, the fine-tune's in train, the evaluation's in evaluation), and what depends on
    this machine (device, `train.precision=auto`, `eval.dtype`) resolved into a copy, the plan's `config`; raise
    ConfigError naming the field. No weight is loaded; a hub id's config.json may be read when the hub is reachable.
    `bf16_pays(hidden, intermediate) -> (fast, why)`: what decides `auto` and `eval.dtype=fastest` on CPU (default:
    this process's own timing, `cpu_bf16_pays`)."""
    bf16_pays = bf16_pays or cpu_bf16_pays
    config = copy.deepcopy(config)  # what this machine resolves is written into the plan's own copy
    model, train = config.model, config.train
    dry_run = config.dry_run
    blocked = [] if dry_run else None  # a dry run plans for the machine that will run it: what it lacks is said
    _named("model", check_model_config, model)
    _named("data", check_data_config, config.data, missing_access=blocked)
    if train.data is not None:  # recovery text other than the run's corpus (calibration, held-out)
        try:
            check_data_config(train.data, missing_access=blocked)
        except ValueError as err:
            raise ConfigError(f"train.{err}" if str(err).startswith("data.") else f"train.data: {err}") from err
    conversion, notes = _conversion(config)
    fine_tune = train.enabled and config.variant != "original"
    if train.data is not None and not fine_tune:
        raise ConfigError(
            "train.data: recovery text is set, but this run fine-tunes nothing "
            f"(train.enabled={train.enabled}, variant={config.variant})"
        )
    if config.variant == "finetuned_full_attention" and not train.enabled:
        raise ConfigError("train.enabled: the full-attention fine-tune baseline needs fine-tuning enabled")
    device_type = _device_type(config.device, dry_run=dry_run)
    shape = conversion.shape
    with _as_config_error():
        evaluation = plan_evaluation(
            config.eval,
            config.kv_quant,
            model,
            converted=config.variant == "mla",
            device_type=device_type,
            bf16_pays=lambda: bf16_pays(shape.hidden_size, intermediate_size(model, shape)),
        )
        objective = build_objective(config.objective) if fine_tune else None
        if objective is not None and objective.needs_teacher and conversion.spec is None:
            raise ConfigError(
                f"objective.name: {objective.name!r} distils the original model into its conversion; "
                f"variant={config.variant!r} has no conversion"
            )
        training = plan_training(
            train,
            train.data or config.data,
            model,
            shape,
            fine_tune=fine_tune,
            distill=conversion.spec is not None and config.distill.enabled,
            teacher=objective is not None and objective.needs_teacher,
            device_type=device_type,
            dry_run=dry_run,
            bf16_pays=bf16_pays,
        )
    if config.data.source == "hub":
        notes += _named("data", probe_hub_datasets, config.data.mixture)

    # what this machine resolved is written into the config: the run's config.yaml says what ran
    config.device = device_type if config.device == "auto" else config.device
    config.eval.dtype = evaluation.dtype
    for data in filter(None, (config.data, train.data)):
        # the hub mixture parts that `missing_parts: renormalise` drops on this machine: which text a model trains
        # on depends on them, so they are written into the config and its identity
        data.dropped_parts = sorted(part["name"] for part in mixture_parts(data)[1]) if data.source == "hub" else []
    if training.fine_tune:
        train.precision = training.precision.mode
        train.global_batch_rows = global_batch_rows(train)
    return RunPlan(
        config=config,
        identity=_identity(config, conversion.spec, training, evaluation.kv_quant),
        conversion=conversion,
        training=training,
        evaluation=evaluation,
        launch=LaunchPlan(device_type, world_size(), tuple(notes), tuple(blocked or ())),
    )


def _identity(config: RunConfig, spec: MLASpec | None, training: TrainingPlan, kv_quant) -> RunIdentity:
    """The hashes of the trained model, the untrained conversion, the evaluation and the setting, and the names
    their folders read by."""
    calibrates = spec is not None and spec.needs_calibration
    whitened = (
        FACTOR_SPLIT
        if training.trains and spec is not None and spec.svd != "none" and config.svd.init != "weight"
        else None
    )  # how whitened factors are split changes the training
    trained = trained_identity(
        config,
        converts=spec is not None,
        trains=training.fine_tune,
        distills=training.distill,
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
    trained_hash, eval_hash = digest(trained), digest(evaluation)
    return RunIdentity(
        trained_hash=trained_hash,
        conversion_hash=digest(conversion) if conversion else None,
        eval_hash=eval_hash,
        run_hash=digest({"trained": trained_hash, "eval": eval_hash}),
        setting_hash=digest(setting_identity(trained, evaluation)),
        **dict(zip(("trained_name", "conversion_name", "name"), _names(config, spec, training, kv_quant))),
    )


def _conversion(config: RunConfig) -> tuple[ConversionPlan, list[str]]:
    """The conversion part (mla/spec.py) and what could not be checked offline: a saved conversion's own spec, the
    rope/svd sections' spec checked against the model's shape and architecture, or none."""
    model = config.model
    # a local folder's config.json: its shape facts when the config gives none, or a saved conversion
    saved = folder_config(model.id) if model.source == "local" else None
    facts = model.shape if model.shape is not None or saved is None else ShapeConfig(**shape_of(saved))
    if facts is None:
        raise ConfigError(
            f"model.shape: no shape facts for model {model.name!r}: give model.shape, or a local "
            "folder whose config.json holds them"
        )
    shape = ModelShape.from_facts(facts)
    if getattr(saved, "model_type", None) == "mha2mla":
        if config.variant != "mla":
            raise ConfigError(
                f"variant: {model.id!r} holds a saved MLA conversion; evaluate it with variant=mla "
                "(its rope/svd settings are read from its config.json, not converted again)"
            )
        spec = MLASpec.create(shape, **MLASpec.recorded(saved.mla).to_dict())  # as the conversion recorded it
        return ConversionPlan(config.variant, shape, spec), []
    if config.variant != "mla":
        return ConversionPlan(config.variant, shape), []
    with _as_config_error():
        spec = MLASpec.from_sections(config.rope, config.svd, shape)
    return ConversionPlan(config.variant, shape, spec), _check_architecture(model, spec, shape)


@contextlib.contextmanager
def _as_config_error():
    """A layer's ValueError (its message names the field) as the runner's ConfigError."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _named(group: str, check, *args, **kwargs):
    """A layer's own check (models, data) on its section; its error as a ConfigError under the group's name."""
    try:
        return check(*args, **kwargs)
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(group) else f"{group}: {message}") from err


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


PAPER_LR = 1e-4
_PRECISION_TAGS = {"fp32": "", "bf16-autocast": "bf16a", "bf16-master": "bf16m", "bf16-pure": "bf16p"}


def _names(config: RunConfig, spec: MLASpec | None, training: TrainingPlan, kv_quant) -> tuple[str, str | None, str]:
    """Readable names of the trained (or converted) model (model, conversion, recovery, budget, seed), of the
    untrained conversion (None: nothing converted), and of the run (the trained model's, then what the evaluation
    adds: KV quantization)."""
    parts = [config.model.name]
    if spec is None:
        parts.append("original" if config.variant == "original" else "full-attention")
    else:
        parts.extend(spec.name_parts())
    if training.distill:
        parts.append(f"distill{config.distill.sequences}x{config.distill.epochs}")
    if training.fine_tune:
        t = config.train
        budget = _short_count(t.tokens) if t.pretrain_share_pct is None else f"{t.pretrain_share_pct}pct"
        recipe = "" if config.objective.name == "ce" else f"-{config.objective.name}"
        recipe += "-attn" if t.freeze_non_attention else ""
        recipe += f"-lr{float(t.lr):g}" if float(t.lr) != PAPER_LR else ""
        recipe += "-compiled" if t.compile else ""
        tag = _PRECISION_TAGS[training.precision.mode]
        recipe += f"-{tag}" if tag else ""
        tag = (t.data or config.data).tag  # what it recovered on, unless the default corpus
        recipe += f"-{tag}" if tag else ""
        parts.append(f"ft{budget}{recipe}")
    trained = "__".join(str(p) for p in [*parts, f"s{config.seed}"])
    conversion = "__".join([config.model.name, *spec.name_parts(), "converted"]) if spec is not None else None
    run = trained
    if kv_quant:
        grouping = "" if kv_quant.grouping == "tokens" else f"-{kv_quant.grouping}"
        run = "__".join(str(p) for p in [*parts, f"{kv_quant.backend}{kv_quant.nbits}{grouping}", f"s{config.seed}"])
    return trained, conversion, run


def _short_count(n) -> str:
    n = float(n)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}"
