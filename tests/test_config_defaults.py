"""A default lives in one place, the schema (mha2mla_exp/schema/sections.py): a group YAML named after a schema
section, and conf/config.yaml, hold only what differs from it. A key that restates its default is allowed only where
composition needs it to undo a value an earlier config set, and then this file says which and why."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mha2mla_exp.schema.fields import default_of, section_type
from mha2mla_exp.schema.sections import RunConfig
from tests.compositions import CONF

# the groups whose options are one schema section each (conf/<group>/*.yaml merge onto RunConfig.<group>, or onto
# the root for a `# @package _global_` file)
SECTION_GROUPS = ("train", "eval", "model", "data", "svd", "rope", "kv_quant", "calibration", "objective", "budget")
SECTION_GROUPS += ("logger",)
# (file, key) -> why it restates the schema's default: each undoes what a config composed before it set
RESTATED_ON_PURPOSE = {
    ("budget/paper.yaml", "eval.perplexity.max_batches"): "every held-out row: undoes config.yaml's CPU-sized 4",
    ("budget/cpu.yaml", "calibration.num_sequences"): "the CPU budget's 32 whatever calibration group (paper: 1,024)",
    ("budget/cpu10x.yaml", "calibration.num_sequences"): "as budget/cpu.yaml",
}


def section_files() -> list[Path]:
    return [CONF / "config.yaml", *(p for g in SECTION_GROUPS for p in sorted((CONF / g).glob("*.yaml")))]


def package_of(path: Path) -> str:
    """Where a file merges: '' (the root) for config.yaml and `_global_` files, else its group's section."""
    if path.parent == CONF or "# @package _global_" in path.read_text().splitlines()[:1]:
        return ""
    return path.parent.name


def section_at(package: str) -> type:
    cls = RunConfig
    for name in filter(None, package.split(".")):
        cls = section_type(typing.get_type_hints(cls)[name])
    return cls


def same(value, default) -> bool:
    """Equal as a config value: a bool never equals a number (0 is not `false`), 1 equals 1.0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def restated(values: dict, cls: type, prefix: str = "") -> list[str]:
    """The keys of `values` (one file's, at the section `cls`) whose value is the schema's default there."""
    fields, hints, out = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls), []
    for key, value in values.items():
        if key == "defaults" or key == "hydra" and cls is RunConfig:
            continue
        assert key in fields, f"{prefix}{key}: not an option of {cls.__name__}"
        inner = section_type(hints[key])
        if inner is not None and isinstance(value, dict):
            out += restated(value, inner, f"{prefix}{key}.")  # a node's own keys (an empty node stays: it exists)
        elif same(value, default_of(fields[key])):
            out.append(f"{prefix}{key}")
    return out


def restated_in(path: Path) -> list[str]:
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return restated(values, section_at(package_of(path)))


def test_no_group_yaml_restates_a_schema_default():
    found = {(str(p.relative_to(CONF)), key) for p in section_files() for key in restated_in(p)}
    unexplained = sorted(found - set(RESTATED_ON_PURPOSE))
    assert not unexplained, "restates the schema's default (delete the key, or say why it must stay): " + ", ".join(
        f"{file}: {key}" for file, key in unexplained
    )
    assert set(RESTATED_ON_PURPOSE) <= found, "an allowed restatement no file makes any more"


def test_the_check_finds_a_restated_default(tmp_path):
    (tmp_path / "train").mkdir()
    path = tmp_path / "train" / "x.yaml"
    path.write_text("lr: 3.0e-4\ntokens: 1\nepochs_allowed: 0\nbetas: [0.9, 0.95]\ndata: {seq_len: 2048}\n")
    assert restated(OmegaConf.to_container(OmegaConf.load(path)), section_at("train")) == [
        "lr",
        "betas",
        "data.seq_len",
    ]
    with pytest.raises(AssertionError, match="lrr: not an option of TrainConfig"):
        restated({"lrr": 1}, section_at("train"))


def test_the_former_name_svd_budget_launches_the_kv_budget():
    """`svd=budget` named a KV-cache budget beside the compute budgets of conf/budget; it is `svd=kv_budget` now, and
    the commands given with the old name compose the same config."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        old, new = (
            compose(config_name="config", overrides=[f"svd={name}", "rope=rorope"]) for name in ("budget", "kv_budget")
        )
    assert OmegaConf.to_container(old, resolve=True) == OmegaConf.to_container(new, resolve=True)
    assert new.svd.kv_elements == 72 and new.svd.selection.num_sequences == 8
