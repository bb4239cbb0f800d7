"""The inference benchmark runs end to end on a tiny shape and measures the cache bytes the formulas
predict (MLA: L*n_kv*(2r+d_kv) elements per token; MHA: L*2*n_kv*d_h)."""

from __future__ import annotations

import csv
import json

import pytest

from mha2mla_exp.bench import decode
from mha2mla_exp.bench.__main__ import main
from mha2mla_exp.bench.shapes import SHAPES


def read(path):
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # a budget (340 kB) that fits MLA everywhere but not MHA at batch 2 / context 24
    rc = main(
        [
            "--shapes",
            "tiny",
            "--batches",
            "1,2",
            "--contexts",
            "16,24",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--attention-batches",
            "1",
            "--attention-contexts",
            "32",
            "--mem-budget-gib",
            "0.000317",
            "--attention-budget-gib",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    return out


def test_writes_results(bench_out):
    for name in ("decode.csv", "capacity.csv", "attention.csv", "bench.png", "machine.json"):
        assert (bench_out / name).stat().st_size > 0, name
    machine = json.loads((bench_out / "machine.json").read_text())
    assert {"cpu", "cpu_cores", "torch", "device", "command"} <= set(machine)


def test_measured_bytes_per_token_equal_formula(bench_out):
    s = SHAPES["tiny"]
    expected = {
        "mha": s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4,
        "mla": s.num_layers * s.num_kv_heads * (2 * s.r + s.d_kv) * 4,
        "mla_absorbed": s.num_layers * s.num_kv_heads * (2 * s.r + s.d_kv) * 4,
    }
    capacity = {row["variant"]: row for row in read(bench_out / "capacity.csv")}
    assert set(capacity) == set(expected)
    for variant, nbytes in expected.items():
        assert float(capacity[variant]["kv_bytes_per_token"]) == nbytes
    for row in read(bench_out / "decode.csv"):
        assert float(row["kv_bytes_per_token"]) == expected[row["variant"]]
        if row["status"] == "ok":  # the filled cache holds exactly batch x context tokens' worth
            assert int(row["cache_bytes"]) == expected[row["variant"]] * int(row["batch"]) * int(row["context"])


def test_decode_rows_timed_or_skipped(bench_out):
    rows = read(bench_out / "decode.csv")
    assert {(r["variant"], r["batch"], r["context"]) for r in rows} == {
        (v, b, c) for v in ("mha", "mla", "mla_absorbed") for b in ("1", "2") for c in ("16", "24")
    }
    skipped = {(r["variant"], r["batch"], r["context"]) for r in rows if r["status"].startswith("skipped")}
    assert skipped == {("mha", "2", "24")}
    for r in rows:
        if r["status"] == "ok":
            assert float(r["step_s_min"]) <= float(r["step_s_median"]) <= float(r["step_s_max"])
            assert float(r["tokens_per_s"]) > 0 and int(r["peak_mem_bytes"]) > int(r["cache_bytes"])


def test_attention_rows_carry_the_bound(bench_out):
    rows = [r for r in read(bench_out / "attention.csv") if r["status"] == "ok"]
    assert {r["variant"] for r in rows} >= {"mha_sdpa", "absorbed_plain"}
    for r in rows:
        assert float(r["bound"]) == 8.0  # 2*128/(2*8+16)
        assert int(r["bytes_read"]) == (2 * 32 * 32 * 128 * 4 if r["variant"] == "mha_sdpa" else 32 * 1024 * 4)


def test_capacity_from_budget():
    assert decode.capacity_tokens(weights=1000, kv_bytes_per_token=10.0, budget=2000) == 100
    assert decode.capacity_tokens(weights=3000, kv_bytes_per_token=10.0, budget=2000) == 0
    assert decode.fits(1000, 10.0, 4, 10, budget=2000) and not decode.fits(1000, 10.0, 5, 10, budget=2000)


@pytest.mark.parametrize("convert_layers", ["all", "global"])
def test_decode_is_timed_on_a_windowed_model_past_its_window_with_the_windowed_cache(convert_layers):
    """A Gemma-3-like model (sliding window 16) at a context past the window: the filled cache holds what the
    formula says (windows counted, unconverted layers as keys and values), and the timed steps run on it (a full
    sliding layer cannot be rolled back after each step unless it records the past)."""
    import torch

    from mha2mla_exp.bench.family_models import tiny_family_lm
    from mha2mla_exp.mla import (
        MLASpec,
        ModelShape,
        attention_windows,
        cache_elements_per_sequence,
        convert_to_mla,
        kernels,
    )

    original = tiny_family_lm("gemma3_text", sliding_window=16, max_position_embeddings=512)
    mla = convert_to_mla(original, rope="high", r=2, svd="joint", d_kv=6, convert_layers=convert_layers)
    shape, windows = ModelShape.from_config(original.config), attention_windows(original.config)
    context, cpu = 48, torch.device("cpu")
    try:
        for variant, spec in (
            (decode.Variant("mha", original), None),
            (decode.Variant("mla_absorbed", mla, absorb=True), MLASpec.recorded(mla.config.mla)),
        ):
            row = decode.time_decode(variant, 2, context, cpu, torch.float32, warmup=1, repeats=2)
            assert row["cache_bytes"] == 2 * 4 * cache_elements_per_sequence(shape, windows, context, spec)["total"]
            assert row["step_s_median"] > 0
    finally:
        kernels.set_backend("auto")  # a variant sets the process's kernel backend; the bench's main resets it too
