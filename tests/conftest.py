"""Shared fixtures (tiny random Llama-family models for mechanics tests, the one-process reference run) and how the
suite is spread over pytest-xdist's workers (docs/TESTING.md)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


MAX_WORKERS = 4  # each worker holds torch and, in the real-model tests, a model: a few GB


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """One worker a core. A spare worker (3 on 2 cores) was faster with the assets cached (810 s against 855 s) but
    slower from a fresh clone, the time CI pays (914-951 s against 872 s; docs/TESTING.md)."""
    return min(_cores(), MAX_WORKERS)


# Tests that share a session fixture (the one-process reference run; the memoized compositions) run on one worker.
SHARED_GROUPS = {
    "test_fsdp_memory": "test_distributed",
    "test_experiments": "test_configs",
}


def file_group(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the file it shares a session fixture with (SHARED_GROUPS)."""
    stem = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    return SHARED_GROUPS.get(stem, stem)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (pyproject.toml) with file_group as the scope: each unit's module and session fixtures
    are built once, on one worker. Not `--dist loadgroup` with `xdist_group` marks: xdist passes the group on by
    rewriting node ids, which pytest 9.2's structured ids ignore, silently (pytest-xdist issue 1386)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return file_group(nodeid)

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Units holding a test marked `slow` are handed out first (`--no-loadscope-reorder` keeps this order), so that
    no worker is left running one while the other idles at the end."""
    slow = {file_group(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: file_group(item.nodeid) not in slow)  # stable: collection order otherwise


def pytest_configure(config):
    """Under pytest-xdist (`-n auto`, pyproject.toml) the workers share the cores: each takes its part of them, so
    that two workers on two cores do not run two torch threads each, and its subprocesses (torchrun launches,
    module runs) inherit that share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, _cores() // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def bf16_untimed(hidden_size: int, intermediate_size: int) -> tuple[bool, str]:
    """`validate(..., bf16_pays=bf16_untimed)`: `train.precision=auto` planned as on a CPU where bf16 does not pay,
    for tests about what a config composes and validates to, not about this CPU's bf16 speed (the real probe times
    matmuls at the model's shape: 21 s for Llama-2-7B's on one thread)."""
    return False, "pinned by the test: bf16 does not pay"


@pytest.fixture
def bf16_not_timed(monkeypatch):
    """bf16_untimed for runs the test starts in-process (`run`, a dry run): the probe answers without timing."""
    monkeypatch.setattr(
        "mha2mla_exp.train.precision.cpu_bf16_speedup", lambda *a, **k: (1.0, "pinned by the test: not timed")
    )


def tiny_causal_lm(kind: str = "gqa", *, seed: int = 0, layers: int = 2, tie: bool = False):
    """A float32 random model: 'mha' (4 heads), 'gqa' (4 query / 2 KV heads), 'qwen2' (GQA with q/k/v biases)
    or 'mistral' (GQA). head_dim 16, hidden 64."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4 if kind == "mha" else 2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    if kind in ("mha", "gqa"):
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random init zeroes biases; make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(kind)
    return model.eval()


@pytest.fixture(params=["mha", "gqa", "qwen2"])
def tiny_model(request):
    return tiny_causal_lm(request.param)


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2, 24), generator=g)


def tiny_byte_lm():
    """The model section of a tiny random Llama with the byte-level tokenizer."""
    from mha2mla_exp.schema.sections import ModelConfig, ShapeConfig

    shape = ShapeConfig(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rope_base=10000, context_length=512
    )
    return ModelConfig(
        name="tiny-random", source="random", dtype="float32", shape=shape, vocab_size=320, intermediate_size=128, seed=0
    )


TINY_BYTE_LM = tiny_byte_lm()


@pytest.fixture(scope="module")
def tiny():
    """(model, byte tokenizer): a tiny random Llama with a real tokenizer, for the evaluation tests;
    one thread, so that lm-eval's batching is deterministic."""
    from mha2mla_exp.models import build_random_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = build_random_model(TINY_BYTE_LM)
    yield model.eval(), tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """The tiny launched run (tests/launches.py) on one process, 4 rows x 2 accumulations a step: the reference the
    multi-process, FSDP and resume tests compare their losses with. (record, curve)"""
    from tests.launches import launch, only_record

    out = tmp_path_factory.mktemp("one")
    result = launch(out, 1, "train.micro_batch_size=4", "train.grad_accum=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return only_record(out)
