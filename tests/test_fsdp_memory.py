"""FSDP's host memory scales with the processes: under `train.strategy=fsdp` only the main process ever holds the
whole model on the host (the others build it on the meta device and receive their shards), checkpoints are
sharded (torch.distributed.checkpoint: each process writes its own piece, none the whole state), the trained
model is gathered to the main process alone, on the training device; and one process under torchrun shards too
(a mesh of one), so a single GPU runs the FSDP path."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from mha2mla_exp.train import sharding
from mha2mla_exp.train.recipe import KILL_AT_STEP_ENV, PEAK_RSS_DIR_ENV
from tests.conftest import tiny_causal_lm
from tests.launches import COMMON, ROOT, app, app_env, launch, only_record

# a random model whose weights dominate a process's memory: ~47M parameters, ~190 MB in fp32, in its layers
# (a small vocabulary: the held-out probe's logits would otherwise be the peak)
BIG = [
    "model.shape.num_layers=12",
    "model.shape.hidden_size=512",
    "model.shape.num_heads=8",
    "model.shape.num_kv_heads=4",
    "model.shape.head_dim=64",
    "model.intermediate_size=2048",
]
FSDP = ["train.micro_batch_size=4", "train.grad_accum=1", "train.strategy=fsdp"]


@pytest.mark.slow
def test_the_other_process_never_holds_a_full_copy_and_checkpoints_are_sharded(tmp_path):
    runs, rss = tmp_path / "runs", tmp_path / "rss"
    rss.mkdir()
    # 6 steps, a checkpoint every 2: killed after step 3, resumed from step 2, checkpointed again at 4
    # the evaluation is not what is measured: one batch of the held-out rows, not 71 through a 47M model (30 s)
    big = [*BIG, *FSDP, "train.tokens=1536", "eval.perplexity.max_batches=1"]
    killed = launch(runs, 2, *big, env={KILL_AT_STEP_ENV: "3"})
    assert killed.returncode != 0
    [checkpoint] = list((runs / "_trained").glob("*/checkpoint"))
    sizes = {str(f.relative_to(checkpoint)): f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()}

    # glibc's dynamic mmap threshold keeps freed buffers of up to 32 MB in its heap, so that the peak would measure
    # the allocator's retention; a fixed threshold returns them at once and the peak is what was held
    resumed = launch(runs, 2, *big, env={PEAK_RSS_DIR_ENV: str(rss), "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record, _ = only_record(runs)
    assert record["status"] == "ok" and record["train"]["strategy"] == "fsdp"
    assert record["train"]["resumed_from_step"] == 2
    copy = 4 * record["model"]["params"]  # bytes of one fp32 copy of the trained (converted) model

    # the checkpoint: weights and AdamW's two moments (3 copies) in one piece per process, no file with the whole
    shards = {name: size for name, size in sizes.items() if name.endswith(".distcp")}
    assert len(shards) == 2, sizes
    assert sum(shards.values()) >= 0.95 * 3 * copy, sizes
    assert max(sizes.values()) < 0.6 * 3 * copy, sizes

    # rank 1's peak over loading, resuming, training, checkpointing and the final gather, above what it held
    # before any weight was read: its shards of weights, gradients and AdamW's moments (16 bytes a parameter / 2,
    # i.e. 2 copies) plus less than one full copy in flight (a layer gathered, a broadcast tensor, a checkpoint item)
    other = json.loads((rss / "rank1.json").read_text())
    grown = other["after_training"] - other["before_load"]
    main = json.loads((rss / "rank0.json").read_text())
    print(
        f"one fp32 copy {copy / 1e6:.0f} MB; rank 1 grew {grown / 1e6:.0f} MB, rank 0 "
        f"{(main['after_training'] - main['before_load']) / 1e6:.0f} MB"
    )
    assert grown < (2 + 1) * copy, f"rank 1 grew {grown / copy:.2f} fp32 copies of the model"


def test_one_process_under_torchrun_trains_sharded_and_resumes_from_its_sharded_checkpoint(one_process, tmp_path):
    def torchrun(*extra, env=None):
        fsdp = ["train.micro_batch_size=4", "train.grad_accum=2", "train.strategy=fsdp"]  # the same 8 rows a step
        return subprocess.run(
            [*app(1, torchrun=True), *COMMON, *fsdp, *extra, f"results_dir={tmp_path}"],
            cwd=ROOT,
            env=app_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=900,
        )

    killed = torchrun(env={KILL_AT_STEP_ENV: "7"})
    assert killed.returncode != 0
    [checkpoint] = list((tmp_path / "_trained").glob("*/checkpoint"))
    assert list(checkpoint.rglob("*.distcp")), "no sharded (torch.distributed.checkpoint) state was written"

    resumed = torchrun()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (single, single_curve), (record, curve) = one_process, only_record(tmp_path)
    assert record["status"] == "ok" and record["train"]["strategy"] == "fsdp" and record["train"]["processes"] == 1
    assert record["train"]["resumed_from_step"] == 6
    losses = {row["step"]: row["loss"] for row in single_curve if "loss" in row}
    assert [row["step"] for row in curve] == [0, *range(1, single["train"]["steps"] + 1)]
    for row in curve[1:]:
        assert row["loss"] == pytest.approx(losses[row["step"]], abs=1e-4)
    assert record["eval"]["perplexity"]["heldout"] == pytest.approx(single["eval"]["perplexity"]["heldout"], rel=1e-3)


@pytest.fixture
def world_of_one():
    import torch.distributed as td

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        td.destroy_process_group()


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")  # meta copies nothing, as meant
@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_the_gathered_model_is_built_on_the_device_it_is_given(world_of_one, target):
    # meta stands in for a GPU: the plain copy must be placed where it is asked, not left on the CPU
    model = tiny_causal_lm("gqa", tie=True)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    sharding.shard(model, "cpu", 1)
    plain = sharding.gathered_copy(model, torch.device(target), main=True)
    assert not sharding.is_sharded(plain)
    assert {p.device.type for p in plain.parameters()} == {target}
    assert {b.device.type for b in plain.buffers()} == {target}
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # still tied
    if target == "cpu":
        for name, value in plain.state_dict().items():
            assert torch.equal(value, reference[name]), name
        for (name, buffer), (_, original) in zip(plain.named_buffers(), model.named_buffers()):
            assert torch.equal(buffer, original), name  # non-persistent buffers (rotary frequencies) too


@pytest.mark.parametrize("device, placement", [("cpu", None), ("cuda:1", "cuda:1")])
def test_a_model_for_a_gpu_is_read_straight_onto_it(monkeypatch, tmp_path, device, placement):
    # no CPU copy of the whole model on the way to a GPU: from_pretrained is given the device (a device_map)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mha2mla_exp import models

    asked = {}
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: asked.update(k) or "model")
    assert models._load_folder(tmp_path, torch.float32, torch.device(device)) == ("model", None)
    assert asked.get("device_map") == placement
