"""The runner reads in one sitting: followed from the entry (`__main__.main` -> `runner.run`), the config reaches
few functions inside `runner/`, and no stage function takes the whole plan.

The count is a trace (sys.settrace) of a tiny dry run and a tiny real run: every function under
`mha2mla_exp/runner/` that is called with the composed config, the typed RunConfig, one of its sections, the
RunPlan or one of the plan's parts as an argument. `python -m tests.test_runner_reading` prints the functions.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import mha2mla_exp.runner as runner_package
from mha2mla_exp.schema import sections
from tests.compositions import one_row

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(runner_package.__file__).parent) + "/"
MOST_VISITED = 25  # issue 55: 49 before the plan was split by layer
# the real run: converted, distilled layer-wise and fine-tuned briefly, so that every stage runs
REAL = ("train.tokens=512", "distill.enabled=true", "distill.sequences=2", "distill.seq_len=16", "distill.epochs=1")
SECTION_TYPES = tuple(
    cls for cls in vars(sections).values() if dataclasses.is_dataclass(cls) and cls.__module__ == sections.__name__
)


def config_carriers() -> tuple[type, ...]:
    """The types that carry the config: the composed and typed config and its sections, the plan, its parts and
    the parts' own dataclass fields (a stage handed `plan.training.precision` is handed part of the plan)."""
    from mha2mla_exp.runner.config import RunPlan

    def dataclass_fields(cls) -> set[type]:
        found = set()
        for hint in typing.get_type_hints(cls).values():
            for kind in (hint, *typing.get_args(hint)):
                if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                    found.add(kind)
        return found

    parts = dataclass_fields(RunPlan)
    for part in list(parts):
        parts |= dataclass_fields(part)
    return (DictConfig, RunPlan, *SECTION_TYPES, *parts)


def carried(value, carriers: tuple[type, ...]) -> bool:
    """Whether `value` is a carrier or holds one in an attribute (an object keeping the plan counts as the plan)."""
    if isinstance(value, carriers):
        return True
    held = getattr(value, "__dict__", None)
    return isinstance(held, dict) and any(isinstance(v, carriers) for v in held.values())


def smoke_cfg(results_dir: Path, *extra: str) -> DictConfig:
    """One row of experiment=smoke as the app receives it (Hydra's own config set aside, as `hydra.main` does)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=one_row(["+experiment=smoke", f"results_dir={results_dir}", *extra], "mla_2-norm_joint"),
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def visits(*cfgs: DictConfig) -> dict[str, list[str]]:
    """{runner function: the config carriers it received} over the app's entry called on each config."""
    from mha2mla_exp.__main__ import main

    carriers = config_carriers()
    seen: dict[str, list[str]] = {}

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(RUNNER):
            count = code.co_argcount + code.co_kwonlyargcount
            names = code.co_varnames[:count]
            got = [n for n in names if carried(frame.f_locals.get(n), carriers)]
            if got:
                where = f"{Path(code.co_filename).stem}.{code.co_qualname}"
                seen[where] = sorted(set(seen.get(where, [])) | set(got))
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for cfg in cfgs:
            main(cfg)
    finally:
        sys.settrace(previous)
    return seen


def test_the_config_visits_few_runner_functions_and_no_stage_takes_the_whole_plan(tmp_path):
    from mha2mla_exp.runner.config import RunPlan

    dry = smoke_cfg(tmp_path, "dry_run=true")
    real = smoke_cfg(tmp_path, *REAL)
    seen = visits(dry, real)
    assert {"run.run", "stages.convert", "stages.distill"} <= set(seen)  # the trace saw the stages
    assert len(seen) <= MOST_VISITED, "\n".join(f"{k}: {v}" for k, v in sorted(seen.items()))
    assert (tmp_path / "smoke").is_dir()  # the real run ran
    from mha2mla_exp.runner import stages

    whole_plan = [
        name
        for name, fn in vars(stages).items()
        if callable(fn)
        and getattr(fn, "__module__", None) == stages.__name__
        and any(p.annotation in (RunPlan, "RunPlan") for p in __import__("inspect").signature(fn).parameters.values())
    ]
    assert not whole_plan, whole_plan


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = visits(smoke_cfg(Path(tmp), "dry_run=true"), smoke_cfg(Path(tmp), *REAL))
    for name, arguments in sorted(found.items()):
        print(f"{name}({', '.join(arguments)})")
    print(f"{len(found)} functions in runner/ receive the config, its sections, the plan or its parts")
