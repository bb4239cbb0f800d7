"""The evaluation's plan, made before any weight is loaded: the suites' dtype and why, the KV-cache quantization,
and where each evaluated model runs (`plan_evaluation`). The evaluation's checks that must fail before a
fine-tune, not after it, live here, once. Errors are ValueErrors naming the field (the runner reports them as
config errors)."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import DTYPES
from ..schema.sections import EvalConfig, KVQuantConfig, ModelConfig
from .kv import KVQuant
from .placement import EvalPlacement


@dataclass(frozen=True)
class EvalPlan:
    dtype: str  # the lm-eval suites' dtype (held-out perplexity runs in the weights' dtype)
    dtype_reason: str  # why (`fastest` is decided by a measurement on CPU)
    kv_quant: KVQuant | None  # the KV-cache quantization, or None
    model_dtype: str = "auto"  # the weights' dtype as loaded (`model.dtype`)

    def placement(self, device) -> EvalPlacement:
        """Where and in what dtype every model this run evaluates runs on `device`, whatever made it: the suites
        in `dtype`, the weights in `model_dtype` (placement.py)."""
        return EvalPlacement.decide(device, suites_dtype=self.dtype, model_dtype=self.model_dtype)

    def describe(self, evaluation: EvalConfig) -> list[str]:
        """The dry run's lines for the evaluation part."""
        suites = [name for name in ("commonsense", "long_context", "longbench") if getattr(evaluation, name).enabled]
        kv = "none" if self.kv_quant is None else f"{self.kv_quant.backend} {self.kv_quant.nbits}-bit"
        return [
            f"suites: held-out perplexity{''.join(', ' + s for s in suites)}",
            f"evaluation dtype: {self.dtype} ({self.dtype_reason})",
            f"KV-cache quantization: {kv}",
        ]


def plan_evaluation(
    evaluation: EvalConfig,
    kv_quant: KVQuantConfig,
    model: ModelConfig,
    *,
    converted: bool,
    device_type: str,
    bf16_pays=None,
) -> EvalPlan:
    """The plan of a run's evaluation; `converted`: the model evaluated is an MLA conversion; `bf16_pays() ->
    (fast, why)`: what decides `eval.dtype=fastest` on CPU."""
    check_evaluation(evaluation, model)
    dtype, reason = resolve_eval_dtype(evaluation.dtype, device_type, bf16_pays=bf16_pays)
    return EvalPlan(dtype, reason, kv_quantization(kv_quant, converted=converted), model_dtype=model.dtype)


def check_evaluation(evaluation: EvalConfig, model: ModelConfig) -> None:
    """The suites' own checks (run.check_eval_config), and the long-context suite's lengths against the window it
    is scored in (the model's fine-tuning length, else its context), which the suite itself checks only after the
    fine-tune."""
    from .long_context import longest
    from .run import check_eval_config

    try:
        check_eval_config(evaluation)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        message = str(err)
        raise ValueError(message if message.startswith("eval") else f"eval: {message}") from err
    window = model.finetune_length or (model.shape.context_length if model.shape is not None else None)
    long_context = evaluation.long_context
    if long_context.enabled and window and longest(long_context) > window:
        raise ValueError(
            f"eval.long_context: its longest sequence ({longest(long_context)} tokens: lengths / "
            f"ppl_lengths) exceeds the evaluation window of {window} (model.finetune_length)"
        )


def kv_quantization(section: KVQuantConfig, *, converted: bool) -> KVQuant | None:
    """The evaluation's KV-cache quantization: bits and group size for the backend, and the grouping for the
    architecture, checked before any training."""
    try:
        kv_quant = KVQuant.from_config(section)
        if kv_quant is not None:
            kv_quant.check_model(converted=converted)
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith("kv_quant") else f"kv_quant: {err}") from err
    return kv_quant


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
