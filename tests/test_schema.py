"""The typed schema and the identity computed from it: bad values refused before any loading, committed records'
identities recomputed from their config.yaml, a new option with a default moving no hash, a changed default
moving them all through the schema version."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from mha2mla_exp.confutil import CONF_DIR
from mha2mla_exp.runner import config as runner_config
from mha2mla_exp.runner import run_config
from mha2mla_exp.runner.config import ConfigError, validate
from mha2mla_exp.schema import sections
from mha2mla_exp.schema.fields import setting
from mha2mla_exp.schema.identity import SCHEMA_VERSION, number_changing_defaults

ROOT = Path(__file__).resolve().parents[1]


def committed_runs() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "results/**/results.json"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in listed if (ROOT / p).with_name("config.yaml").is_file()]


def _never_probe(*_):
    raise AssertionError("a recorded config says what it resolved; re-planning it must not time this machine")


def replan(results: Path, monkeypatch) -> dict:
    """The record's hashes as today's code plans its config.yaml, on its launch's process count."""
    record = json.loads(results.read_text())
    monkeypatch.setenv("WORLD_SIZE", str(record.get("machine", {}).get("processes") or 1))
    plan = validate(run_config(OmegaConf.load(results.with_name("config.yaml"))), bf16_pays=_never_probe)
    return {
        "config_hash": plan.identity.run_hash,
        "trained_hash": plan.identity.trained_hash,
        "eval_hash": plan.identity.eval_hash,
        "setting_hash": plan.identity.setting_hash,
    }


@pytest.fixture(scope="module")
def records() -> list[tuple[Path, dict]]:
    runs = committed_runs()
    assert len(runs) > 150
    return [(p, json.loads(p.read_text())) for p in runs]


def test_every_committed_record_recomputes_its_identity_from_its_config(records, monkeypatch):
    moved = []
    for path, record in records:
        recorded = {k: record[k] for k in ("config_hash", "trained_hash", "eval_hash", "setting_hash")}
        if replan(path, monkeypatch) != recorded:
            moved.append(str(path.parent.relative_to(ROOT)))
        assert path.parent.name.endswith(f"-{record['config_hash']}")  # a relaunch finds it by its hash
    assert not moved, moved


def test_a_new_option_with_a_default_moves_no_committed_hash(records, monkeypatch):
    """An option added to a group (here train) with a default: every committed run keeps its hashes."""
    extended_train = dataclasses.make_dataclass(
        "TrainConfig", [("a_new_knob", int, setting(3, "a test's new option"))], bases=(sections.TrainConfig,)
    )
    extended = dataclasses.make_dataclass(
        "RunConfig",
        [("train", extended_train, dataclasses.field(default_factory=extended_train))],
        bases=(sections.RunConfig,),
    )
    sample = records[:: max(1, len(records) // 40)]  # every experiment's runs alike; 40 keep the test short
    before = [replan(path, monkeypatch) for path, _ in sample]
    monkeypatch.setattr(runner_config, "RunConfig", extended)
    assert [replan(path, monkeypatch) for path, _ in sample] == before
    cfg = OmegaConf.load(sample[0][0].with_name("config.yaml"))
    cfg.train.a_new_knob = 4  # set away from its default, it is part of what the run is
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert validate(run_config(cfg), bf16_pays=_never_probe).identity.trained_hash != before[0]["trained_hash"]


def test_the_defaults_of_a_schema_version_are_pinned():
    """A changed default changes what every config that leaves the option alone means: it must bump
    SCHEMA_VERSION (moving every hash: the records migrated once, as issue 45 did), never pass unseen. New options
    may be added freely."""
    pinned = json.loads((ROOT / f"mha2mla_exp/schema/defaults_v{SCHEMA_VERSION}.json").read_text())
    today = json.loads(json.dumps(number_changing_defaults(), default=str))
    changed = {k: (v, today.get(k, "<removed>")) for k, v in pinned.items() if today.get(k, "<removed>") != v}
    assert not changed, f"defaults changed within schema version {SCHEMA_VERSION}: {changed}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.tokens=abc", "train.tokens"),
        ("train.lr=-1", "train.lr: must be positive"),
        ("calibration.num_sequences=0", "calibration.num_sequences: must be positive"),
        ("train.seq_len=0", "train.seq_len: must be positive"),
        ("data.held_out_fraction=1.5", "data.held_out_fraction: must lie in (0, 1)"),
        ("variant=mha", "variant: expected one of"),
        ("train.precision=fp8", "train.precision: expected one of"),
        ("eval.dtype=int8", "eval.dtype: expected one of"),
        ("svd.method=qr", "svd.method: expected one of"),
        ("kv_quant.nbits=-2", "kv_quant.nbits: must be positive"),
        ("train.decay_fraction=2", "train.decay_fraction: must lie in [0, 1]"),
        ("train.enabled=maybe", "train.enabled"),
        ("train.no_such_option=1", "no_such_option"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field_before_anything_loads(override, message):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=["model=tiny_random", "logger=none", override])
        except ConfigCompositionException as err:  # a wrong type or an unknown key: the schema, at composition
            assert message.split(":")[0] in f"{err} {err.__cause__}"
            return
    with pytest.raises(ConfigError) as err:
        validate(run_config(cfg))
    assert message in str(err.value)


def test_an_option_documented_once_in_the_schema():
    """Every option has its documentation beside its default (schema/sections.py), nothing else to keep in sync."""
    undocumented = [
        f"{cls.__name__}.{f.name}"
        for cls in vars(sections).values()
        if dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
        if not f.metadata.get("doc")
    ]
    assert not undocumented, undocumented


def test_the_config_reference_is_the_schema():
    from mha2mla_exp.schema.reference import options_reference

    assert (ROOT / "docs/CONFIG.md").read_text() == options_reference(), "python -m mha2mla_exp.schema > docs/CONFIG.md"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["+data@train.data=teacher_samples", "objective=kd"],
        ["kv_quant=hqq4", "svd.d_kv=4"],
        ["variant=original", "train=none"],
        ["train=paper", "calibration=paper"],
    ],
)
def test_a_recorded_config_re_plans_to_the_runs_own_hashes(overrides, monkeypatch):
    """What a run writes as config.yaml is its identity: re-planned from the file, a relaunch (or the aggregate)
    finds the same hashes as the composed run had (a teacher model typed when composed, a mapping when read)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=tiny_random",
                "logger=none",
                "train.precision=fp32",
                "eval.dtype=float32",
                "svd.d_kv=8",
                *overrides,
            ],
        )
    plan = validate(run_config(cfg))
    recorded = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(plan.config)))
    again = validate(run_config(recorded), bf16_pays=_never_probe)
    assert (again.identity.run_hash, again.identity.setting_hash, again.identity.conversion_hash) == (
        plan.identity.run_hash,
        plan.identity.setting_hash,
        plan.identity.conversion_hash,
    )
