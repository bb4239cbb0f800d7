"""From a composed Hydra config to a validated run plan, before any weight is loaded."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from ..data.sources import check_data_config
from ..mla.spec import MLASpec, ModelShape
from ..models import check_model_config, folder_config, shape_of

VARIANTS = ("original", "finetuned_full_attention", "mla")
KV_BACKENDS = {"hqq": (1, 2, 3, 4, 8), "quanto": (2, 4)}

# integer division for configs: `d_kv: ${mla_div:${model.shape.head_dim},4}`
if not OmegaConf.has_resolver("mla_div"):
    OmegaConf.register_new_resolver("mla_div", lambda a, b: int(a) // int(b))


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the offending field."""


@dataclass(frozen=True)
class RunPlan:
    variant: str                 # original | finetuned_full_attention | mla
    shape: ModelShape
    spec: MLASpec | None         # None: the model is not converted
    fine_tune: bool
    kv_quant: dict | None        # {"backend", "nbits", "residual_length", "q_group_size"} or None

    @property
    def table_variant(self) -> str:
        """The paper's row kind: original, finetuned_full_attention, partial_rope, partial_rope+svd."""
        if self.spec is None:
            return self.variant
        return "partial_rope" if self.spec.svd == "none" else "partial_rope+svd"


def validate(cfg: DictConfig) -> RunPlan:
    """Check the composed config against the model's recorded shape facts; raise ConfigError naming
    the field. Nothing is loaded or downloaded here."""
    if cfg.variant not in VARIANTS:
        raise ConfigError(f"variant: unknown {cfg.variant!r}; expected one of {VARIANTS}")
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
    _check_source("data", check_data_config, cfg.data)
    _check_eval(cfg.eval)

    spec = None
    if saved_mla:
        mla = saved.mla
        spec = MLASpec.create(shape, rope=mla["rope"], r=mla["r"], svd=mla["svd"], d_kv=mla.get("d_kv"),
                              score=mla.get("score", "product"), sigma=mla.get("sigma", "up"),
                              init=mla.get("init", "weight"))
    elif cfg.variant == "mla":
        r = cfg.rope.r
        if r is None and cfg.rope.strategy not in ("full", "none"):
            r = shape.head_dim // 16  # the paper's default
        try:
            spec = MLASpec.create(
                shape, rope=cfg.rope.strategy, r=r, svd=cfg.svd.method, d_kv=cfg.svd.d_kv,
                score=cfg.rope.score, sigma=cfg.svd.sigma, init=cfg.svd.get("init", "weight"),
            )
        except ValueError as err:
            raise ConfigError(_field_for(str(err)) + str(err)) from err

    kv_quant = None
    if cfg.kv_quant.backend is not None:
        backend, nbits = cfg.kv_quant.backend, cfg.kv_quant.nbits
        if backend not in KV_BACKENDS:
            raise ConfigError(f"kv_quant.backend: unknown {backend!r}; expected one of {tuple(KV_BACKENDS)}")
        if nbits not in KV_BACKENDS[backend]:
            raise ConfigError(f"kv_quant.nbits: {nbits} is not supported by {backend} ({KV_BACKENDS[backend]})")
        kv_quant = OmegaConf.to_container(cfg.kv_quant, resolve=True)
        from ..evaluation.kv import KVQuant

        try:  # the evaluation's own check (bits, grouping vs architecture), before any fine-tuning
            KVQuant.from_cfg(kv_quant).check_model(converted=cfg.variant == "mla")
        except ValueError as err:
            raise ConfigError(f"kv_quant: {err}") from err

    fine_tune = bool(cfg.train.enabled) and cfg.variant != "original"
    if cfg.variant == "finetuned_full_attention" and not cfg.train.enabled:
        raise ConfigError("train.enabled: the full-attention fine-tune baseline needs fine-tuning enabled")
    if fine_tune:
        for key in ("seq_len", "micro_batch_size", "grad_accum"):
            if int(cfg.train[key]) <= 0:
                raise ConfigError(f"train.{key}: must be positive, got {cfg.train[key]}")
        if cfg.train.pretrain_share_pct is None and int(cfg.train.tokens) <= 0:
            raise ConfigError("train.tokens: must be positive when fine-tuning is enabled")
    return RunPlan(variant=cfg.variant, shape=shape, spec=spec, fine_tune=fine_tune, kv_quant=kv_quant)


def _check_source(group: str, check, cfg_group: DictConfig) -> None:
    """Run a layer's own config check (models, data); report its error under the group's name."""
    try:
        check(cfg_group)
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(group) else f"{group}: {message}") from err


def _check_eval(eval_cfg: DictConfig) -> None:
    """The evaluation's own parser, run here so that a bad eval setting fails before fine-tuning, not after."""
    from ..evaluation import parse_eval_config

    try:
        parse_eval_config(OmegaConf.to_container(eval_cfg, resolve=True))
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        message = str(err)
        raise ConfigError(message if message.startswith("eval") else f"eval: {message}") from err


_SPEC_FIELDS = {"rope": "rope.strategy", "svd": "svd.method", "score": "rope.score", "sigma": "svd.sigma",
                "init": "svd.init",
                "r": "rope.r", "d_kv": "svd.d_kv", "head_dim": "model.shape", "num_heads": "model.shape"}


def _field_for(message: str) -> str:
    """Prefix an MLASpec error ('unknown rope=...', 'r=9 is outside...', 'd_kv is required...')
    with the config field it came from."""
    match = re.match(r"(?:unknown )?([a-z_]+)", message)
    field = _SPEC_FIELDS.get(match.group(1)) if match else None
    return f"{field}: " if field else ""


def describe(plan: RunPlan, cfg: DictConfig) -> str:
    """A readable run name: model, conversion, quantization, budget, seed."""
    parts = [cfg.model.name]
    if plan.spec is None:
        parts.append("original" if plan.variant == "original" else "full-attention")
    else:
        s = plan.spec
        rope = {"full": "fullrope", "none": "nope"}.get(s.rope, f"{s.rope}-r{s.r}")
        if s.rope == "2-norm" and s.score != "product":
            rope += f"-{s.score}"
        parts.append(rope)
        svd = "nosvd" if s.svd == "none" else f"{s.svd}-dkv{s.d_kv}"
        svd += "-sqrt" if s.sigma == "sqrt" else ""
        svd += "-act" if s.init == "activation" else ""
        parts.append(svd)
    if plan.kv_quant:
        grouping = plan.kv_quant.get("grouping", "tokens")
        parts.append(f"{plan.kv_quant['backend']}{plan.kv_quant['nbits']}" + ("" if grouping == "tokens" else f"-{grouping}"))
    if plan.spec is not None and cfg.distill.enabled:
        parts.append(f"distill{cfg.distill.sequences}x{cfg.distill.epochs}")
    if plan.fine_tune:
        parts.append(f"ft{_short_count(cfg.train.tokens) if cfg.train.pretrain_share_pct is None else str(cfg.train.pretrain_share_pct) + 'pct'}")
    parts.append(f"s{cfg.seed}")
    return "__".join(str(p) for p in parts)


_PROBE_KEYS = ("eval_every", "eval_batches")


def config_hash(cfg: DictConfig, keys=("model", "data", "rope", "svd", "kv_quant", "train", "eval",
                                        "variant", "seed", "calibration", "distill")) -> str:
    """A short digest of everything that determines a run's numbers (not where it logs)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    relevant = {k: container.get(k) for k in keys if k in container}
    if relevant.get("variant") != "mla":
        for key in ("rope", "svd", "calibration", "distill"):
            relevant.pop(key, None)
    if relevant.get("variant") == "original":
        relevant.pop("train", None)
    for key in _PROBE_KEYS:  # the in-training probe observes the run, it does not change its numbers
        (relevant.get("train") or {}).pop(key, None)
    blob = json.dumps(relevant, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _short_count(n) -> str:
    n = float(n)
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}"
