"""The training-precision benchmark's measurement and its page, on the tiny model (the real one runs in results/)."""

from __future__ import annotations

from mha2mla_exp.bench import train_precision
from tests.conftest import tiny_causal_lm


def test_throughput_times_every_mode_after_warm_up(tmp_path):
    table = train_precision.measure_throughput(
        tiny_causal_lm("gqa"), warmup=1, steps=2, modes=["fp32", "bf16-master"], compile_options=[False],
        recipe={"seq_len": 16, "micro_batch_size": 2, "grad_accum": 1})
    assert list(table["mode"]) == ["fp32", "bf16-master"]
    assert (table["timed_steps"] == 2).all() and (table["tokens_per_s"] > 0).all()
    assert table.loc[0, "speedup_vs_fp32"] == 1.0
    table.to_csv(tmp_path / "throughput.csv", index=False)
    (tmp_path / "machine.json").write_text(
        '{"cpu": {"model": "X", "bf16_flags": []}, "matmul_bf16_over_fp32": 1.0, "matmul_probe": "p"}')
    train_precision.write_readme(tmp_path)
    page = (tmp_path / "README.md").read_text()
    assert "## Tokens per second" in page and "bf16-master" in page and "Recovery" not in page
