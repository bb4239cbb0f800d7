"""`hydra/sweeper: rows`: the basic sweeper's cartesian `params`, times a list of named rows.

A paper table is rarely a full product (the full-attention baseline has no RoPE strategy, a NoPE row no r), so an
experiment lists its rows, each a list of overrides; a comma list inside a row sweeps within that row only:

    hydra:
      sweeper:
        rows:
          ft_full_attention: [variant=finetuned_full_attention]
          partial: [rope=high,low,uniform,2-norm, svd=none]        # four jobs
        params: {seed: "0,1"}                                      # every row, twice
        budget: ${budget.name}                                     # `at.<budget>` replaces `rows`, adds `params`
        at: {cpu: {rows: {...}}}

`hydra.sweeper.only=[partial]` runs only the named rows. An override given on the command line replaces the same
key's value in every row (`rope=high` above: one job per row).
"""

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf


@dataclass  # no `from __future__ import annotations` here: Hydra runs this module before sys.modules holds it
class RowsSweeperConf:
    _target_: str = "hydra_plugins.rows_sweeper.rows_sweeper.RowsSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None  # cartesian, over every row
    rows: Optional[Dict[str, Any]] = None  # name -> list of overrides
    budget: Optional[str] = None  # which entry of `at` applies
    at: Optional[Dict[str, Any]] = None  # budget -> {rows: replaces `rows`, params: added to `params`}
    only: Optional[List[str]] = None  # run only these rows


ConfigStore.instance().store(group="hydra/sweeper", name="rows", node=RowsSweeperConf, provider="mha2mla_exp")


def plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def grid(
    params: Optional[dict],
    rows: Optional[dict],
    budget: Optional[str] = None,
    at: Optional[dict] = None,
    only: Optional[Sequence[str]] = None,
) -> "OrderedDict[str, List[str]]":
    """The rows to run, each as its overrides with the params appended: name -> overrides."""
    params, rows, at = plain(params) or {}, plain(rows) or {}, plain(at) or {}
    here = at.get(budget) or {} if budget is not None else {}
    rows = here.get("rows", rows) or {"": []}
    params = {**params, **(here.get("params") or {})}
    if only:
        only = [only] if isinstance(only, str) else list(only)
        missing = [name for name in only if name not in rows]
        if missing:
            raise ValueError(f"hydra.sweeper.only: no row {missing}; the rows are {list(rows)}")
        rows = {name: rows[name] for name in only}
    tail = [f"{key}={value}" for key, value in params.items()]
    return OrderedDict((name, [str(o) for o in overrides] + tail) for name, overrides in rows.items())


def _choices(override: Override) -> List[str]:
    key = override.get_key_element()
    if override.is_sweep_override():
        if not override.is_discrete_sweep():
            raise ValueError(f"{key}: only comma lists, glob() and range() sweep in a row")
        return [f"{key}={value}" for value in override.sweep_string_iterator()]
    return [f"{key}={override.get_value_element_as_str()}"]


def _slot(override: Override) -> str:
    """What an override sets, whatever its prefix: a command-line `x=1` replaces a row's `+x=2`."""
    return override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"


def jobs(rows: "OrderedDict[str, List[str]]", arguments: Sequence[str], parser: OverridesParser) -> List[List[str]]:
    """Every job of every row: the row's overrides, swept, then the command line's (which win)."""
    out: List[List[str]] = []
    for name, overrides in rows.items():
        slots: "OrderedDict[str, List[str]]" = OrderedDict()
        for override in parser.parse_overrides(list(overrides)):
            if _slot(override) in slots:
                raise ValueError(f"row {name!r} sets {_slot(override)} twice: {overrides}")
            slots[_slot(override)] = _choices(override)
        for override in parser.parse_overrides(list(arguments)):
            slots[_slot(override)] = _choices(override)
        out.extend(list(job) for job in itertools.product(*slots.values()))
    return out


class RowsSweeper(BasicSweeper):
    def __init__(
        self,
        max_batch_size: Optional[int] = None,
        params: Optional[dict] = None,
        rows: Optional[dict] = None,
        budget: Optional[str] = None,
        at: Optional[dict] = None,
        only: Optional[List[str]] = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=None)
        self.rows = grid(params, rows, budget, at, only)
        self._jobs: List[List[str]] = []

    def sweep(self, arguments: List[str]) -> Any:
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self._jobs = jobs(self.rows, arguments, parser)
        return super().sweep(arguments)  # params are in the rows already: BasicSweeper parses none

    def split_arguments(self, overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        return list(self.split_overrides_to_chunks(self._jobs, max_batch_size))
