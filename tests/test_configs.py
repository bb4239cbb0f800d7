"""Every config group option and every experiment (with each of its sweep cells) composes and
validates against the model's shape facts, without loading any weight."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mha2mla_exp.runner import ConfigError, plan_run, run_config, validate
from tests.compositions import catalogue, composed, expand
from tests.conftest import bf16_untimed

CONF = Path(__file__).resolve().parents[1] / "conf"
PUBLISHED_RUNS = CONF.parent / "results" / "runs"
GROUPS = ["model", "data", "rope", "svd", "kv_quant", "train", "eval", "logger"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def validated(cfg):
    return validate(run_config(cfg), bf16_pays=bf16_untimed)


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


def offline_longbench(cfg, folder: Path) -> list[str]:
    """LongBench data come from the hub; offline, a folder in its format stands in (validation reads no doc)."""
    if not cfg.eval.longbench.enabled:
        return []
    from mha2mla_exp.evaluation.longbench import SUBSETS

    for subset in SUBSETS:
        (folder / f"{subset}.jsonl").write_text("")
    return [f"eval.longbench.data_dir={folder}"]


@pytest.fixture
def aws_access(monkeypatch):
    """The paper's mixture reads python-edu from S3; these tests compose it on machines without AWS access."""
    from mha2mla_exp.data import sources

    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)


@pytest.mark.slow
@pytest.mark.parametrize("name, budget", sorted(catalogue(), key=str))
def test_every_experiment_and_row_composes_and_validates(name, budget, aws_access, tmp_path):
    launched = [f"+experiment={name}", *([f"budget={budget}"] if budget else []), f"results_dir={PUBLISHED_RUNS}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        jobs = [job for _, job in expand(launched)]
        cells = [composed(job + offline_longbench(composed(job), tmp_path)) for job in jobs]
    assert jobs, "an experiment declares its grid"
    one_process = SimpleNamespace(num_processes=1, is_main_process=True)
    # planned as the runner plans them against the published runs (`train.precision=auto` goes on in the mode a
    # committed record was made in), on a CPU where bf16 pays and on one where it does not, whichever this is
    configs = [run_config(cell) for cell in cells]
    for bf16_fast in (True, False):
        pinned = lambda *_, fast=bf16_fast: (fast, "pinned by the test")  # noqa: E731
        plans = [plan_run(config, one_process, bf16_pays=pinned) for config in configs]
        # two rows may be one run on a machine (a row pinning bf16-autocast, another leaving `auto` to choose it):
        # then they share a name and a hash, and a sweep makes it once; two different runs never share a name
        named = {(plan.identity.name, plan.identity.run_hash) for plan in plans}
        assert len({name for name, _ in named}) == len(named), f"two runs share a name (bf16 pays: {bf16_fast})"


def rows_of(*launched: str) -> list:
    """The configs of a launch's rows (hydra/sweeper: rows expanded as tests/compositions.py does)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        jobs = [job for _, job in expand(list(launched))]
        return [composed(job) for job in jobs]


def test_table3_is_paper_table_3():
    rows = set()
    for cfg in rows_of("+experiment=table3"):
        plan = validated(cfg)
        spec = plan.conversion.spec
        rows.add(
            (plan.conversion.table_variant, spec and spec.rope, spec and spec.r, spec and spec.svd, spec and spec.d_kv)
        )
    assert rows == {
        ("finetuned_full_attention", None, None, None, None),
        *{("partial_rope", s, 4, "none", None) for s in ("high", "low", "uniform", "2-norm", "rorope")},
        *{("partial_rope+svd", s, 4, "joint", 16) for s in ("high", "low", "uniform", "2-norm", "rorope")},
        ("partial_rope+svd", "2-norm", 4, "split", 16),
    }


def test_table1_uses_each_models_three_d_kv():
    for model, expected in (("smollm2_135m", {32, 16, 8}), ("llama2_7b", {64, 32, 16})):
        d_kvs = set()
        for cfg in rows_of("+experiment=table1", f"model={model}"):
            plan = validated(cfg)
            if plan.conversion.spec:
                d_kvs.add(plan.conversion.spec.d_kv)
                assert plan.conversion.spec.r == cfg.model.shape.head_dim // 16
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
        (["kv_quant=quanto4", "kv_quant.nbits=3"], "kv_quant.nbits"),
        (["kv_quant=hqq4", "kv_quant.q_group_size=0"], "kv_quant.q_group_size"),
        (["model=smollm_1b7", "train.seq_len=4096"], "train.seq_len"),
        (["train.precision=fp8"], "train.precision"),
        (["objective=kd", "variant=finetuned_full_attention"], "objective.name"),
        (["objective=ce_kd", "objective.kd_weight=3"], "objective.kd_weight"),
        (["train.global_batch_rows=64"], "train.grad_accum"),
        (["device=tpu"], "device"),
        (["kv_quant.backend=bnb", "kv_quant.nbits=4"], "kv_quant.backend"),
        (["model.source=local", "model.id=/nonexistent/model"], "model"),
        (["model.source=asset", "model.id=no-such-asset"], "model"),
        (["model.shape.head_dim=0"], "model.shape"),  # null: refused at composition (its type)
        (["eval.commonsense.tasks=[piqa,siqa]"], "eval.commonsense"),
        (["+eval.commonsense.limt=5"], "eval.commonsense"),
        (["eval.longbench.enabled=true", "+eval.longbench.subsets=[narrativeqa,no_such_subset]"], "eval"),
    ],
)
def test_bad_configs_fail_before_loading_with_the_field_named(overrides, field):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(run_config(cfg))
    assert str(err.value).startswith(field), str(err.value)


PAPER_BUDGETS = {  # (optimizer steps, sequences per step, sequence length): METHOD.md, the paper's v1 recipe
    "smollm_135m": (18000, 64, 2048),
    "smollm_360m": (18000, 64, 2048),
    "smollm_1b7": (12000, 256, 2048),
    "llama2_7b": (12000, 256, 4096),
}


def sweep_commands(script: Path) -> list[list[str]]:
    """The overrides a sweep script passes for each model of its `for model in ...` loop (`paper_launch EXPERIMENT
    "$model"`, sweeps/paper_launch.sh, which adds the paper's budget and the launch: torchrun or SLURM tasks for the
    model's GPUs)."""
    import re
    import shlex

    text = script.read_text()
    models = re.search(r"for model in ([^;]+);", text).group(1).split()
    [line] = [l.strip() for l in text.splitlines() if l.strip().startswith("paper_launch ")]
    experiment, model, *rest = [a for a in shlex.split(line)[1:] if a != "$@"]
    assert model == "$model" and not rest, line
    return [[f"+experiment={experiment}", "budget=paper", f"model={m}"] for m in models]


@pytest.mark.parametrize("script", sorted((CONF.parent / "sweeps").glob("paper_table*.sh")), ids=lambda p: p.stem)
def test_paper_sweeps_pair_each_model_with_its_budget_length_and_calibration(script, aws_access, tmp_path):
    commands = sweep_commands(script)
    assert commands
    for overrides in commands:
        cfg = compose_cfg(overrides)
        cfg = compose_cfg(overrides + offline_longbench(cfg, tmp_path))
        model = cfg.model.name
        steps, batch, length = PAPER_BUDGETS[next(m for m in PAPER_BUDGETS if f"model={m}" in overrides)]
        assert cfg.data.name == "smollm-corpus" and cfg.data.source == "hub", model
        assert cfg.train.seq_len == length == cfg.data.seq_len <= cfg.model.shape.context_length, model
        assert cfg.train.tokens == steps * batch * length, model
        assert cfg.train.micro_batch_size * cfg.train.grad_accum == batch == cfg.train.global_batch_rows, model
        assert (cfg.calibration.num_sequences, cfg.calibration.seq_len) == (1024, length), model
        validated(cfg)


def test_paper_share_of_pretraining_tokens():
    cfg = compose_cfg(["+experiment=table1", "budget=paper", "model=smollm_135m"])
    share = 100 * cfg.train.tokens / cfg.model.pretrain_tokens
    assert 0.3 <= share <= 0.6  # the paper's claim: 0.3-0.6 % of the pretraining tokens


def test_the_global_batch_is_checked_against_the_processes(monkeypatch, aws_access):
    # train=paper forms the per-process batch itself: 64 rows on 8 processes take a micro-batch of 8 (the paper's
    # 16 x 8 processes gave grad_accum 0 and a refusal); what no micro-batch can form is refused
    base = ["+experiment=table1", "budget=paper", "model=smollm_135m", "variant=finetuned_full_attention"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    ok = compose_cfg(base)
    assert (ok.train.micro_batch_size, ok.train.grad_accum) == (8, 1) and validated(ok).training.fine_tune
    with pytest.raises(
        ConfigError,
        match=r"train\.grad_accum: .* x grad_accum 2 x 8 processes = 128 rows .* is 64: "
        r"set train\.grad_accum=1",
    ):
        validated(compose_cfg([*base, "train.grad_accum=2"]))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        ConfigError,
        match=r"train\.grad_accum: micro_batch_size 16 x grad_accum 1 x 3 processes = 48 "
        r"rows .* is 64: choose micro_batch_size x processes dividing 64",
    ):
        validated(compose_cfg(base))


def test_an_unsupported_architecture_fails_before_loading(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    cfg = compose_cfg(["model.source=local", f"model.id={folder}"])
    with pytest.raises(ConfigError, match=r"model\.id: .* is a 'gpt2' model; the MLA conversion handles"):
        validated(cfg)
    assert (
        validated(compose_cfg(["model.source=local", f"model.id={folder}", "variant=original"])).conversion.spec is None
    )


def test_hqq_three_bits_validates_and_quanto_three_bits_does_not():
    assert validated(compose_cfg(["kv_quant=hqq4", "kv_quant.nbits=3"])).evaluation.kv_quant.nbits == 3
    with pytest.raises(ConfigError, match="kv_quant.nbits: 3 is not supported by quanto"):
        validated(compose_cfg(["kv_quant=quanto4", "kv_quant.nbits=3"]))
