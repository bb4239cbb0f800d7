"""Read run directories (docs/RUN_RECORD.md) into pandas, and put each run into the tables' common terms.

Two frames come out of here:
- the *flat* frame: one row per run, every results.json field flattened to dotted columns
  (`eval.commonsense.avg`, `mla.rope`, ...), the run's config.yaml under `config.*`, and `run_dir`;
- the *canonical* frame (`canonical_runs`): the few fields the tables compare on, with scores in
  percentage points like the paper (results.json holds fractions).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import yaml

from ..evaluation.samples import SAMPLES_FILE
from ..schema.commonsense_suite import paper_columns, task_columns
from ..schema.sections import PAPER_LONGBENCH_SUBSETS, RopeConfig, SvdConfig

LONGBENCH = PAPER_LONGBENCH_SUBSETS
METHODS = ("original", "finetuned_full_attention", "partial_rope", "partial_rope+svd")

# Head dims of the paper's models (METHOD.md, "Model shapes"): turns the paper's "r = d_h/16" into a number
# and tells which of our runs follow the paper's default recipe when a run's config does not say.
PAPER_HEAD_DIM = {"135M SmolLM": 64, "360M SmolLM": 64, "1B7 SmolLM": 64, "7B Llama2": 128}

# A table row is a (configuration, budget, evaluation sample) triple, named by these keys. Runs of one row are
# the seeds of one setting (`setting`: the run identity but its seed, schema/identity.setting_identity), so two
# runs that differ in anything that changes numbers are two rows even where these names coincide.
CONFIG_KEYS = (
    "model",
    "ours_model",
    "method",
    "rope",
    "r",
    "svd",
    "d_kv",
    "kv_elements",
    "rope_dims",
    "options",
    "distill_token_passes",
    "kv_quant",
    "kv_grouping",
    "data",
    "train_data",
    "objective",
    "trainable",
    "lr",
    "warmup",
    "precision",
)
BUDGET_KEYS = ("train_tokens",)
EVAL_KEYS = ("eval_sample", "eval_dtype")  # eval_sample: the table's suite's (eval_sample_<suite>)
ROW_KEYS = CONFIG_KEYS + BUDGET_KEYS + EVAL_KEYS
UNQUANTIZED = "unquantized"
# the conversion options a run is labelled with when it changes one (mla.<name> in its record), at the schema's
# defaults: the values the paper's tables used
DEFAULT_OPTIONS = {
    name: getattr(section(), name)
    for name, section in (
        ("score", RopeConfig),
        ("sigma", SvdConfig),
        ("init", SvdConfig),
        ("allocation", SvdConfig),
        ("nope_keys", RopeConfig),
        ("convert_layers", SvdConfig),
    )
}
# the fine-tune's recovery settings of the paper's recipe (conf/train/cpu_short.yaml, conf/objective/ce.yaml);
# a run that changes one is labelled with it
DEFAULT_RECIPE = {"objective": "ce", "trainable": "all", "lr": 1e-4, "precision": "bf16-autocast"}


def results_root() -> Path:
    """Where runs live: $MHA2MLA_RESULTS (the runner's setting) or ./results."""
    return Path(os.environ.get("MHA2MLA_RESULTS", "results"))


# libyaml's parser where PyYAML has it: the same safe constructors, several times faster on 171 configs
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts -> one dict with dotted keys; a null sub-record stays one None cell under its own key."""
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def find_results(paths: Iterable[str | Path]) -> list[Path]:
    """Every results.json under `paths` (a path may also be a results.json itself), each once, sorted."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if path.is_file() and path.name == "results.json":
            found.add(path.resolve())
        elif path.is_dir():
            found.update(p.resolve() for p in path.rglob("results.json"))
    return sorted(found)


def _relative(path: Path) -> str:
    """`path` relative to the working directory when it lies below it (the outputs then read the same in every
    checkout), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def read_run(results_path: Path) -> dict:
    """One run directory -> one flat record. An unreadable record becomes a row with status `unreadable`.
    `run_dir` is where the record lies now, not the `run_dir` it recorded: a folder moved or renamed since, or a
    checkout elsewhere, still finds its per-document results and curves."""
    run_dir = results_path.parent
    record: dict = {"run_dir": _relative(run_dir)}
    try:
        record.update(flatten(json.loads(results_path.read_text())))
    except (OSError, ValueError) as err:
        record.update(run_name=run_dir.name, status="unreadable", error=f"results.json: {err}")
    record["run_dir"] = _relative(run_dir)  # first column still, whatever the record says
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        try:
            record.update(flatten(yaml.load(config_path.read_text(), Loader=_YAML_LOADER) or {}, "config"))
        except (OSError, yaml.YAMLError) as err:
            record["config_error"] = str(err)
    return record


def load_runs(paths: Iterable[str | Path]) -> pd.DataFrame:
    """The flat frame of every run record found under `paths` (empty frame, with `run_dir`, when none)."""
    records = [read_run(p) for p in find_results(paths)]
    return pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=["run_dir", "status"])


def read_curve(run_dir: str | Path, metric: str = "loss") -> pd.DataFrame:
    """One metric of one run from metrics.jsonl (rows that carry it) as step/tokens/elapsed_s/<metric>:
    `loss` is the training curve, `heldout_ppl_probe` the in-training recovery probe."""
    path = Path(run_dir) / "metrics.jsonl"
    columns = ["step", "tokens", "elapsed_s", metric]
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash must not hide the rest of the curve
            if isinstance(row, dict) and row.get(metric) is not None:
                rows.append({c: row.get(c) for c in columns})
    return pd.DataFrame(rows, columns=columns)


def training_curves(runs: pd.DataFrame, metric: str = "loss") -> pd.DataFrame:
    """Every run's metrics.jsonl curve of `metric`, tagged with the run's variant label and status."""
    frames = []
    for _, run in runs.iterrows():
        if not run.get("run_dir"):
            continue
        curve = read_curve(run["run_dir"], metric)
        if len(curve):
            frames.append(curve.assign(run_dir=run["run_dir"], label=variant_label(run), status=run["status"]))
    columns = ["run_dir", "label", "status", "step", "tokens", "elapsed_s", metric]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def _get(record: dict, *keys, default=None):
    """The first present, non-missing value among `keys` (results.json first, then config.yaml)."""
    for key in keys:
        value = record.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            return value
    return default


def _as_int(value):
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _as_float(value):
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _points(value):
    """A score fraction as percentage points; None stays None."""
    try:
        return None if value is None else 100.0 * float(value)
    except (TypeError, ValueError):
        return None


def precision_label(backend, nbits) -> str:
    """The paper's Table 2 name for a KV-cache quantization ("Int4 HQQ"), or "unquantized"."""
    if backend is None and nbits is None:
        return UNQUANTIZED
    names = {"hqq": "HQQ", "quanto": "Quanto"}
    return f"Int{_as_int(nbits) if nbits is not None else '?'} {names.get(str(backend).lower(), backend)}"


def dtype_label(dtype) -> str | None:
    """'float32' -> 'FP32', 'bfloat16' -> 'BF16' (the tables' spelling of a real dtype)."""
    names = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}
    return None if dtype is None else names.get(str(dtype).removeprefix("torch."), str(dtype))


def kv_grouping(record: dict, quantized: bool, converted: bool) -> str | None:
    """How the quantized cache groups values: the record's kv_quant.grouping; records made before it
    existed quantized the MLA latent along tokens and the original model with transformers' QuantizedCache."""
    if not quantized:
        return None
    return _get(record, "kv_quant.grouping", default="tokens" if converted else "transformers")


def eval_sample(record: dict, suite: str) -> str | None:
    """Which documents a run's `suite` (commonsense | long_context | longbench) was scored on, as text: two runs with
    the same text saw the same docs; None when the suite did not run."""
    meta = f"eval.meta.{suite}."
    if suite == "commonsense" and _get(record, "eval.commonsense.avg", "eval.commonsense.mmlu") is not None:
        offline = "offline" if str(_get(record, meta + "source", default="offline")).startswith("offline") else "online"
        return (
            f"limit={_get(record, 'eval.commonsense.limit')} "
            f"mmlu_limit={_get(record, meta + 'mmlu_limit')} {_get(record, meta + 'sample')} "
            f"seed={_get(record, meta + 'seed')} {offline}"
        )
    if suite == "long_context" and _get(record, meta + "lengths") is not None:
        return (
            f"lengths={_get(record, meta + 'lengths')} depths={_get(record, meta + 'depths')} "
            f"x{_get(record, meta + 'samples_per_depth')} seed={_get(record, meta + 'seed')}"
        )
    if suite == "longbench" and _get(record, "eval.longbench.avg") is not None:
        return (
            f"longbench limit={_get(record, 'eval.longbench.limit')} "
            f"{_get(record, meta + 'sample')} seed={_get(record, meta + 'seed')}"
        )
    return None


def eval_docs(record: dict) -> dict[str, int]:
    """Docs scored per score column (commonsense columns, passkey@L)."""
    out = {}
    for task in task_columns():
        n = _as_int(_get(record, f"eval.meta.commonsense.n_docs.{task}"))
        if n:
            out[task] = n
    lc = "eval.meta.long_context."
    depths, per_depth = _get(record, lc + "depths"), _as_int(_get(record, lc + "samples_per_depth"))
    for length in _get(record, lc + "lengths") or []:
        out[f"passkey@{length}"] = len(depths) * per_depth
    return out


def method_of(variant, rope, svd, trained: bool) -> str:
    """The paper's row kind, from what was done to the model rather than the runner's variant label."""
    if rope is None:
        return variant if variant in ("original", "finetuned_full_attention") else str(variant)
    if svd in (None, "none"):
        if rope == "full":  # every pair keeps RoPE and nothing is low-rank: the unconverted model
            return "finetuned_full_attention" if trained else "original"
        return "partial_rope"
    return "partial_rope+svd"


def canonical_run(record: dict) -> dict:
    """One flat record -> the fields the tables and plots compare on (scores in points)."""
    model_name = _get(record, "model.name")
    paper_model = _get(record, "config.model.paper_name", default=model_name)
    rope = _get(record, "mla.rope")
    svd = _get(record, "mla.svd")
    train_tokens = _get(record, "train.tokens")
    method = method_of(_get(record, "variant"), rope, svd, trained=bool(train_tokens))
    full_model = method in ("original", "finetuned_full_attention")
    head_dim = _as_int(_get(record, "config.model.shape.head_dim", default=PAPER_HEAD_DIM.get(paper_model)))
    kv_quant = precision_label(_get(record, "kv_quant.backend"), _get(record, "kv_quant.nbits"))
    run_dir = record.get("run_dir")
    samples = Path(run_dir) / SAMPLES_FILE if run_dir else None
    row = {
        "run_dir": run_dir,
        "experiment": _get(record, "experiment"),
        "run_name": _get(record, "run_name"),
        "status": _get(record, "status", default="unknown"),
        "error": _get(record, "error"),
        "model": paper_model,
        "ours_model": model_name,
        "head_dim": head_dim,
        "method": method,
        # the unconverted model has no partial-RoPE/low-rank settings: keep those cells empty for it
        "rope": "full" if full_model else rope,
        "r": None if full_model else _as_int(_get(record, "mla.r")),
        "svd": "none" if full_model else svd,
        "d_kv": None if full_model else _as_int(_get(record, "mla.d_kv")),
        # a KV budget split per layer (mla/budget.py) instead of r / d_kv
        "kv_elements": None if full_model else _as_int(_get(record, "mla.kv_elements")),
        "rope_dims": None if full_model else rope_dims_label(record),
        "latent_dims": None if full_model else latent_dims_label(record),
        "kv_split": None
        if full_model or _get(record, "mla.kv_elements") is None
        else "fixed"
        if _get(record, "mla.rope_pairs") is not None
        else "searched",
        "options": None if full_model else options_label(record),
        "kv_quant": kv_quant,
        "kv_grouping": kv_grouping(record, kv_quant != UNQUANTIZED, not full_model),
        "kv_dtype": dtype_label(_get(record, "kv.dtype")),
        # the cache of the evaluation's generation tasks where there were any (long prompts), else the
        # runner's one-prefill measurement
        "kv_bytes_per_token": _get(record, "eval.kv_cache.bytes_per_token_measured", "kv.bytes_per_token_measured"),
        "data": _get(record, "config.data.name"),
        "seed": _as_int(_get(record, "config.seed")),
        "train_tokens": _as_int(train_tokens) or 0,
        "kv_mem_change_pct": _get(record, "eval.kv_cache.mem_change_pct", "kv.mem_change_pct"),
        "eval_sample_commonsense": eval_sample(record, "commonsense"),
        "eval_sample_long_context": eval_sample(record, "long_context"),
        "eval_sample_longbench": eval_sample(record, "longbench"),
        "eval_dtype": dtype_label(_get(record, "eval.meta.dtype")),  # the dtype the lm-eval suites ran in
        "eval_docs": eval_docs(record) or None,
        "eval_limit": _get(record, "eval.commonsense.limit"),
        "samples_file": str(samples) if samples is not None and samples.is_file() else None,
        # compute spent and the cheap always-on score, for the recovery view
        "heldout_ppl": _get(record, "eval.perplexity.heldout"),
        # a fine-tune on other text than the run's corpus (train.data), and its own held-out perplexity
        "train_data": train_data_label(record),
        "train_data_heldout_ppl": _get(record, f"eval.perplexity.heldout:{_get(record, 'train_data.name')}"),
        "heldout_row_nll": _get(record, "eval.perplexity.row_nll"),  # per held-out row (perplexity_pairs)
        "heldout_row_tokens": _get(record, "eval.perplexity.row_tokens"),
        "heldout_row_document": _get(record, "eval.perplexity.row_document"),  # the bootstrap's unit
        "heldout_row_index": _get(record, "eval.perplexity.row_index"),
        "distill_token_passes": _as_int(_get(record, "distill.token_passes")),
        "convert_s": _get(record, "timings.convert_s"),
        "distill_s": _get(record, "timings.distill_s"),
        "train_s": _get(record, "timings.train_s"),
        # how the fine-tune recovered it (the recovery study's axes)
        "objective": _get(record, "train.objective") if train_tokens else None,
        "trainable": ("attention" if _get(record, "config.train.freeze_non_attention") else "all")
        if train_tokens
        else None,
        "lr": _as_float(_get(record, "config.train.lr")) if train_tokens else None,
        "warmup": _as_int(_get(record, "config.train.warmup_steps")) if train_tokens else None,
        "precision": _get(record, "train.precision.mode"),
        # the run identity but its seed; a record without one stands alone
        "setting": _get(record, "setting_hash", default=f"run:{record.get('run_dir')}"),
        "train_tokens_per_s": _get(record, "train.tokens_per_s"),
    }
    for column in dict.fromkeys(paper_columns() + task_columns()):  # the tables' columns, then ARC's parts
        row[column] = _points(_get(record, f"eval.commonsense.{column}"))
    row["avg"] = _points(_get(record, "eval.commonsense.avg"))
    for key, value in record.items():
        for section in ("longbench", "long_context"):
            name = key[len(f"eval.{section}.") :] if key.startswith(f"eval.{section}.") else None
            if name and "." not in name and name != "limit":  # scores only, not nested metadata
                row[f"{section}.{name}"] = _points(value)
    for task in LONGBENCH + ("avg",):
        row.setdefault(f"longbench.{task}", None)
    row.setdefault("long_context.avg", None)
    return row


def lr_label(lr) -> str:
    """A learning rate as people write it: 3e-4, 1.5e-4."""
    mantissa, exponent = f"{float(lr):e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _lr_note(lr) -> str | None:
    """ "lr 3e-4" for a learning rate other than the paper's, else None."""
    if lr is None or pd.isna(lr) or math.isclose(float(lr), DEFAULT_RECIPE["lr"]):
        return None
    return f"lr {lr_label(lr)}"


def recipe_label(row) -> str | None:
    """The recovery settings of a canonical row that differ from the paper's recipe:
    "kd, on teacher-samples, attention only, lr 3e-4"."""
    parts = []
    if isinstance(row.get("objective"), str) and row["objective"] != DEFAULT_RECIPE["objective"]:
        parts.append(row["objective"])
    if isinstance(row.get("train_data"), str):  # recovery text other than the corpus (the teacher's samples)
        parts.append(f"on {row['train_data']}")
    if row.get("trainable") == "attention":
        parts.append("attention only")
    if _lr_note(row.get("lr")):
        parts.append(_lr_note(row.get("lr")))
    if isinstance(row.get("precision"), str) and row["precision"] != DEFAULT_RECIPE["precision"]:
        parts.append(row["precision"])
    return ", ".join(parts) or None


def train_data_label(record: dict) -> str | None:
    """The recovery text when it is not the corpus (`record` flattened): its name, and for text a teacher wrote
    the number of samples (sets of one generation config differ in nothing else): "teacher-samples (6,144 samples)"."""
    name = _get(record, "train_data.name")
    samples = [_get(record, f"train_data.documents.{split}") for split in ("train", "held_out")]
    if not isinstance(name, str) or _get(record, "train_data.source") != "teacher" or None in samples:
        return name
    return f"{name} ({sum(int(n) for n in samples):,} samples)"


def rope_dims_label(record: dict) -> str | None:
    """The rope key dims the layers of a KV-budget conversion kept: "32" when all agree, else "min-max (mean)"."""
    return _split_label(record, lambda layer: 2 * int(layer["rope_pairs"]))


def latent_dims_label(record: dict) -> str | None:
    """The latent widths of a KV-budget conversion's layers, as `rope_dims_label` gives the rope dims."""
    return _split_label(record, lambda layer: int(layer["latent"]))


def _split_label(record: dict, dims_of) -> str | None:
    split = _get(record, "conversion.budget_split")
    if not isinstance(split, list) or not split:
        return None
    dims = [dims_of(layer) for layer in split]
    if len(set(dims)) == 1:
        return str(dims[0])
    return f"{min(dims)}-{max(dims)} (mean {sum(dims) / len(dims):.1f})"


def recovery_recipe(row) -> str:
    """How a converted model was recovered: "conversion only", "ILD" (layer-wise distillation), or the
    fine-tune's objective ("ce", "kd", ...), after "ILD →" when both ran, with ", attention only" when the
    rest of the model was frozen and the lr when it is not the paper's."""
    distilled = not pd.isna(row.get("distill_token_passes"))
    tuned = not pd.isna(row.get("train_tokens")) and row.get("train_tokens", 0) > 0
    if not tuned:
        return "ILD" if distilled else "conversion only"
    objective = row.get("objective")
    text = ("ILD → " if distilled else "") + (objective if isinstance(objective, str) else "fine-tune")
    text += ", attention only" if row.get("trainable") == "attention" else ""
    text += f" on {row['train_data']}" if isinstance(row.get("train_data"), str) else ""
    return text + (f", {_lr_note(row.get('lr'))}" if _lr_note(row.get("lr")) else "")


def options_label(record: dict) -> str | None:
    """The conversion options that differ from the paper's defaults, e.g. "score=sum, init=activation"."""
    # a record from before an option existed has NaN there (a frame mixing old and new records): the default
    changed = [
        f"{name}={record[f'mla.{name}']}"
        for name, default in DEFAULT_OPTIONS.items()
        if _get(record, f"mla.{name}") not in (None, default)
    ]
    searched = _get(record, "conversion.budget_search.key_weight")  # a KV budget that searched its key weight
    if searched is not None and _get(record, "mla.key_weight") is None:
        changed.append(f"key_weight=searched ({searched:g})")
    elif _get(record, "mla.key_weight") not in (None, 1.0):
        changed.append(f"key_weight={_get(record, 'mla.key_weight'):g}")
    return ", ".join(changed) or None


def options_from_label(label: str | None) -> dict[str, str]:
    """`options_label`'s text back as {name: value} ({} for the paper's defaults)."""
    return dict(item.split("=", 1) for item in label.split(", ")) if label else {}


def canonical_runs(flat: pd.DataFrame) -> pd.DataFrame:
    """The canonical frame of a flat frame, one row per run, in the same order."""
    rows = [canonical_run({k: v for k, v in rec.items()}) for rec in flat.to_dict("records")]
    frame = pd.DataFrame.from_records(rows) if rows else pd.DataFrame(columns=list(canonical_run({}).keys()))
    for column in ("r", "d_kv", "train_tokens", "head_dim", "distill_token_passes", "seed", "warmup"):
        frame[column] = pd.array(frame[column], dtype="Int64")
    return frame


def variant_label(row) -> str:
    """A short human name for a configuration, used as a plot series label."""
    method = row["method"]
    if method == "original":
        text = "original"
    elif method == "finetuned_full_attention":
        text = "FT full attention"
    elif method == "partial_rope":
        text = f"partial RoPE {row['rope']} r={_fmt(row['r'])}"
    elif method == "partial_rope+svd":
        text = f"MLA {row['rope']} r={_fmt(row['r'])} {row['svd']} d_kv={_fmt(row['d_kv'])}"
    else:
        text = str(method)
    if isinstance(row.get("options"), str):
        text += f" ({row['options']})"
    if not pd.isna(row.get("distill_token_passes", None)):
        text += " + layer-wise distillation"
    if recipe_label(row):
        text += f" [{recipe_label(row)}]"
    if row.get("kv_quant") not in (None, UNQUANTIZED):
        text += f" {row['kv_quant']}" + (" (transformers' groups)" if row.get("kv_grouping") == "transformers" else "")
    return f"{row['ours_model']}: {text}"


def _fmt(value) -> str:
    return "?" if value is None or pd.isna(value) else str(value)
