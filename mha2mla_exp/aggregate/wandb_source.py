"""Read a W&B project's runs into the same flat frame as `records.load_runs` (optional, needs network).

A run's W&B config is taken as its config.yaml (`config.*` columns); its summary as its results.json.
Either may hold the run record nested (`{"eval": {"commonsense": {...}}}`) or with W&B's slash-separated
keys (`eval/commonsense/avg`); both flatten to the same dotted columns. `wandb` is imported only here,
only when called, so nothing else depends on it.
"""

from __future__ import annotations

import pandas as pd

from .records import flatten

# W&B run states -> run-record statuses; a finished run without its own `status` is taken as ok
_STATES = {"finished": "ok", "crashed": "failed", "failed": "failed", "killed": "failed", "running": "running"}
_RECORD_FIELDS = ("run_name", "experiment", "status", "error", "model", "variant", "mla", "kv_quant", "kv",
                  "train", "eval", "timings", "machine")


def _dotted(mapping: dict, prefix: str = "") -> dict:
    return {key.replace("/", "."): value for key, value in flatten(mapping, prefix).items()}


def _plain(mapping) -> dict:
    """W&B summary/config objects -> plain dicts, without W&B's private keys (`_step`, `_wandb`, ...)."""
    raw = getattr(mapping, "_json_dict", mapping)
    return {k: v for k, v in dict(raw).items() if not str(k).startswith("_")}


def wandb_record(run) -> dict:
    """One W&B run (a `wandb.apis.public.Run` or anything with the same attributes) -> one flat record."""
    config, summary = _plain(run.config), _plain(run.summary)
    record = _dotted(config, "config")
    # the run record's own fields may have been logged in the config (at start) or the summary (at end)
    record.update(_dotted({k: v for k, v in config.items() if str(k).split("/")[0] in _RECORD_FIELDS}))
    record.update(_dotted(summary))
    record.setdefault("run_name", getattr(run, "name", None))
    if record.get("status") is None:
        record["status"] = _STATES.get(getattr(run, "state", None), "unknown")
    record["run_dir"] = getattr(run, "url", None) or "/".join(getattr(run, "path", []) or [])
    return record


def load_wandb_runs(project: str, api=None) -> pd.DataFrame:
    """Every run of `project` ("entity/project") as a flat frame; `api` defaults to `wandb.Api()`."""
    if api is None:
        import wandb  # optional at run time: only this function needs it

        api = wandb.Api()
    records = [wandb_record(run) for run in api.runs(project)]
    return pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=["run_dir", "status"])
