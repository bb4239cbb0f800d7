"""Read a W&B project's runs into the same flat frame as `records.load_runs` (optional, needs network).

A run's W&B config is taken as its config.yaml (`config.*` columns); its summary as its results.json.
The runner (runner/run.py) logs the resolved Hydra config and a summary of status, kv, train, eval and
timings, so the `mla` block is rebuilt from the config when the summary lacks it. Either may hold the
record nested (`{"eval": {"commonsense": {...}}}`) or with W&B's slash-separated keys
(`eval/commonsense/avg`); both flatten to the same dotted columns. `wandb` is imported only here, only
when called, so nothing else depends on it.
"""

from __future__ import annotations

import pandas as pd

from ..mla.spec import default_r
from .records import flatten

# W&B run states -> run-record statuses; a finished run without its own `status` is taken as ok
_STATES = {"finished": "ok", "crashed": "failed", "failed": "failed", "killed": "failed", "running": "running"}
_RECORD_FIELDS = (
    "run_name",
    "experiment",
    "status",
    "error",
    "model",
    "variant",
    "mla",
    "kv_quant",
    "kv",
    "train",
    "eval",
    "timings",
    "machine",
    # the runner logs its hashes with the config: a run on disk and in W&B is one setting and seed, counted once
    "config_hash",
    "trained_hash",
    "eval_hash",
    "setting_hash",
)


def _dotted(mapping: dict, prefix: str = "") -> dict:
    return {key.replace("/", "."): value for key, value in flatten(mapping, prefix).items()}


def _plain(mapping) -> dict:
    """W&B summary/config objects -> plain dicts, without W&B's private keys (`_step`, `_wandb`, ...)."""
    raw = getattr(mapping, "_json_dict", mapping)
    return {k: v for k, v in dict(raw).items() if not str(k).startswith("_")}


def mla_from_hydra(config: dict) -> dict | None:
    """The record's `mla` block rebuilt from the runner's Hydra config, for runs whose W&B summary does not
    carry it. Mirrors `runner.config.validate`: `rope.r: null` means the paper's d_h/16."""
    if config.get("variant") != "mla":
        return None
    rope, svd = config.get("rope") or {}, config.get("svd") or {}
    head_dim = ((config.get("model") or {}).get("shape") or {}).get("head_dim")
    r = rope.get("r")
    if r is None and head_dim:
        r = default_r(rope.get("strategy"), head_dim)
        r = head_dim // 16 if r is None else r  # a strategy this checkout does not know: the paper's default
    return {
        "rope": rope.get("strategy"),
        "r": r,
        "svd": svd.get("method"),
        "d_kv": None if svd.get("method") == "none" else svd.get("d_kv"),
        "score": rope.get("score"),
        "sigma": svd.get("sigma"),
        "init": svd.get("init"),
        "allocation": svd.get("allocation"),
    }


def wandb_record(run) -> dict:
    """One W&B run (a `wandb.apis.public.Run` or anything with the same attributes) -> one flat record."""
    config, summary = _plain(run.config), _plain(run.summary)
    record = _dotted(config, "config")
    # the run record's own fields may have been logged in the config (at start) or the summary (at end)
    record.update(_dotted({k: v for k, v in config.items() if str(k).split("/")[0] in _RECORD_FIELDS}))
    record.update(_dotted(summary))
    if not any(key.startswith("mla.") or key == "mla" for key in record):
        record.update(flatten({"mla": mla_from_hydra(config)}))
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
