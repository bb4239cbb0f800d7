"""What a conversion is asked to do, and whether a model's shape allows it.

No weights are touched here: the runner validates a composed config against a model's recorded shape facts
with these functions before anything is loaded. RoPE strategies and low-rank inits are looked up in their
registries (`mla/rope/`, `mla/lowrank_init/`), which also say what calibration they need and how they are named.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace

from ..schema.sections import ALLOCATIONS  # noqa: F401  (re-exported: the accepted set, declared with its help)
from . import nope_keys as nope
from .families import FAMILIES, norm_groups
from .lowrank_init import LOWRANK_INITS
from .rope import ROPE_STRATEGIES

SVD_VARIANTS = ("joint", "split", "none")
SCORES = ("product", "sum", "rotation")
SIGMA_PLACEMENTS = ("up", "sqrt")
# which attention layers a conversion turns into MLA: every one, the full-attention ones, or the sliding-window ones
CONVERT_LAYERS = ("all", "global", "sliding")


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of a decoder that a conversion depends on; `key_norm` is its family's QK-norm over
    the keys ('head' | 'projection' | None, mla/families.py)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    key_norm: str | None = None

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        family = FAMILIES.get(getattr(config, "model_type", None))
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            key_norm=family.qk_norm if family is not None else getattr(config, "k_norm", None),
        )

    @classmethod
    def from_facts(cls, facts) -> "ModelShape":
        """The shape a model config's shape block states (schema ShapeConfig, or a mapping of its keys)."""
        get = facts.get if isinstance(facts, dict) else lambda key, default=None: getattr(facts, key, default)
        return cls(
            num_layers=int(get("num_layers")),
            hidden_size=int(get("hidden_size")),
            num_heads=int(get("num_heads")),
            num_kv_heads=int(get("num_kv_heads")),
            head_dim=int(get("head_dim")),
            key_norm=get("key_norm"),
        )

    @property
    def key_norm_scales(self) -> int:
        """Elements per token and layer cached beside the latent for the key norm: 1/rms of each norm group."""
        return norm_groups(self.key_norm, self.num_kv_heads)


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """A validated conversion recipe (see METHOD.md). Build it with `MLASpec.create`, or from a run config's
    sections with `MLASpec.from_sections`."""

    rope: str  # a registered RoPE strategy (mla/rope/)
    r: int | None = None  # pairs kept per KV head; None under a KV budget (kv_elements): its split decides
    svd: str  # joint | split | none
    d_kv: int | None = None  # the latent's width per KV head (svd joint | split)
    score: str = "product"
    sigma: str = "up"
    init: str = "weight"
    allocation: str = "uniform"
    kv_elements: int | None = None  # a KV budget per token and layer (rope dims + latent) instead of r / d_kv
    rope_pairs: int | None = None  # with kv_elements: rotated pairs every layer keeps; None = searched (budget.py)
    nope_keys: str = "plain"  # the keys of pairs that lose RoPE: plain | attended (mla/nope_keys.py)
    key_weight: float | None = 1.0  # joint SVD: the init's NoPE-key error weight times this; None = searched
    convert_layers: str = "all"  # which attention layers become MLA (CONVERT_LAYERS; `converted_layers`)

    @classmethod
    def create(cls, shape: ModelShape, **options) -> "MLASpec":
        """Check every field against `shape`; raise ValueError naming the field on bad input. Whether the model
        has the layers `convert_layers` asks for is checked against its windows (`converted_layers`). `options`: the
        fields (a missing or unknown one is a TypeError), each field's default where not given."""
        asked = cls(**options)
        rope, r, svd, d_kv, score, sigma = asked.rope, asked.r, asked.svd, asked.d_kv, asked.score, asked.sigma
        init, allocation, kv_elements, rope_pairs = asked.init, asked.allocation, asked.kv_elements, asked.rope_pairs
        nope_keys, key_weight, convert_layers = asked.nope_keys, asked.key_weight, asked.convert_layers
        strategy = ROPE_STRATEGIES.get(rope)
        _check_choice("nope_keys", nope_keys, nope.NOPE_KEYS)
        _check_choice("convert_layers", convert_layers, CONVERT_LAYERS)
        if convert_layers != "all" and allocation != "uniform":
            raise ValueError(
                f"convert_layers={convert_layers!r} with allocation={allocation!r}: the allocation spreads one "
                "latent budget over every layer; converting some layers takes allocation='uniform'"
            )
        key_weight = _check_key_weight(key_weight, svd, kv_elements)
        _check_choice("svd", svd, SVD_VARIANTS)
        _check_choice("score", score, SCORES)
        if score not in strategy.scores:
            raise ValueError(
                f"score={score!r} has no meaning for rope={rope!r}: it takes {', '.join(map(repr, strategy.scores))}"
            )
        _check_choice("sigma", sigma, SIGMA_PLACEMENTS)
        LOWRANK_INITS.get(init)
        _check_choice("allocation", allocation, ALLOCATIONS)
        if shape.head_dim % 2:
            raise ValueError(f"head_dim={shape.head_dim} is odd; RoPE needs an even head dimension")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"num_heads={shape.num_heads} is not a multiple of num_kv_heads={shape.num_kv_heads}")
        if strategy.layout == "shared" and shape.key_norm == "head" and shape.num_kv_heads > 1:
            raise ValueError(
                f"rope={rope!r} mixes the KV heads at each frequency into one shared rope key, but this model "
                "normalises each KV head's key by its own rms: the mixed keys are not one latent times one scalar "
                "per token, so the conversion could not be exact. Use a per-head strategy (2-norm, high, low, "
                "uniform, ...)"
            )
        if kv_elements is not None or rope_pairs is not None:  # r has no meaning: the budget's split decides
            _check_budget(shape, strategy, svd, d_kv, allocation, kv_elements, rope_pairs)
            return replace(asked, r=None, key_weight=key_weight)
        if allocation == "measured":
            raise ValueError(
                "allocation='measured' needs kv_elements: it spreads a KV budget's latent over the layers "
                "by the model's loss on a selection sample"
            )
        r = strategy.resolve_r(r, shape.head_dim)

        if svd == "none":
            if d_kv is not None:
                raise ValueError(f"d_kv={d_kv} is given but svd='none' keeps full-rank keys and values")
            if init != "weight":
                raise ValueError(f"init={init!r} has nothing to initialise: svd='none' keeps full-rank keys and values")
            if allocation != "uniform":
                raise ValueError(f"allocation={allocation!r} has no latent to allocate: svd='none'")
        else:
            if d_kv is None:
                raise ValueError(f"d_kv is required for svd='{svd}'")
            if isinstance(d_kv, bool) or not isinstance(d_kv, int) or d_kv <= 0:
                raise ValueError(f"d_kv must be a positive integer, got {d_kv!r}")
            if svd == "split" and d_kv % 2:
                raise ValueError(f"d_kv={d_kv} must be even for svd='split' (K and V get d_kv/2 each)")
            if allocation != "uniform" and svd != "joint":
                raise ValueError(f"allocation={allocation!r} needs svd='joint' (one latent per layer to size)")
            limit = max_d_kv(shape, r, svd)
            if d_kv > limit:
                raise ValueError(
                    f"d_kv={d_kv} is above the attainable rank for svd='{svd}' at r={r}: "
                    f"at most {limit} per KV head for this model (head_dim={shape.head_dim}, "
                    f"hidden_size={shape.hidden_size}, num_kv_heads={shape.num_kv_heads})"
                )
        return replace(asked, r=r, key_weight=key_weight)

    @classmethod
    def from_sections(cls, rope, svd, shape: ModelShape) -> "MLASpec":
        """The conversion a run config's `rope` and `svd` sections describe (schema RopeConfig / SvdConfig), checked
        against `shape`; the ValueError names the config field it came from (`SECTION_FIELDS`). `rope.r` null: the
        strategy's default."""
        sections = {"rope": rope, "svd": svd}
        options = {name: getattr(sections[section], key) for name, (section, key) in SECTION_FIELDS.items()}
        if options["r"] is None:
            options["r"] = default_r(options["rope"], shape.head_dim)
        try:
            return cls.create(shape, **options)
        except ValueError as err:
            raise ValueError(f"{_config_field(str(err))}{err}") from err

    @classmethod
    def recorded(cls, mla: dict) -> "MLASpec":
        """The spec as a converted config records it (`MLAConfig.mla`, which holds more keys than the spec);
        a folder saved before a field existed gets the field's default."""
        return cls(**{f.name: mla[f.name] for f in fields(cls) if f.name in mla})

    @property
    def statistics(self) -> tuple[str, ...]:
        """The calibration statistics this conversion reads (empty: it needs no calibration data)."""
        init = LOWRANK_INITS.get(self.init).statistics if self.svd != "none" else ()
        rope = ROPE_STRATEGIES.get(self.rope).needs(self.score) + nope.statistics(self.nope_keys)
        return tuple(dict.fromkeys(rope + init))

    @property
    def searches(self) -> bool:
        """A KV budget whose rope/latent split, key weight or per-layer latent widths are searched on a selection
        sample (mla/budget.py)."""
        return self.kv_elements is not None and (
            self.rope_pairs is None or self.key_weight is None or self.allocation == "measured"
        )

    @property
    def needs_calibration(self) -> bool:
        return bool(self.statistics)

    def calibrated_fields(self) -> list[str]:
        """The settings that ask for calibration data, as `field='value'` (for error messages)."""
        fields = [f"rope={self.rope!r}"] if ROPE_STRATEGIES.get(self.rope).needs(self.score) else []
        if nope.statistics(self.nope_keys):
            fields.append(f"nope_keys={self.nope_keys!r}")
        if self.svd != "none" and LOWRANK_INITS.get(self.init).statistics:
            fields.append(f"init={self.init!r}")
        return fields

    def name_parts(self) -> tuple[str, str]:
        """The run-name parts of this conversion: RoPE (e.g. '2-norm-r4', '-att' for attended NoPE keys) and
        low rank ('joint-dkv16-act'; under a KV budget 'joint-kv72-search-bkv' or 'joint-kv72-p16-bkv')."""
        strategy = ROPE_STRATEGIES.get(self.rope)
        if self.kv_elements is not None:
            rope = strategy.name + ("" if self.score == strategy.scores[0] else f"-{self.score}")
            pairs = "search" if self.rope_pairs is None else f"p{self.rope_pairs}"
            width = f"{self.svd}-kv{self.kv_elements}-{pairs}"
        else:
            rope, width = strategy.label(self.r, self.score), f"{self.svd}-dkv{self.d_kv}"
        rope += "-att" if self.nope_keys == "attended" else ""
        rope += "" if self.convert_layers == "all" else f"-{self.convert_layers}-layers"
        if self.svd == "none":
            return rope, "nosvd"
        key = "" if self.key_weight == 1.0 else "kwsearch" if self.key_weight is None else f"kw{self.key_weight:g}"
        options = [
            width,
            "sqrt" if self.sigma == "sqrt" else "",
            LOWRANK_INITS.get(self.init).label,
            "" if self.allocation == "uniform" else self.allocation,
            key,
        ]
        return rope, "-".join(o for o in options if o)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ConversionPlan:
    """What a run does to the model's attention: `variant` original | finetuned_full_attention (kept as it is) or
    mla (converted as `spec` says, or a saved conversion's own spec), on a model of `shape`."""

    variant: str
    shape: ModelShape
    spec: MLASpec | None = None  # None: the model is not converted

    @property
    def table_variant(self) -> str:
        """The paper's row kind: original, finetuned_full_attention, partial_rope, partial_rope+svd."""
        if self.spec is None:
            return self.variant
        return "partial_rope" if self.spec.svd == "none" else "partial_rope+svd"

    def describe(self) -> list[str]:
        """The dry run's lines for the conversion part."""
        if self.spec is None:
            return [f"none ({self.variant})"]
        rope, latent = self.spec.name_parts()
        needs = ", ".join(self.spec.statistics) or "none"
        return [
            f"{rope} / {latent}: KV cache {kv_ratio(self.shape, self.spec) - 1:+.2%} against the original's, "
            "per token and converted layer",
            f"calibration statistics: {needs}"
            + ("; a selection sample (KV-budget search)" if self.spec.searches else ""),
        ]


# each spec field -> (section, field) of the run config that states it (schema RopeConfig / SvdConfig)
SECTION_FIELDS = {
    "rope": ("rope", "strategy"),
    "r": ("rope", "r"),
    "score": ("rope", "score"),
    "nope_keys": ("rope", "nope_keys"),
    "svd": ("svd", "method"),
    "d_kv": ("svd", "d_kv"),
    "sigma": ("svd", "sigma"),
    "init": ("svd", "init"),
    "allocation": ("svd", "allocation"),
    "kv_elements": ("svd", "kv_elements"),
    "rope_pairs": ("svd", "rope_pairs"),
    "key_weight": ("svd", "key_weight"),
    "convert_layers": ("svd", "convert_layers"),
}
_SHAPE_FIELDS = ("head_dim", "num_heads")  # a shape error: the model's shape facts


def _config_field(message: str) -> str:
    """'rope.strategy: ' for an error about a spec field ('unknown rope=...', 'r=9 is outside...',
    'd_kv is required...'), 'model.shape: ' for one about the shape, else ''."""
    match = re.match(r"(?:unknown )?([a-z_]+)", message)
    name = match.group(1) if match else None
    if name in SECTION_FIELDS:
        return ".".join(SECTION_FIELDS[name]) + ": "
    return "model.shape: " if name in _SHAPE_FIELDS else ""


def default_r(rope: str, head_dim: int) -> int | None:
    """r for a config that leaves it null (the strategy's default, the paper's d_h/16 for most); None for an
    unknown strategy, which `MLASpec.create` then reports."""
    strategy = ROPE_STRATEGIES.find(rope)
    return None if strategy is None else strategy.default_r(head_dim)


def max_d_kv(shape: ModelShape, r: int, svd: str) -> int:
    """The largest per-KV-head latent width whose truncated SVD is still of full attainable rank. The NoPE
    keys have rank n_kv*(d_h-2r) in either layout (RoRoPE's d_h-dim projected keys included)."""
    n_kv, d_h, d = shape.num_kv_heads, shape.head_dim, shape.hidden_size
    nope_rows = n_kv * (d_h - 2 * r)
    v_rows = n_kv * d_h
    if svd == "joint":
        return min(nope_rows + v_rows, d) // n_kv
    if svd == "split":
        return 2 * (min(nope_rows, v_rows, d) // n_kv)
    raise ValueError(f"svd='{svd}' has no latent width")


def kv_elements_per_token(shape: ModelShape, spec: MLASpec) -> int:
    """Cached elements per token and layer: k_rope (n_kv*2r) plus the latent (n_kv*d_kv), or the budget; plus,
    under a key norm, its 1/rms per norm group (`key_norm_scales`)."""
    if spec.kv_elements is not None:
        return spec.kv_elements + shape.key_norm_scales
    n_kv, d_h = shape.num_kv_heads, shape.head_dim
    latent = n_kv * spec.d_kv if spec.svd != "none" else n_kv * (2 * d_h - 2 * spec.r)
    return n_kv * 2 * spec.r + latent + shape.key_norm_scales


def converted_layers(windows: list[int | None], convert_layers: str) -> list[bool]:
    """Per layer, whether `convert_layers` turns it into MLA, given each layer's sliding window (None: full
    attention; `families.attention_windows`). 'global' and 'sliding' need a model with both kinds of layer
    (elsewhere one of them would be 'all' and the other nothing): ValueError otherwise."""
    _check_choice("convert_layers", convert_layers, CONVERT_LAYERS)
    if convert_layers == "all":
        return [True] * len(windows)
    if all(w is None for w in windows) or all(w is not None for w in windows):
        kind = "sliding-window" if all(w is None for w in windows) else "full-attention"
        raise ValueError(
            f"convert_layers={convert_layers!r}: this model has no {kind} layer (windows per layer: {windows}), "
            "so there is no choice of layers to make; use convert_layers='all'"
        )
    return [(w is None) == (convert_layers == "global") for w in windows]


def cache_elements_per_sequence(
    shape: ModelShape, windows: list[int | None], length: int, spec: MLASpec | None = None
) -> dict[str, int]:
    """Elements one sequence's cache holds after `length` tokens, by layer kind ('full', 'sliding') and 'total'.

    A full-attention layer holds every token; a sliding one what transformers' `DynamicSlidingWindowLayer` keeps
    between calls, min(length, window - 1) (a call adds its own tokens while it runs). Per token and layer an
    original layer holds its keys and values (2 n_kv d_h), an MLA one `kv_elements_per_token`. `spec` None: the
    original model; else the layers `spec.convert_layers` picks are MLA and the others stay original. Times the
    cache dtype's bytes for bytes (uniform latent widths: a per-layer allocation is counted at its mean width).
    """
    mla = converted_layers(windows, spec.convert_layers) if spec is not None else [False] * len(windows)
    out = {"full": 0, "sliding": 0}
    for window, converted in zip(windows, mla, strict=True):
        tokens = length if window is None else min(length, window - 1)
        per_token = kv_elements_per_token(shape, spec) if converted else 2 * shape.num_kv_heads * shape.head_dim
        out["full" if window is None else "sliding"] += tokens * per_token
    return out | {"total": out["full"] + out["sliding"]}


def kv_ratio(shape: ModelShape, spec: MLASpec) -> float:
    """Cache size relative to the original MHA/GQA cache (2*n_kv*d_h per token and layer)."""
    return kv_elements_per_token(shape, spec) / (2 * shape.num_kv_heads * shape.head_dim)


def budget_latent_cap(shape: ModelShape, rope_pairs: int) -> int:
    """The widest latent a layer keeping `rope_pairs` rotated pairs can use: the rank of [NoPE keys; values],
    at most the input's width."""
    return min(2 * shape.num_kv_heads * shape.head_dim - 2 * rope_pairs, shape.hidden_size)


def budget_pair_range(shape: ModelShape, kv_elements: int) -> range:
    """The rotated-pair counts K a layer may keep under `kv_elements` per token: at least one pair, a latent
    of at least one dim (kv_elements - 2K), and no wider than the rank of [NoPE keys; values] or the input."""
    pairs = [
        k
        for k in range(1, shape.num_kv_heads * shape.head_dim // 2 + 1)
        if 1 <= kv_elements - 2 * k <= budget_latent_cap(shape, k)
    ]
    return range(pairs[0], pairs[-1] + 1) if pairs else range(0)


def _check_budget(shape, strategy, svd, d_kv, allocation, kv_elements, rope_pairs) -> None:
    if kv_elements is None:
        raise ValueError(f"rope_pairs={rope_pairs} needs kv_elements: the pairs are a share of a KV budget")
    if isinstance(kv_elements, bool) or not isinstance(kv_elements, int) or kv_elements < 3:
        raise ValueError(f"kv_elements must be an integer >= 3 (a rope pair and a latent dim), got {kv_elements!r}")
    if not strategy.any_pair_count:
        raise ValueError(
            f"kv_elements: rope={strategy.name!r} keeps r pairs per KV head; a budget split into any "
            "number of rope pairs needs a strategy with one shared rope key (rope='rorope')"
        )
    if svd != "joint":
        raise ValueError(f"kv_elements needs svd='joint' (one latent beside the rope key), got svd={svd!r}")
    if d_kv is not None:
        raise ValueError(f"d_kv={d_kv} and kv_elements={kv_elements} both size the latent; give one")
    if allocation not in ("uniform", "measured"):
        raise ValueError(
            f"allocation={allocation!r}: a KV budget's latent is the same in every layer ('uniform') or "
            "its total is spread by the model's measured loss ('measured')"
        )
    allowed = budget_pair_range(shape, kv_elements)
    if not allowed:
        raise ValueError(f"kv_elements={kv_elements} leaves no split into rope pairs and a latent for this model")
    if rope_pairs is not None and (isinstance(rope_pairs, bool) or rope_pairs not in allowed):
        raise ValueError(
            f"rope_pairs={rope_pairs!r}: under kv_elements={kv_elements} a layer keeps "
            f"{allowed.start}..{allowed.stop - 1} rotated pairs (null: searched)"
        )


def _check_key_weight(key_weight, svd: str, kv_elements) -> float | None:
    if key_weight is None:
        if kv_elements is None:
            raise ValueError(
                "key_weight=null (searched) needs kv_elements: the search scores a KV budget's "
                "conversions on a selection sample"
            )
        return None
    if isinstance(key_weight, bool) or not isinstance(key_weight, (int, float)) or not key_weight > 0:
        raise ValueError(f"key_weight must be a positive number or null (searched), got {key_weight!r}")
    if key_weight != 1.0 and svd != "joint":
        raise ValueError(
            f"key_weight={key_weight} weighs the NoPE keys against the values in one joint SVD; "
            f"svd={svd!r} has no such trade"
        )
    return float(key_weight)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name}={value!r}; expected one of {', '.join(map(repr, choices))}")
