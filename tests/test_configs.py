"""Every config group option and every experiment (with each of its sweep cells) composes and
validates against the model's shape facts, without loading any weight."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mha2mla_exp.runner import ConfigError, validate
from mha2mla_exp.runner.config import describe

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["model", "data", "rope", "svd", "kv_quant", "train", "eval", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(overrides: list[str], hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    names = options(group)
    assert names, f"conf/{group} is empty"
    for name in names:
        cfg = compose_cfg([f"{group}={name}"])
        OmegaConf.resolve(cfg)  # interpolations must resolve too


@pytest.mark.parametrize("name", options("experiment"))
def test_every_experiment_and_cell_composes_and_validates(name):
    cfg = compose_cfg([f"+experiment={name}"], hydra=True)
    assert cfg.experiment == name
    assert str(cfg.hydra.mode) in ("MULTIRUN", "RunMode.MULTIRUN"), "an experiment runs its own grid"
    params = cfg.hydra.sweeper.params
    assert params, "an experiment declares its grid"
    grids = []
    for key, value in params.items():
        if value.startswith("glob("):
            group = key.lstrip("+")
            values = options(group)
        else:
            values = value.split(",")
        grids.append([f"{key}={v}" for v in values])
    import itertools

    names = set()
    for combo in itertools.product(*grids):
        cell = compose_cfg([f"+experiment={name}", *combo])
        plan = validate(cell)
        names.add(describe(plan, cell))
    assert len(names) == len(list(itertools.product(*grids))), "two cells of the grid would share a run name"


def test_partial_rope_ablation_is_paper_table_3():
    rows = set()
    for cell in options("cells/table3"):
        cfg = compose_cfg(["+experiment=partial_rope_ablation", f"+cells/table3={cell}"])
        plan = validate(cfg)
        spec = plan.spec
        rows.add((plan.table_variant, spec and spec.rope, spec and spec.r, spec and spec.svd, spec and spec.d_kv))
    assert rows == {
        ("finetuned_full_attention", None, None, None, None),
        *{("partial_rope", s, 4, "none", None) for s in ("high", "low", "uniform", "2-norm", "rorope")},
        *{("partial_rope+svd", s, 4, "joint", 16) for s in ("high", "low", "uniform", "2-norm", "rorope")},
        ("partial_rope+svd", "2-norm", 4, "split", 16),
    }


def test_main_table_uses_each_models_three_d_kv():
    for model, expected in (("smollm2_135m", {32, 16, 8}), ("llama2_7b", {64, 32, 16})):
        d_kvs = set()
        for cell in options("cells/table1"):
            cfg = compose_cfg(["+experiment=main_table", f"model={model}", f"+cells/table1={cell}"])
            plan = validate(cfg)
            if plan.spec:
                d_kvs.add(plan.spec.d_kv)
                assert plan.spec.r == cfg.model.shape.head_dim // 16
        assert d_kvs == expected, model


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["rope.r=40"], "rope.r"),
        (["rope=high", "rope.r=-1"], "rope.r"),
        (["svd.d_kv=999"], "svd.d_kv"),
        (["svd=split", "svd.d_kv=15"], "svd.d_kv"),
        (["rope.strategy=middle"], "rope.strategy"),
        (["svd.method=cur"], "svd.method"),
        (["svd.sigma=left"], "svd.sigma"),
        (["variant=distilled"], "variant"),
        (["kv_quant=hqq4", "kv_quant.nbits=5"], "kv_quant.nbits"),
        (["kv_quant.backend=bnb", "kv_quant.nbits=4"], "kv_quant.backend"),
        (["model.source=local", "model.id=/nonexistent/model"], "model"),
        (["model.source=asset", "model.id=no-such-asset"], "model"),
        (["model.shape.head_dim=null"], "model.shape"),
        (["eval.commonsense.tasks=[piqa,siqa]"], "eval.commonsense"),
        (["+eval.commonsense.limt=5"], "eval.commonsense"),
        (["eval.longbench.enabled=true", "+eval.longbench.subsets=[narrativeqa,no_such_subset]"], "eval"),
    ],
)
def test_bad_configs_fail_before_loading_with_the_field_named(overrides, field):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(field), str(err.value)
