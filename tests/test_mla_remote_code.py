"""A saved MLA folder carries its own modeling code and `auto_map`: a fresh interpreter without this package
(and without triton) loads it with `trust_remote_code=True`, with equal logits, the latent cache and absorbed
decoding, and lm-eval's `--model hf` runs on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import convert_to_mla

HERE = Path(__file__).resolve().parent


def load_in_fresh_interpreter(folder: Path, ids: torch.Tensor, tmp_path: Path) -> dict:
    torch.save(ids, tmp_path / "ids.pt")
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH=""
    )  # nothing but site-packages: the package is blocked anyway
    proc = subprocess.run(
        [sys.executable, str(HERE / "remote_load.py"), str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")


@torch.no_grad()
def greedy(model, ids, absorb: bool) -> torch.Tensor:
    model.set_absorb(absorb)
    out = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    model.set_absorb(False)
    return out


@torch.no_grad()
@pytest.mark.parametrize(
    "spec",
    [
        dict(rope="2-norm", r=3, svd="joint", d_kv=6),
        dict(rope="rorope", r=3, svd="none"),  # shared rope key, k_up without v_up
        dict(rope="rorope", r=2, svd="joint", d_kv=6, init="output", allocation="global"),
    ],
    ids=["2-norm-joint", "rorope-none", "rorope-joint-output-global"],
)
def test_saved_folder_loads_without_the_package(tmp_path, tokens, spec):
    model = tiny_causal_lm("qwen2")  # q/k/v biases
    mla = convert_to_mla(model, **spec, calibration=[tokens])
    folder = tmp_path / "mla"
    mla.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration.MLAConfig",
        "AutoModelForCausalLM": "modeling.MLAForCausalLM",
    }
    assert {"modeling.py", "configuration.py", "cache.py", "decode_dispatch.py"} <= {p.name for p in folder.iterdir()}

    out = load_in_fresh_interpreter(folder, tokens, tmp_path)
    assert out["class"].startswith("transformers_modules.") and out["class"].endswith(".modeling.MLAForCausalLM")
    assert (out["logits"] - mla(tokens).logits).abs().max().item() == 0
    assert out["cache"] == "LatentCache"
    expected = greedy(mla, tokens, absorb=False)
    assert torch.equal(out["greedy_absorb=False"], expected)
    assert torch.equal(out["greedy_absorb=True"], greedy(mla, tokens, absorb=True))


@pytest.fixture
def _offline_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_EVAL_TASKS", str(tmp_path / "eval_tasks"))


def test_lm_eval_hf_runs_on_the_saved_folder_without_the_package(tiny, tmp_path, _offline_tasks):
    model, tokenizer = tiny
    lm_eval_matches_ours(convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=4), tokenizer, tmp_path)


def lm_eval_matches_ours(mla, tokenizer, tmp_path: Path) -> None:
    """lm-eval's `--model hf` on the saved folder, in an interpreter without this package, scores two offline
    tasks exactly as our own evaluation of `mla` does."""
    from mha2mla_exp.evaluation.commonsense import CommonsenseConfig, evaluate_commonsense, task_names
    from mha2mla_exp.evaluation.fixtures import commonsense_tree
    from mha2mla_exp.evaluation.lm import EvalLM
    from mha2mla_exp.evaluation.tasks import sample_indices
    from mha2mla_exp.schema.commonsense_suite import suite

    cfg = CommonsenseConfig(
        limit=6,
        sample="random",
        seed=3,
        tasks=("piqa", "arc_easy"),
        batch_size=4,
        data_root=str(commonsense_tree(tmp_path / "hf_datasets", n=12, subjects=("anatomy",))),
    )
    ours, meta, _ = evaluate_commonsense(EvalLM(mla, tokenizer, batch_size=4), cfg)

    folder = tmp_path / "mla"
    mla.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tasks = [n for c in cfg.tasks for n in task_names(c, True, ())]
    samples = {n: sample_indices(12, 6, "random", 3) for n in tasks}
    argv = [
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={folder},trust_remote_code=True,dtype=float32",
        "--device",
        "cpu",
        "--tasks",
        *tasks,
        "--include_path",
        meta["task_dir"],
        "--samples",
        json.dumps(samples),
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "out"),
    ]
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import remote_load; remote_load.install_block(); "
        f"sys.argv = {argv!r}; from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    for column in cfg.tasks:
        task, metric = suite()[column].task, suite()[column].metric
        assert results[f"offline_{task}"][f"{metric},none"] == pytest.approx(ours[column], abs=1e-12), column


@pytest.mark.integration
@torch.no_grad()
def test_real_smollm2_conversion_loads_without_the_package(tmp_path):
    from mha2mla_exp.models import load_model
    from mha2mla_exp.schema.sections import ModelConfig

    model, tokenizer = load_model(
        ModelConfig(source="asset", id="smollm2-135m", name="smollm2-135m", dtype="float32"), device="cpu"
    )
    mla = convert_to_mla(model, rope="uniform", r=4, svd="joint", d_kv=16)
    folder = tmp_path / "mla"
    mla.save_pretrained(folder)
    ids = tokenizer("Gentlemen of the Congress, the state of the Union is sound.", return_tensors="pt").input_ids
    out = load_in_fresh_interpreter(folder, ids, tmp_path)
    diff = (out["logits"] - mla(ids).logits).abs().max().item()
    print(f"\n[smollm2-135m uniform r=4 joint d_kv=16, loaded without the package] max |dlogit| {diff:.2e}")
    assert diff <= 1e-5
    assert out["cache"] == "LatentCache"
    assert torch.equal(out["greedy_absorb=False"], greedy(mla, ids, absorb=False))
    assert torch.equal(out["greedy_absorb=True"], greedy(mla, ids, absorb=True))
