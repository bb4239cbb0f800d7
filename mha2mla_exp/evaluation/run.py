"""`run_evaluation`: the runner's single entry point; returns the record's `eval` block.

`eval_cfg` (a plain mapping, e.g. a resolved conf/eval/*.yaml) has one section per suite, each with
`enabled`; every section is validated before any model work starts. Suites: perplexity (held-out
rows given by the caller, plus long-document perplexity from the long-context suite), commonsense,
long_context, longbench. Generation tasks run on the cache that `kv_quant` selects and its measured
bytes land in `kv_cache`; loglikelihood tasks use no cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import torch

from .commonsense import CommonsenseConfig
from .kv import CacheMeter, KVQuant, kv_record
from .long_context import LongContextConfig
from .longbench import LongBenchConfig
from .perplexity import perplexity

log = logging.getLogger(__name__)

SECTIONS = {"commonsense": CommonsenseConfig, "long_context": LongContextConfig, "longbench": LongBenchConfig}
PERPLEXITY_KEYS = {"enabled", "batch_size", "max_batches"}
TOP_KEYS = {"name", "perplexity", *SECTIONS}


def _section(name: str, raw) -> tuple[bool, object]:
    """(enabled, dataclass config) of one suite section; unknown keys are errors."""
    cls = SECTIONS[name]
    raw = dict(raw or {})
    enabled = bool(raw.pop("enabled", False))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"eval.{name}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    for key, value in raw.items():  # YAML lists -> tuples for the frozen configs
        if isinstance(value, list):
            raw[key] = tuple(value)
    try:
        return enabled, cls(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"eval.{name}: {e}") from e


def parse_eval_config(eval_cfg: Mapping | None) -> dict:
    """{suite: config or None (disabled)} plus the perplexity options; raises ValueError on bad input."""
    eval_cfg = dict(eval_cfg or {})
    unknown = set(eval_cfg) - TOP_KEYS
    if unknown:
        raise ValueError(f"eval: unknown section(s) {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    ppl = dict(eval_cfg.get("perplexity") or {"enabled": True})
    bad = set(ppl) - PERPLEXITY_KEYS
    if bad:
        raise ValueError(f"eval.perplexity: unknown key(s) {sorted(bad)}; known: {sorted(PERPLEXITY_KEYS)}")
    out = {"perplexity": {"enabled": bool(ppl.get("enabled", True)), "batch_size": int(ppl.get("batch_size", 8)),
                          "max_batches": ppl.get("max_batches")}}
    for name in SECTIONS:
        enabled, cfg = _section(name, eval_cfg.get(name))
        out[name] = cfg if enabled else None
    if out["commonsense"] is not None:
        from .commonsense import task_names

        for col in out["commonsense"].tasks:
            task_names(col, False, out["commonsense"].subjects)
    if out["longbench"] is not None:
        from .longbench import check

        check(out["longbench"])
    return out


def held_out_batches(held_out, batch_size: int):
    """Token rows `[N, T]` (or `[T]`) as batches of `batch_size` rows; an iterable of batches passes through."""
    if isinstance(held_out, torch.Tensor):
        rows = held_out if held_out.dim() == 2 else held_out.unsqueeze(0)
        return [rows[i:i + batch_size] for i in range(0, rows.shape[0], batch_size)]
    return held_out


def run_evaluation(model, tokenizer, eval_cfg: Mapping | None, *, held_out=None, kv_quant=None,
                   window: int | None = None) -> dict:
    """Evaluate an in-memory causal LM (original or MLA); returns the run record's `eval` block.

    held_out: token rows `[N, T]` (or an iterable of batches) for held-out perplexity.
    kv_quant: None or {backend, nbits, residual_length, q_group_size}: the cache of generation tasks.
    window: the evaluation window (the fine-tuning length); None: the model's context length.
    """
    from .lm import EvalLM

    cfg = parse_eval_config(eval_cfg)
    kv_quant = KVQuant.from_cfg(kv_quant)
    meter = CacheMeter()
    model.eval()
    out: dict = {"perplexity": {}, "meta": {"kv_quant": kv_quant.to_dict() if kv_quant else None, "window": window}}
    timings = out["meta"]["seconds"] = {}

    def lm_for(batch_size: int):
        lm = EvalLM(model, tokenizer, batch_size=batch_size, window=window, kv_quant=kv_quant)
        lm.kv_meter = meter  # one meter across suites
        return lm

    p = cfg["perplexity"]
    if p["enabled"]:
        t = time.perf_counter()
        if held_out is None:
            log.warning("eval.perplexity is enabled but no held-out tokens were given: skipped")
            out["perplexity"]["heldout"] = None
        else:
            out["perplexity"]["heldout"] = perplexity(model, held_out_batches(held_out, p["batch_size"]),
                                                      max_batches=p["max_batches"])
        timings["perplexity"] = round(time.perf_counter() - t, 2)
    if cfg["commonsense"] is not None:
        from .commonsense import evaluate_commonsense

        t = time.perf_counter()
        out["commonsense"], out["meta"]["commonsense"] = evaluate_commonsense(
            lm_for(cfg["commonsense"].batch_size), cfg["commonsense"])
        timings["commonsense"] = round(time.perf_counter() - t, 2)
    if cfg["long_context"] is not None:
        from .long_context import evaluate_long_context

        t = time.perf_counter()
        lc = cfg["long_context"]
        out["long_context"], ppl, out["meta"]["long_context"] = evaluate_long_context(
            lm_for(lc.batch_size), tokenizer, lc, window=window)
        out["perplexity"].update(ppl)
        timings["long_context"] = round(time.perf_counter() - t, 2)
    if cfg["longbench"] is not None:
        from .longbench import evaluate_longbench

        t = time.perf_counter()
        out["longbench"], out["meta"]["longbench"] = evaluate_longbench(lm_for(cfg["longbench"].batch_size),
                                                                        cfg["longbench"])
        timings["longbench"] = round(time.perf_counter() - t, 2)
    out["kv_cache"] = kv_record(model, kv_quant, meter) if meter.calls else {
        "note": "no generation task ran: loglikelihood tasks (commonsense, perplexity) use no KV cache"}
    import lm_eval

    out["meta"]["lm_eval_version"] = getattr(lm_eval, "__version__", None)
    return out
