"""One placement for every evaluated model (evaluation/placement.py): on CUDA the original and a converted or
trained model reach the suites in the same dtype with the same fp32 RoPE phases, a trained model is evaluated on
the run's device whatever its training left, TF32 is on for CUDA alone, and CPU evaluations are as they were.

No GPU here: a CUDA placement is decided for 'cuda:0' and applied on the CPU (the casts are the same), and the
run's device is stood for by the meta device where only the target of a move matters."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_BYTE_LM

from mha2mla_exp.confutil import typed_section
from mha2mla_exp.evaluation.placement import EvalPlacement
from mha2mla_exp.evaluation.plan import EvalPlan
from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.runner import stages
from mha2mla_exp.schema.sections import EvalConfig


def cuda_placement_on_cpu(suites_dtype="bfloat16") -> EvalPlacement:
    """What the runner decides on a GPU, applied where this test can run."""
    decided = EvalPlacement.decide("cuda:0", suites_dtype=suites_dtype)
    return dataclasses.replace(decided, device=torch.device("cpu"))


def rotary_buffers(model) -> dict[str, torch.Tensor]:
    return {name: buf for name, buf in model.named_buffers() if name.endswith("inv_freq")}


def cuda_plan():
    """The evaluation's plan for the untouched original evaluated on a GPU."""
    return EvalPlan(dtype="bfloat16", dtype_reason="auto on CUDA", kv_quant=None)


def test_the_original_loads_like_every_other_row_on_cuda(monkeypatch):
    """Before: the untouched original was loaded in bf16 on CUDA (its perplexity in bf16, the others' in fp32)."""
    asked = {}

    def fake_load_model(model_cfg, *, device=None, dtype=None):
        asked["dtype"] = dtype
        return "model", "tokenizer"

    monkeypatch.setattr("mha2mla_exp.models.load_model", fake_load_model)
    for dtype, loaded in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):  # an explicit model.dtype wins
        model = dataclasses.replace(TINY_BYTE_LM, dtype=dtype)
        where = dataclasses.replace(cuda_plan(), model_dtype=model.dtype).placement(torch.device("cpu"))
        stages.load(model, where, torch.device("cpu"))
        assert asked["dtype"] == loaded


def test_original_and_converted_reach_the_suites_with_the_same_fp32_rotary_phases(tmp_path):
    """Through run_evaluation's own cast: every row in bf16, every inv_freq the fp32 one (before: the converted
    and fine-tuned rows were cast with `.to(bf16)`, which rounds inv_freq by up to 0.37 %)."""
    from mha2mla_exp.evaluation import run_evaluation
    from mha2mla_exp.evaluation.fixtures import text_files
    from mha2mla_exp.models import build_random_model

    original, tokenizer = build_random_model(TINY_BYTE_LM)
    exact = {k: v.clone() for k, v in rotary_buffers(original).items()}
    assert exact and all(v.dtype == torch.float32 for v in exact.values())
    converted = convert_to_mla(original, rope="high", r=2, svd="joint", d_kv=16)
    texts = [str(p) for p in text_files(tmp_path / "texts", n_docs=2, sentences=40)]
    eval_cfg = typed_section(
        EvalConfig,
        {
            "dtype": "bfloat16",
            "perplexity": {"enabled": False},
            "long_context": {"enabled": True, "lengths": [], "ppl_lengths": [128], "ppl_docs": 1, "texts": texts},
        },
        "eval",
    )
    for model in (original, converted):
        run_evaluation(model, tokenizer, eval_cfg, window=256, placement=cuda_placement_on_cpu())
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        buffers = rotary_buffers(model)
        assert set(buffers) >= {"model.rotary_emb.inv_freq"}
        for name, buf in buffers.items():
            assert buf.dtype == torch.float32 and torch.equal(buf, exact[name]), name


def test_a_trained_model_is_evaluated_as_kept_on_the_runs_device(monkeypatch, tmp_path):
    """FSDP's gathered copy lies on the CPU (train/sharding.py); the run evaluates on its own device. Before, the
    training copy was evaluated where it lay."""
    import importlib

    run_module = importlib.import_module("mha2mla_exp.runner.run")  # the package re-exports the function `run`
    from mha2mla_exp.runner.trained import TrainedModel

    on_cpu = torch.nn.Linear(2, 2)  # the training copy, wherever the training left it
    monkeypatch.setattr(run_module, "_train", lambda *a, **k: on_cpu)
    loaded = {}

    def load_trained(folder, device):
        loaded.update(folder=folder, device=device)
        return torch.nn.Linear(2, 2, device=device), None

    monkeypatch.setattr(stages, "load_trained", load_trained)
    run_device = torch.device("meta")  # stands for cuda:<local rank>
    dist = SimpleNamespace(is_main_process=True, num_processes=1, device=run_device, wait_for_everyone=lambda: None)
    trained = TrainedModel(tmp_path, "tiny", "abcd1234")
    plan = SimpleNamespace(training=SimpleNamespace(trains=True), config=SimpleNamespace(trained_model_busy="wait"))
    model = run_module._model_for_evaluation(plan, trained, None, None, None, {"timings": {}}, dist, None, None)
    assert model is not on_cpu
    assert loaded == {"folder": trained.model_dir, "device": run_device}
    assert next(model.parameters()).device == run_device
    placed = EvalPlacement.decide(run_device).place(torch.nn.Linear(2, 2))  # what `run` then does to any model
    assert next(placed.parameters()).device == run_device


def test_tf32_on_cuda_only_and_the_decision_recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    cpu = EvalPlacement.decide("cpu", suites_dtype="bfloat16")
    cpu.apply_matmul_precision()
    assert calls == []
    gpu = EvalPlacement.decide("cuda:1", suites_dtype="bfloat16")
    gpu.apply_matmul_precision()
    assert calls == ["high"]
    assert gpu.to_record() == {
        "device": "cuda:1",
        "dtype": {"weights": "float32", "perplexity": "float32", "kv_measure": "float32", "suites": "bfloat16"},
        "rotary_inv_freq": "float32",
        "tf32": True,
    }
    assert cpu.to_record()["tf32"] is False and cpu.to_record()["rotary_inv_freq"] == "cast with the weights"


def test_cpu_evaluations_are_cast_as_the_committed_records_were():
    """On CPU nothing moves: fp32 suites leave the model untouched, bf16 suites cast it whole (inv_freq with it),
    as `model.to(bf16)` did for the committed bf16-suite records."""
    from mha2mla_exp.models import build_random_model

    model, _ = build_random_model(TINY_BYTE_LM)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    EvalPlacement.decide("cpu", suites_dtype="float32").place(model, "suites")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    reference, _ = build_random_model(TINY_BYTE_LM)
    reference.to(torch.bfloat16)
    EvalPlacement.decide("cpu", suites_dtype="bfloat16").place(model, "suites")
    for (name, ours), (_, theirs) in zip(model.named_buffers(), reference.named_buffers()):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_an_unknown_stage_or_dtype_is_refused():
    placement = EvalPlacement.decide("cpu", suites_dtype="bfloat16")
    with pytest.raises(ValueError, match="stage"):
        placement.dtype_for("generation")
    with pytest.raises(ValueError, match="dtype"):
        EvalPlacement.decide("cpu", suites_dtype="fp8")
