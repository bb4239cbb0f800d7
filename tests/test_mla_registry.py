"""The strategy registry: a RoPE strategy defined by one class, here in this file and nowhere else, is
validated, calibrated, converted, named, run by the runner and understood by the aggregation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_causal_lm
from hydra import compose, initialize_config_dir

from mha2mla_exp.mla import LOWRANK_INITS, ROPE_STRATEGIES, MLASpec, ModelShape, RopeStrategy, convert_to_mla
from mha2mla_exp.mla.calibration import Calibration
from mha2mla_exp.mla.layouts import HeadPairs
from mha2mla_exp.mla.rope.two_norm import top_pairs

ROOT = Path(__file__).resolve().parents[1]


class LoudestKeys(RopeStrategy):
    """Per KV head, the r pairs whose pre-RoPE keys have the largest mean norm (queries ignored)."""

    name = "test-loudest-keys"
    statistics = ("pair_norms",)
    calls = 0

    def select(self, shape, r, score, calibration):
        type(self).calls += 1
        _, k_norms = calibration.get("pair_norms")
        return [HeadPairs(top_pairs(k_norms[i], r)) for i in range(shape.num_layers)]


@torch.no_grad()
def test_a_new_strategy_converts(tokens):
    model = tiny_causal_lm("qwen2")
    calib = [tokens]
    mla = convert_to_mla(
        model, rope="test-loudest-keys", r=3, svd="joint", d_kv=6, init="activation", calibration=calib
    )
    shape = ModelShape.from_config(model.config)
    _, k_norms = Calibration(model, calib, shape).get("pair_norms")
    assert mla.config.rope_pairs == [top_pairs(k_norms[i], 3) for i in range(shape.num_layers)]
    assert mla.config.mla["rope"] == "test-loudest-keys"
    exact = convert_to_mla(model, rope="test-loudest-keys", r=8, svd="none", calibration=calib)
    assert (exact(tokens).logits - model(tokens).logits).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="rope='test-loudest-keys' needs calibration"):
        convert_to_mla(model, rope="test-loudest-keys", r=3, svd="none")


def test_a_new_strategy_runs_through_the_runner(tmp_path):
    from mha2mla_exp.aggregate.wandb_source import mla_from_hydra
    from mha2mla_exp.runner import run, run_config, validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=smoke",
                "rope.r=2",
                "svd.d_kv=8",
                f"results_dir={tmp_path}",  # its mla_2-norm_joint row
                "rope.strategy=test-loudest-keys",
                "rope.r=null",
                "train.enabled=false",
            ],
        )
    plan = validate(run_config(cfg))
    assert (
        plan.conversion.spec.rope == "test-loudest-keys"
        and plan.conversion.spec.r == 16 // 16
        and plan.conversion.spec.needs_calibration
    )
    assert "__test-loudest-keys-r1__joint-dkv8__" in plan.identity.name
    before = LoudestKeys.calls
    record = run(run_config(cfg))
    assert record["status"] == "ok", record["error"]
    assert LoudestKeys.calls == before + 1
    assert record["mla"]["rope"] == "test-loudest-keys" and record["mla"]["r"] == 1
    hydra_config = {
        "variant": "mla",
        "rope": {"strategy": "test-loudest-keys", "r": None},
        "svd": {"method": "joint", "d_kv": 8},
        "model": {"shape": {"head_dim": 16}},
    }
    assert mla_from_hydra(hydra_config)["r"] == 1


def test_registry_rules():
    assert {"full", "none", "high", "low", "uniform", "2-norm", "rorope", "test-loudest-keys"} <= set(ROPE_STRATEGIES)
    assert {"weight", "activation", "bkv", "output"} <= set(LOWRANK_INITS)
    with pytest.raises(ValueError, match="defined twice"):
        type("Impostor", (RopeStrategy,), {"name": "2-norm", "__module__": __name__})
    with pytest.raises(ValueError, match=r"unknown rope='middle'; expected one of .*'2-norm'"):
        ROPE_STRATEGIES.get("middle")

    class Helper(RopeStrategy):  # no name: a base for others, not a strategy
        pass

    assert "Helper" not in ROPE_STRATEGIES and "" not in ROPE_STRATEGIES
    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    assert MLASpec.create(shape, rope="2-norm", r=2, svd="joint", d_kv=4, init="output").statistics == (
        "pair_norms",
        "input_gram",
        "query_moments",
        "value_spread",
        "attention_inputs",
    )
    assert not MLASpec.create(shape, rope="high", r=2, svd="none").needs_calibration


def test_strategies_inits_statistics_and_objectives_share_one_registry_mechanism(monkeypatch):
    """One mechanism for every pluggable method: a named subclass of each kind's base registers itself, an
    unnamed one does not, a second class under a taken name is refused, an unknown name is an error naming the
    config field; the objective and the statistic are then built by name with their arguments."""
    from mha2mla_exp.mla.calibration import STATISTICS, Statistic
    from mha2mla_exp.mla.lowrank_init import LowRankInit
    from mha2mla_exp.registry import Registered, Registry
    from mha2mla_exp.schema.sections import ObjectiveConfig
    from mha2mla_exp.train import OBJECTIVES, build_objective
    from mha2mla_exp.train.objectives import Objective

    kinds = [
        (RopeStrategy, ROPE_STRATEGIES, "rorope", "rope"),
        (LowRankInit, LOWRANK_INITS, "bkv", "init"),
        (Statistic, STATISTICS, "pair_norms", "statistics"),
        (Objective, OBJECTIVES, "kd", "objective.name"),
    ]
    for base, registry, taken, field in kinds:
        assert isinstance(registry, Registry) and issubclass(base, Registered) and base.registry is registry
        monkeypatch.setattr(registry, "_classes", dict(registry._classes))  # the probes leave with the test
        named = type(f"Probe{base.__name__}", (base,), {"name": f"test-probe-{field}", "__module__": __name__})
        assert registry.class_of(f"test-probe-{field}") is named
        unnamed = type("Unnamed", (base,), {"__module__": __name__})
        assert unnamed not in [registry.class_of(n) for n in registry]
        with pytest.raises(ValueError, match="defined twice"):
            type("Impostor", (base,), {"name": taken, "__module__": __name__})
        with pytest.raises(ValueError, match=f"unknown {re.escape(field)}='no-such'"):
            registry.class_of("no-such")
    assert build_objective(ObjectiveConfig("kd", temperature=2.0)).temperature == 2.0
    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    assert STATISTICS.build("pair_norms", shape).shape is shape
