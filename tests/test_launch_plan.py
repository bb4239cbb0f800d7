"""A paper-scale launch planned for time as well as memory (issue 53): fewer processes than the plan's layout is
refused naming the launch command (for memory, and for time where the plan would fit), unless intended; a
per-process batch the plan cannot form is fixed by the plan; the host memory counts the final save, the data stream
and a checkpoint tensor in flight, and SLURM's mem_gb is derived from it; the released mixture per model; a dry run
plans for a named device; the conversion runs in full fp32 (TF32 off)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mha2mla_exp.mla.spec import MLASpec
from mha2mla_exp.runner import run_config, validate
from mha2mla_exp.runner.config import ConfigError
from mha2mla_exp.train.budget import REFERENCE_THROUGHPUT, flops_per_token, plan_budget
from mha2mla_exp.train.memory import (
    SAVE_SHARD_BYTES,
    SLURM_MARGIN,
    STREAM_PART_BYTES,
    estimate_host_memory,
    parameter_count,
)
from tests.launches import ROOT
from tests.test_paper_plan import compose_paper, offline  # noqa: F401 (a fixture)


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def test_one_process_of_the_8_gpu_1b7_plan_is_refused_for_time_naming_the_launch(offline, gpu_machine, monkeypatch):
    """The 1.7B DDP plan fits one GPU's memory with activation checkpointing; one process was accepted and would
    have run 8 times the planned wall time (grad_accum 32)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as refused:
        validate(run_config(compose_paper("model=smollm_1b7", "device=cuda")))
    message = str(refused.value)
    assert message.startswith("train.gpus: this launch has 1 process(es) but the plan is laid out for 8 (ddp)")
    assert "torchrun --nproc_per_node 8" in message and "hydra.launcher.tasks_per_node=8" in message
    hours = [float(h.replace(",", "")) for h in re.findall(r"about ([\d,.]+) h", message)]
    assert len(hours) == 2 and hours[0] == pytest.approx(8 * hours[1], rel=1e-2)  # on 1 vs on 8 (rounded)
    intended = validate(
        run_config(compose_paper("model=smollm_1b7", "device=cuda", "train.allow_fewer_processes=true"))
    )
    assert (
        intended.training.processes.accepted
        and intended.training.processes.launched == 1
        and intended.training.processes.fits
    )
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert validate(run_config(compose_paper("model=smollm_1b7", "device=cuda"))).training.processes.accepted


def test_intended_fewer_processes_still_refused_where_memory_does_not_fit(offline, gpu_machine, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"needs about 131\.5 GB per GPU.*torchrun --nproc_per_node 8"):
        validate(run_config(compose_paper("model=llama2_7b", "device=cuda", "train.allow_fewer_processes=true")))


def test_smollm_135m_on_8_processes_is_planned_without_extra_options(offline, gpu_machine, monkeypatch):
    """64 sequences over 8 processes at the paper's micro-batch of 16 gave grad_accum 0 and a refusal."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    plan = validate(run_config(compose_paper("model=smollm_135m", "device=cuda")))
    train = plan.config.train
    assert (train.micro_batch_size, train.grad_accum, train.global_batch_rows) == (8, 1, 64)
    assert plan.training.processes.accepted and plan.training.processes.planned == 8
    monkeypatch.setenv("WORLD_SIZE", "1")  # the paper's own micro-batch where it forms the batch
    train = validate(run_config(compose_paper("model=smollm_135m", "device=cuda"))).config.train
    assert (train.micro_batch_size, train.grad_accum) == (16, 4)


def test_the_wall_time_follows_the_reference_throughput():
    """The reference (135M shape on one H200) reproduces its own measured tokens/s; other models scale by FLOPs."""
    from mha2mla_exp.train.budget import WallTime

    ref = REFERENCE_THROUGHPUT
    at_reference = WallTime(
        tokens=ref["tokens_per_s"] * 3600, flops_per_token=flops_per_token(**ref["shape"]), processes=1, gpu=ref["gpu"]
    )
    assert at_reference.hours == pytest.approx(1.0)
    assert at_reference.on(4).hours == pytest.approx(0.25)
    assert WallTime(at_reference.tokens, at_reference.flops_per_token, 1, "A100").hours == pytest.approx(989 / 312)
    # the reference shape is SmolLM2-135M's
    assert ref["shape"]["parameters"] == parameter_count(30, 576, 9, 3, 64, 1536, 49152, True)


def test_host_memory_counts_the_final_save_the_stream_and_a_checkpoint_tensor(offline, gpu_machine, monkeypatch):
    """The final save held the whole fp32 model on the host (27 GB for the 7B); now one safetensors shard."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    plan = validate(run_config(compose_paper("model=llama2_7b", "device=cuda")))
    host, vocab, hidden = plan.training.host_memory, 32000, 4096
    assert host.main == {
        "checkpoint tensor in flight": 4 * vocab * hidden,
        "data stream": 5 * STREAM_PART_BYTES + 2 * 8 * 1024 * 4096,
        "final save (one safetensors shard)": SAVE_SHARD_BYTES,
    }
    assert host.other == {"checkpoint tensor in flight": 4 * vocab * hidden}
    assert host.main_gb < 4 * plan.training.memory.parameters / 1e9  # never the whole fp32 model
    assert host.slurm_mem_gb(8) == math.ceil(host.node_gb(8) * (1 + SLURM_MARGIN))


def test_slurm_mem_gb_is_derived_from_the_host_estimate():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=table1",
                "budget=paper",
                "model=llama2_7b",
                "hydra/launcher=slurm",
                "hydra.launcher.tasks_per_node=8",
            ],
            return_hydra_config=True,
        )
    asked = OmegaConf.select(cfg, "hydra.launcher.mem_gb")
    p = parameter_count(32, 4096, 32, 32, 128, 11008, 32000, False)
    host = estimate_host_memory(
        parameters=p,
        processes=8,
        strategy="fsdp",
        largest_tensor=32000 * 4096,
        stream_parts=5,
        stream_window_tokens=1024 * 4096,
    )
    assert asked == host.slurm_mem_gb(8) and asked >= host.node_gb(8) * (1 + SLURM_MARGIN)


@pytest.mark.parametrize(
    "model, shares, source",
    [
        ("smollm_135m", [70.0, 15.0, 8.0, 6.0, 1.0], "rope_v4_topk4_svd_method7_rank8.yaml"),
        ("smollm_1b7", [70.0, 15.0, 6.0, 8.0, 1.0], "1.7B_rope_v4_top4_svd_method7_rank8.yaml"),
        ("llama2_7b", [73.9, 13.0, 7.0, 5.2, 0.9], "7B_rope_v4_topk8_svd_method7_rank32.yaml"),
    ],
)
def test_each_model_streams_its_released_mixture(model, shares, source):
    """JT-Ushio/MHA2MLA configs/mla/*.yaml at 94467d1: the 7B's dataset_weights are 0.85/0.15/0.08/0.06/0.01, the
    1.7B's swap python-edu (0.06) and open-web-math (0.08); every model streamed the 135M's."""
    from mha2mla_exp.data.sources import mixture_token_shares
    from mha2mla_exp.runner.config import run_config

    cfg = compose_paper(f"model={model}")
    config = run_config(cfg)
    got = [round(100 * share, 1) for _, share in mixture_token_shares(config.data)]
    assert got == shares
    assert config.model.paper_recipe.mixture_source.endswith(f"configs/mla/{source}")


def test_a_dry_run_on_cpu_plans_the_named_device(offline, monkeypatch, tmp_path, capsys):
    """`device=cuda` on a machine without one: the GPU run's precision, evaluation dtype and hashes (a CPU dry run
    printed the CPU's bf16 timing and its own folders)."""
    from mha2mla_exp.runner.run import run, run_dir_for, trained_model_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    outcome = run(
        run_config(compose_paper("model=smollm_135m", "device=cuda", "dry_run=true", f"results_dir={tmp_path}"))
    )
    printed = capsys.readouterr().out
    assert outcome["status"] == "planned", outcome
    assert "bf16-autocast (auto on CUDA" in printed and "evaluation dtype: bfloat16 (auto on CUDA" in printed
    with pytest.raises(ConfigError, match="device: cuda was asked for"):  # a real run still needs the GPU
        validate(run_config(compose_paper("model=smollm_135m", "device=cuda")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    on_gpu = validate(run_config(compose_paper("model=smollm_135m", "device=cuda", f"results_dir={tmp_path}")))
    assert outcome["run_dir"] == str(run_dir_for(on_gpu))  # the GPU run's folder, so its hashes
    assert f"trained model: {trained_model_for(on_gpu).dir} " in printed


def test_the_conversion_runs_in_full_fp32_with_tf32_on_for_the_run(monkeypatch):
    from mha2mla_exp.runner import stages

    seen = {}

    def convert_to_mla(model, spec, **kwargs):
        seen["matmul"] = torch.get_float32_matmul_precision()
        seen["cudnn"] = torch.backends.cudnn.allow_tf32
        return model

    monkeypatch.setattr(stages, "convert_to_mla", convert_to_mla)
    spec = MLASpec(rope="high", r=2, svd="none", d_kv=None)
    model = type("Model", (), {"config": object()})()
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high")  # what apply_matmul_precision does on CUDA
        torch.backends.cudnn.allow_tf32 = True
        assert stages.convert(spec, None, model, data=None) is model
        assert seen == {"matmul": "highest", "cudnn": False}
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_the_budget_is_the_same_on_any_launch_the_plan_accepts(offline, gpu_machine, monkeypatch):
    for world in ("8", "16"):
        monkeypatch.setenv("WORLD_SIZE", world)
        cfg = compose_paper("model=smollm_135m", "device=cuda")
        budget = plan_budget(cfg.train, pretrain_tokens=None, num_processes=int(world))
        assert (budget.steps, budget.rows_per_step) == (18_000, 64)
