"""The paper-scale plan as a one-process launch sees it (issue 44): the processes a plan needs against the ones
launched (a one-process launch of the 8-GPU 7B plan is refused before loading, and a dry run says so), the
released configs' lr schedule per model, host memory per process, and the README's paper-scale torchrun line."""

from __future__ import annotations

import re

import pytest
import torch
from hydra import compose, initialize_config_dir

from mha2mla_exp.runner import run_config, validate
from mha2mla_exp.runner.config import ConfigError
from mha2mla_exp.train.budget import plan_budget
from mha2mla_exp.train.memory import estimate_host_memory
from mha2mla_exp.train.schedule import schedule_for
from tests.compositions import one_row
from tests.launches import ROOT


@pytest.fixture
def offline(monkeypatch, bf16_not_timed):
    """What validation asks the hub and S3 answered as on a cluster that has access; this CPU's bf16 not timed."""
    from mha2mla_exp.data import sources

    monkeypatch.setattr("mha2mla_exp.runner.config.probe_architecture", lambda cfg: (None, []))
    monkeypatch.setattr("mha2mla_exp.runner.config.probe_hub_datasets", lambda mixture: [])
    monkeypatch.setattr(sources, "check_software_heritage_access", lambda where: None)


def compose_paper(*overrides, experiment="table1", row="mla_dkv_dh_over_8"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=one_row([f"+experiment={experiment}", "budget=paper", "logger=none", *overrides], row),
        )


def test_a_one_process_launch_of_the_8_gpu_7b_plan_is_refused_before_loading(offline, monkeypatch):
    """`gpus_per_node: 1` (SLURM's default) or a plain `python -m` of the 7B: one process, no sharding, ~130 GB of
    fp32 state on one GPU. The check counted the plan's 8 processes and let it through."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: the check applies
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(
        ConfigError,
        match=r"train\.gpus: this launch has 1 process\(es\) but the plan is laid out "
        r"for 8 \(fsdp\).*torchrun --nproc_per_node 8",
    ):
        validate(run_config(compose_paper("model=llama2_7b", "device=cuda")))
    monkeypatch.setenv("WORLD_SIZE", "8")  # the launch the plan is for
    plan = validate(run_config(compose_paper("model=llama2_7b", "device=cuda")))
    assert (
        plan.training.processes.fits
        and plan.training.processes.launched == plan.training.processes.planned == 8
        and plan.training.processes.needed == 2
    )
    assert plan.training.memory.processes == 8 and plan.training.memory.total_gb < 80


def test_the_7b_dry_run_prints_processes_memory_schedule_and_mixture_and_refuses_the_launch(
    offline, monkeypatch, tmp_path, capsys
):
    from mha2mla_exp.runner.run import run

    monkeypatch.setenv("WORLD_SIZE", "1")
    outcome = run(run_config(compose_paper("model=llama2_7b", "dry_run=true", f"results_dir={tmp_path}")))
    printed = capsys.readouterr().out
    assert outcome["status"] == "refused" and "train.gpus: this launch has 1 process(es)" in outcome["error"]
    assert re.search(
        r"processes: the plan is laid out for 8 \(train\.gpus, fsdp; at least 2 to fit 80 GB per "
        r"GPU\); this launch has 1: refused: on 1 process\(es\) it needs \d+\.\d GB per GPU",
        printed,
    )
    assert "REFUSED as launched: train.gpus" in printed
    assert re.search(r"GPU memory: \d+\.\d GB per GPU \(fsdp on 8 process\(es\)", printed)
    assert re.search(r"host memory: main process \d+\.\d GB .*each of the other 7 \d+\.\d GB", printed)
    assert re.search(r"wall time: about [\d,]+\.\d h on 1 H100", printed)
    assert "warm-up ends at step 1,000, constant, then 1-sqrt decay from step 10,000 to 0 at step 12,000" in printed
    assert re.search(
        r"mixture, token shares: fineweb-edu-dedup 73\.9%, cosmopedia-v2 13\.0%, python-edu 7\.0%, "
        r"open-web-math 5\.2%, stackoverflow 0\.9% \(released: JT-Ushio/MHA2MLA@94467d1 "
        r"configs/mla/7B_rope_v4_topk8_svd_method7_rank32\.yaml\)",
        printed,
    )
    assert not any(tmp_path.iterdir())  # a plan writes nothing


@pytest.mark.parametrize(
    "model, warmup_end, decay_start, total",
    [
        ("smollm_135m", 900, 16_200, 18_000),
        ("smollm_360m", 900, 16_200, 18_000),
        ("smollm_1b7", 1_000, 10_000, 12_000),
        ("llama2_7b", 1_000, 10_000, 12_000),
    ],
)
def test_train_paper_has_the_released_configs_schedule(model, warmup_end, decay_start, total):
    """JT-Ushio/MHA2MLA configs/mla/*.yaml at 94467d1: lr_warmup_steps, lr_decay_starting_step and lr_decay_steps
    (1-sqrt to 0). train=paper decayed over the last 20 % of every model's steps."""
    cfg = compose_paper(f"model={model}")
    steps = plan_budget(cfg.train, pretrain_tokens=None, num_processes=1).steps
    schedule = schedule_for(cfg.train, steps)
    assert (schedule.warmup_steps, schedule.decay_start, schedule.total_steps) == (warmup_end, decay_start, total)
    lr = schedule.multiplier
    assert lr(0) == pytest.approx(1 / warmup_end) and lr(warmup_end - 1) == 1.0 and lr(warmup_end) == 1.0
    assert lr(decay_start - 1) == 1.0 and lr(decay_start) == 1.0  # nanotron's decay starts at its step
    assert lr(total - 1) == pytest.approx(1 - ((total - 1 - decay_start) / (total - decay_start)) ** 0.5)


def test_a_schedule_that_does_not_fit_the_budget_is_refused_naming_the_field(offline):
    with pytest.raises(
        ConfigError,
        match=r"train\.decay_steps: 1,000 warm-up steps .* and 2,000 decay steps do "
        r"not fit the budget's 4 steps",
    ):
        validate(run_config(compose_paper("model=llama2_7b", "train.tokens=4194304")))


def test_host_memory_per_process_follows_the_strategy():
    """On GPUs the weights go from the mapped files straight to each GPU and come back for the final save one
    safetensors shard at a time: no process holds the fp32 model on the host. Every rank used to load the full
    fp32 model on the host (8 ranks x 27 GB for the 7B), then the main process gathered it there at the end."""
    from mha2mla_exp.train.memory import HOST_RUNTIME_BYTES, SAVE_SHARD_BYTES

    p, embeddings = 6_738_415_616, 32000 * 4096  # Llama-2-7B
    fsdp = estimate_host_memory(parameters=p, processes=8, strategy="fsdp", largest_tensor=embeddings)
    ddp = estimate_host_memory(parameters=p, processes=8, strategy="ddp", largest_tensor=embeddings)
    assert (
        fsdp.main
        == ddp.main
        == {
            "checkpoint tensor in flight": 4 * embeddings,
            "final save (one safetensors shard)": SAVE_SHARD_BYTES,
        }
    )
    assert fsdp.other == ddp.other == {"checkpoint tensor in flight": 4 * embeddings}
    assert fsdp.other_gb == pytest.approx((HOST_RUNTIME_BYTES + 4 * embeddings) * 1.1 / 1e9)
    assert fsdp.main_gb < 4 * p / 1e9 / 4
    assert fsdp.node_gb(8) == pytest.approx(fsdp.main_gb + 7 * fsdp.other_gb)


def test_the_readmes_paper_scale_torchrun_line_is_the_papers_recipe(offline, monkeypatch):
    """It kept the CPU calibration (32 x 256, not 1,024 x 2,048) and the SmolLM2 asset, not the paper's model."""
    readme = (ROOT / "README.md").read_text()
    [line] = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith("torchrun") and "train=paper" in ln]
    argv = line.split("#")[0].split()
    world = int(argv[argv.index("--nproc_per_node") + 1])
    overrides = argv[argv.index("mha2mla_exp") + 1 :]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cfg.model.source == "hub" and cfg.model.paper_name  # one of the paper's models
    assert (cfg.calibration.num_sequences, cfg.calibration.seq_len) == (1024, cfg.model.finetune_length)
    assert cfg.data.source == "hub" and [p.weight for p in cfg.data.mixture] == [0.70, 0.15, 0.08, 0.06, 0.01]
    budget = plan_budget(cfg.train, pretrain_tokens=cfg.model.pretrain_tokens, num_processes=world)
    assert (budget.steps, budget.rows_per_step) == (cfg.model.paper_recipe.steps, cfg.model.paper_recipe.batch_size)
    assert validate(run_config(cfg)).training.fine_tune


def test_the_paper_sweeps_launch_each_model_with_the_processes_its_plan_needs(tmp_path):
    """sweeps/paper_table1.sh ran every model as one process (`python -m`), the 8-GPU 7B plan included."""
    import os
    import subprocess

    log = tmp_path / "calls"
    for prog in ("python", "torchrun"):
        stub = tmp_path / prog
        stub.write_text(f'#!/usr/bin/env bash\necho "{prog} $*" >> {log}\n')
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    script = ROOT / "sweeps" / "paper_table1.sh"
    subprocess.run(["bash", str(script), "logger=none"], env=env, check=True)
    local = log.read_text().splitlines()
    log.unlink()
    subprocess.run(["bash", str(script), "hydra/launcher=slurm"], env=env, check=True)
    slurm = log.read_text().splitlines()
    assert local[0].startswith("python -m mha2mla_exp +experiment=table1 budget=paper model=smollm_135m")
    assert local[-1].startswith(
        "torchrun --standalone --nproc_per_node 8 -m mha2mla_exp +experiment=table1 "
        "budget=paper model=llama2_7b logger=none"
    )
    assert "hydra.launcher.tasks_per_node=1 hydra.launcher.gpus_per_node=1" in slurm[0]
    assert "model=llama2_7b hydra.launcher.tasks_per_node=8 hydra.launcher.gpus_per_node=8" in slurm[-1]


@pytest.mark.parametrize("model", ["smollm_1b7", "llama2_7b"])
def test_the_slurm_stop_margin_covers_the_step_in_flight_and_the_checkpoint(model):
    """A time-limit signal checkpoints at the next step boundary: the margin must outlast the step in progress
    (~1 min for 1M tokens on 8 GPUs) and writing the checkpoint on a slow shared filesystem (100 MB/s a
    process). 120 s was under what the 7B's sharded and the 1.7B's DDP checkpoint take there."""
    from omegaconf import OmegaConf

    from mha2mla_exp.train.memory import checkpoint_bytes_per_process, parameter_count

    launcher = OmegaConf.load(ROOT / "conf" / "hydra" / "launcher" / "slurm.yaml")
    cfg = compose_paper(f"model={model}")
    shape, sizes, plan = cfg.model.shape, cfg.model.sizes, cfg.model.gpu_plan
    p = parameter_count(
        shape.num_layers,
        shape.hidden_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        sizes.intermediate_size,
        sizes.vocab_size,
        sizes.tied_embeddings,
    )
    written = checkpoint_bytes_per_process(parameters=p, processes=plan.gpus, strategy=plan.strategy)
    assert launcher.signal_delay_s >= 60 + written / 100e6


def test_a_mixture_part_dropped_for_missing_access_makes_another_model(offline, monkeypatch):
    """data.missing_parts=renormalise drops python-edu where this machine cannot read it: the run reads other text,
    so it must not share a trained model (hash) with a run on a machine that reads all five parts."""
    from mha2mla_exp.data import sources

    overrides = ("model=smollm_135m", "data.missing_parts=renormalise")
    everywhere = validate(run_config(compose_paper(*overrides)))
    monkeypatch.setattr(
        sources, "part_access_error", lambda part, where: "no AWS credentials" if part.get("blob_field") else None
    )
    without_python_edu = validate(run_config(compose_paper(*overrides)))
    assert without_python_edu.identity.trained_hash != everywhere.identity.trained_hash
