"""`run_evaluation`: the runner's single entry point; returns the record's `eval` block.

It takes the `eval` section (schema/sections.EvalConfig: one sub-section per suite, each with `enabled`, and
`dtype`); the enabled suites' own checks run before any model work starts. Suites: perplexity
(held-out rows given by the caller, plus long-document perplexity from the long-context suite),
commonsense, long_context, longbench. Generation tasks run on the cache that `kv_quant` selects and its
measured bytes land in `kv_cache`; loglikelihood tasks use no cache. Every lm-eval suite's per-document
results are written to `samples_path` when given (`samples.py`).

`dtype` (a mode, `auto` or `fastest`, left unresolved: the model's own) is the precision the lm-eval suites run
in: the model is cast to it in place after the held-out perplexity (which stays in the model's dtype, like the
in-training probe), and log-softmax runs in fp32 either way. The record's `meta.dtype` and
`meta.perplexity_dtype` state what ran. (The runner always passes a dtype: `eval.dtype` resolved, see
evaluation.plan.resolve_eval_dtype.) Device and casts are the `placement`'s (placement.py: the same for every row;
the runner passes the run's own).

Under several processes every one calls `run_evaluation`: each computes the held-out perplexity (so that all
enter the suites together) and its share of every lm-eval suite; the suites' results, the per-document rows,
the cache bytes and `meta.ranks` are gathered onto rank 0, whose return value is the record's block.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping

import torch

from ..data.held_out import select_rows
from ..models import DTYPES
from ..schema.sections import EvalConfig, PerplexityConfig
from .kv import CacheMeter, KVQuant, kv_record
from .perplexity import perplexity
from .samples import summary, write_samples

log = logging.getLogger(__name__)


def check_eval_config(evaluation: EvalConfig) -> None:
    """The suites' own checks, before any model work (the schema has checked each field's type and range): every
    suite's settings that go together, enabled or not, as ValueError naming `eval.<suite>`; then what an enabled
    suite needs (MMLU subjects, LongBench's subsets and data)."""
    from .commonsense import check as check_commonsense
    from .commonsense import selected_subjects
    from .long_context import check as check_long_context
    from .longbench import check as check_longbench

    for name, check in (("commonsense", check_commonsense), ("long_context", check_long_context)):
        try:
            check(getattr(evaluation, name))
        except ValueError as err:
            raise ValueError(f"eval.{name}: {err}") from None
    if evaluation.commonsense.enabled:
        selected_subjects(evaluation.commonsense)
    if evaluation.longbench.enabled:
        check_longbench(evaluation.longbench)


def suites_dtype(evaluation: EvalConfig) -> torch.dtype | None:
    """The dtype the lm-eval suites run in: `eval.dtype` as the runner resolved it; None (the model's own) where it
    is still a mode (`auto`, `fastest`: a caller outside the runner)."""
    return DTYPES.get(evaluation.dtype)


def held_out_batches(held_out, batch_size: int):
    """Token rows `[N, T]` (or `[T]`) as batches of `batch_size` rows; an iterable of batches passes through."""
    if isinstance(held_out, torch.Tensor):
        rows = held_out if held_out.dim() == 2 else held_out.unsqueeze(0)
        return [rows[i : i + batch_size] for i in range(0, rows.shape[0], batch_size)]
    return held_out


def held_out_sample(rows, documents, p: PerplexityConfig) -> tuple[object, dict]:
    """The held-out rows a perplexity scores under eval.perplexity `p`, and what the record says of them.

    With each row's document known, the cap (max_batches x batch_size rows) is a sample chosen by `p.rows`
    (data/held_out.py) and the record keeps each scored row's index and document; without (an iterable of
    batches), the first max_batches batches, as before."""
    if documents is None or not isinstance(rows, torch.Tensor):
        return itertools.islice(held_out_batches(rows, p.batch_size), p.max_batches), {}
    cap = None if p.max_batches is None else p.max_batches * p.batch_size
    index = select_rows(documents, cap, p.rows, p.row_seed)
    info = {
        "row_selection": p.rows if cap is not None and cap < len(documents) else "all",
        "row_index": index.tolist(),
        "row_document": documents[index].tolist(),
        "documents": int(documents.unique().numel()),
    }
    return held_out_batches(rows[index], p.batch_size), info


def held_out_probe(rows: PerplexityConfig, batches: int, data):
    """The in-training recovery probe: held-out perplexity on `batches` batches (`train.eval_batches`) of held-out
    rows, chosen as the final evaluation chooses its rows (`rows`: `eval.perplexity`, data/held_out.py; the same rows
    for every run); the fine-tune calls it before its first step, every `train.eval_every` steps and after its last."""
    probe = dataclasses.replace(rows, max_batches=batches)
    sample, _ = held_out_sample(data.held_out, data.held_out_documents(), probe)
    sample = list(sample)
    return lambda model: {"heldout_ppl_probe": perplexity(model, sample)}


def run_evaluation(
    model,
    tokenizer,
    evaluation: EvalConfig,
    *,
    held_out=None,
    kv_quant: KVQuant | None = None,
    window: int | None = None,
    samples_path=None,
    extra_held_out: Mapping | None = None,
    held_out_documents: torch.Tensor | None = None,
    placement=None,
    process_group=None,
) -> dict:
    """Evaluate an in-memory causal LM (original or MLA) under the `eval` section; returns the run record's `eval`
    block.

    held_out: token rows `[N, T]` (or an iterable of batches) for held-out perplexity; held_out_documents:
    each row's document (data/held_out.py), which makes a capped perplexity a stratified sample of documents.
    kv_quant: None or a KVQuant: the cache of generation tasks.
    window: the evaluation window (the fine-tuning length); None: the model's context length.
    samples_path: where the per-document results go (gzipped JSON lines); None: not written.
    extra_held_out: {name: rows or (rows, documents)} scored like `held_out`, as `perplexity["heldout:<name>"]`.
    `evaluation.dtype` casts the model in place (see the module docstring).
    placement: an `EvalPlacement` (None: the model's device and dtype, cast to `evaluation.dtype` for the suites).
    process_group: the group of the suites' collectives under several processes (None: the default one).
    """
    from .lm import EvalLM
    from .placement import EvalPlacement

    check_eval_config(evaluation)
    meter = CacheMeter()
    if placement is None:
        placement = EvalPlacement.decide(model.device, suites_dtype=suites_dtype(evaluation), model_dtype=model.dtype)
    placement.place(model, "weights")
    model.eval()
    lms = []  # one EvalLM per suite; the last does the closing collectives
    out: dict = {
        "perplexity": {},
        "meta": {
            "kv_quant": kv_quant.to_dict() if kv_quant else None,
            "window": window,
            "dtype": _dtype_name(model.dtype),
        },
    }
    timings = out["meta"]["seconds"] = {}
    rows: list[dict] = []

    def lm_for(batch_size: int):
        lm = EvalLM(
            model,
            tokenizer,
            batch_size=batch_size,
            window=window,
            kv_quant=kv_quant,
            placement=placement,
            process_group=process_group,
        )
        out["meta"]["dtype"] = _dtype_name(model.dtype)
        lm.kv_meter = meter  # one meter across suites
        lms.append(lm)
        return lm

    p = evaluation.perplexity
    if p.enabled:
        t = time.perf_counter()
        if held_out is None:
            log.warning("eval.perplexity is enabled but no held-out tokens were given: skipped")
            out["perplexity"]["heldout"] = None
        else:
            out["meta"]["perplexity_dtype"] = _dtype_name(model.dtype)
            sets = {"": (held_out, held_out_documents)} | {
                f":{name}": extra if isinstance(extra, tuple) else (extra, None)
                for name, extra in (extra_held_out or {}).items()
            }
            for suffix, (token_rows, documents) in sets.items():
                rows_nll = []
                batches, picked = held_out_sample(token_rows, documents, p)
                out["perplexity"][f"heldout{suffix}"] = perplexity(model, batches, rows=rows_nll)
                # per held-out row: mean NLL (nats/token), its tokens and (when known) its document, for paired
                # intervals over the same rows that resample documents
                out["perplexity"][f"row_nll{suffix}"] = [round(nll / max(n, 1), 6) for nll, n in rows_nll]
                out["perplexity"][f"row_tokens{suffix}"] = [int(n) for _, n in rows_nll]
                out["perplexity"].update({f"{k}{suffix}": v for k, v in picked.items()})
        timings["perplexity"] = round(time.perf_counter() - t, 2)
    if evaluation.commonsense.enabled:
        from .commonsense import evaluate_commonsense

        t = time.perf_counter()
        result = evaluate_commonsense(lm_for(evaluation.commonsense.batch_size), evaluation.commonsense)
        if result is not None:  # None: another rank's share, gathered onto rank 0
            out["commonsense"], out["meta"]["commonsense"], suite_rows = result
            rows += suite_rows
        timings["commonsense"] = round(time.perf_counter() - t, 2)
    if evaluation.long_context.enabled:
        from .long_context import evaluate_long_context

        t = time.perf_counter()
        lc = evaluation.long_context
        result = evaluate_long_context(lm_for(lc.batch_size), tokenizer, lc, window=window)
        if result is not None:
            out["long_context"], ppl, out["meta"]["long_context"], suite_rows = result
            out["perplexity"].update(ppl)
            rows += suite_rows
        timings["long_context"] = round(time.perf_counter() - t, 2)
    if evaluation.longbench.enabled:
        from .longbench import evaluate_longbench

        t = time.perf_counter()
        result = evaluate_longbench(lm_for(evaluation.longbench.batch_size), evaluation.longbench)
        if result is not None:
            out["longbench"], out["meta"]["longbench"], suite_rows = result
            rows += suite_rows
        timings["longbench"] = round(time.perf_counter() - t, 2)
    shared = lms[-1] if lms and lms[-1].world_size > 1 else None
    if shared is not None:  # every rank measured the caches of its own generate calls
        meter.calls, meter.bytes, meter.token_slots = shared.sum_over_ranks(meter.calls, meter.bytes, meter.token_slots)
        out["meta"]["ranks"] = {
            "processes": shared.world_size,
            "requests": shared.per_rank(sum(lm.requests_served for lm in lms)),
        }
        if shared.rank != 0:
            return out  # this rank's share is in rank 0's block; it writes nothing
    out["kv_cache"] = (
        kv_record(model, kv_quant, meter)
        if meter.calls
        else {"note": "no generation task ran: loglikelihood tasks (commonsense, perplexity) use no KV cache"}
    )
    if samples_path is not None and rows:
        write_samples(rows, samples_path)
        out["meta"]["samples"] = summary(rows)
    import lm_eval

    out["meta"]["lm_eval_version"] = getattr(lm_eval, "__version__", None)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
