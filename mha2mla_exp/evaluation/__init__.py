"""Evaluation through lm-eval: the paper's commonsense suite, LongBench with middle truncation, an
offline long-context suite (passkey, long-document perplexity), quantized-KV generation with
measured cache bytes, and held-out perplexity. The runner's entry point is `run_evaluation`.

Heavy modules (lm-eval) are imported on first use, so `perplexity` stays cheap to import.
"""

from .perplexity import perplexity

_LAZY = {
    "run_evaluation": "run",
    "check_eval_config": "run",
    "EvalLM": "lm",
    "middle_truncate": "lm",
    "KVQuant": "kv",
    "CacheMeter": "kv",
    "kv_record": "kv",
    "new_cache": "kv",
    "evaluate_commonsense": "commonsense",
    "evaluate_long_context": "long_context",
    "evaluate_longbench": "longbench",
}
__all__ = ["perplexity", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
