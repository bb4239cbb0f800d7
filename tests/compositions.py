"""Every run the experiments declare, composed: each experiment at each of its budgets, its sweeper's rows and
params expanded as `hydra/sweeper: rows` expands them (the basic sweeper's `params` alone are the same product),
each job composed into a resolved config. Used by tests/test_experiments.py; as a script it snapshots them or
checks a snapshot (made before the experiments were refactored) against today's:

    python -m tests.compositions snapshot /tmp/compositions_before.json
    python -m tests.compositions compare /tmp/compositions_before.json
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Iterator

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

import mha2mla_exp.confutil  # noqa: F401  (the resolvers the configs use)
from hydra_plugins.rows_sweeper.rows_sweeper import grid, jobs

CONF = Path(__file__).resolve().parents[1] / "conf"
# the models the paper sweeps (sweeps/paper_table*.sh) and the README launch these experiments (by name) with
MODELS = ("smollm_135m", "smollm_360m", "smollm_1b7", "llama2_7b")
WITH_MODELS = {"main_table", "longbench_quant", "paper_table1", "paper_table2", "paper_table3", "paper_table5"}


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def budgets(experiment: str) -> dict[str | None, str]:
    """budget -> the experiment's name (its records' folder) at that budget; {None: name} for one that takes none."""
    cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"])
    names = OmegaConf.select(cfg, "budget.names")
    return dict(names) if names else {None: cfg.experiment}


@functools.lru_cache(maxsize=None)
def catalogue() -> dict[tuple[str, str | None], str]:
    """(experiment, budget) -> the experiment's name there (its records' folder), for every experiment file (once a
    process: the test modules that parametrize over it are collected by every xdist worker)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return {
            (experiment, budget): name for experiment in experiments() for budget, name in budgets(experiment).items()
        }


def launch(experiment: str, budget: str | None = None, *extra: str) -> list[str]:
    """The command line's overrides: `python -m mha2mla_exp <these>`."""
    return [f"+experiment={experiment}", *([f"budget={budget}"] if budget else []), *extra]


def rows(arguments: list[str]) -> dict[str, list[str]]:
    """The sweeper's rows for a launch, params appended: name -> overrides."""
    sweeper = composed(arguments, hydra=True).hydra.sweeper
    sweeper = OmegaConf.to_container(sweeper, resolve=True)
    return grid(
        sweeper.get("params"), sweeper.get("rows"), sweeper.get("budget"), sweeper.get("at"), sweeper.get("only")
    )


def expand(arguments: list[str]) -> list[tuple[str, list[str]]]:
    """Every job of a launch as (row name, its overrides in the order the sweeper passes them)."""
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return [
        (name, job) for name, overrides in rows(arguments).items() for job in jobs({name: overrides}, arguments, parser)
    ]


def one_row(arguments: list[str], name: str) -> list[str]:
    """The overrides of a launch's row `name` as the sweeper passes them (a row of one job)."""
    [job] = [job for row, job in expand(arguments) if row == name]
    return job


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...], hydra: bool) -> DictConfig:
    cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)
    OmegaConf.set_readonly(cfg, True)  # shared by every caller: one that tried to change it would fail loudly
    return cfg


def composed(overrides: list[str], hydra: bool = False) -> DictConfig:
    """Hydra's compose of conf/config.yaml (inside `initialize_config_dir(CONF)`), once per command line in a test
    session: the experiment tests, the config tests and the committed-record check compose the same ~700 jobs, and
    a composition costs tens of milliseconds. Read-only; interpolations resolve when read, as compose leaves them."""
    return _composed(tuple(overrides), hydra)


def resolved(overrides: list[str]) -> dict:
    return OmegaConf.to_container(composed(overrides), resolve=True)


def launches() -> Iterator[tuple[str, str | None, list[str]]]:
    """(experiment, budget, command line) for every experiment, budget and model the repo launches."""
    for experiment in experiments():
        for budget, name in budgets(experiment).items():
            yield experiment, budget, launch(experiment, budget)
            if name in WITH_MODELS:
                for model in MODELS:
                    yield experiment, budget, launch(experiment, budget, f"model={model}")


def everything() -> list[dict]:
    """Every job of every launch, composed (the order the sweeper passes the overrides in, the row's first); a
    composition that fails carries its error instead of a config."""

    def composed(job: list[str]) -> dict:
        try:
            return {"config": resolved(job)}
        except Exception as err:  # noqa: BLE001 (reported by the caller)
            return {"config": {}, "error": f"{type(err).__name__}: {err}"}

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return [
            {"experiment": experiment, "budget": budget, "row": name, "overrides": job, **composed(job)}
            for experiment, budget, arguments in launches()
            for name, job in expand(arguments)
        ]


def flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def differences(old: dict, new: dict) -> dict:
    """Old keys whose value moved or vanished (keys only `new` has are tolerated: a schema's new defaults)."""
    return moved(flat(old), flat(new))


def moved(old: dict, new: dict) -> dict:
    """`differences` of two flattened configs."""
    return {k: (v, new.get(k, "<absent>")) for k, v in old.items() if new.get(k, "<absent>") != v}


def match(before: list[dict], after: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each old composition paired with an equal new one (each new one used once): (unmatched old, unused new)."""

    def bucket(c: dict) -> tuple:
        return c["config"].get("experiment"), c["config"].get("model", {}).get("name")

    unused: dict[tuple, list[tuple[dict, dict]]] = {}
    for new in after:
        unused.setdefault(bucket(new), []).append((new, flat(new["config"])))
    lost = []
    for old in before:
        candidates, old_flat = unused.get(bucket(old), []), flat(old["config"])
        same = next((pair for pair in candidates if not moved(old_flat, pair[1])), None)
        if same is None:
            lost.append(old)
        else:
            candidates.remove(same)
    return lost, [new for pairs in unused.values() for new, _ in pairs]


def main(argv: list[str]) -> int:
    command, path = argv
    if command == "snapshot":
        Path(path).write_text(json.dumps(everything(), indent=1))
        return 0
    before, after = json.loads(Path(path).read_text()), everything()
    for failed in (c for c in after if "error" in c):
        print(f"FAILS {failed['experiment']} {failed['budget']} {' '.join(failed['overrides'])}: {failed['error']}")
    lost, unused = match(before, [c for c in after if "error" not in c])
    for old in lost:
        near = min(after, key=lambda new: len(differences(old["config"], new["config"])))
        print(
            f"LOST {old['experiment']} {' '.join(old['overrides'])}\n  nearest {near['experiment']} "
            f"{near['budget']} {' '.join(near['overrides'])}: {differences(old['config'], near['config'])}"
        )
    for new in unused:
        print(f"NEW  {new['experiment']} {new['budget']} {' '.join(new['overrides'])}")
    print(f"{len(before)} compositions before, {len(after)} after: {len(lost)} lost, {len(unused)} new")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
