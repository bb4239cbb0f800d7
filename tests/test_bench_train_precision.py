"""The training-precision benchmark's measurement and its page, on the tiny model (the real one runs in results/)."""

from __future__ import annotations

import pandas as pd
import pytest

from mha2mla_exp.bench import train_precision, train_profile
from tests.conftest import tiny_causal_lm


def test_throughput_times_every_mode_after_warm_up(tmp_path):
    table = train_precision.measure_throughput(
        tiny_causal_lm("gqa"),
        warmup=1,
        steps=2,
        modes=["fp32", "bf16-master"],
        compile_options=[False],
        recipe={"seq_len": 16, "micro_batch_size": 2, "grad_accum": 1},
        variants=("plain", "fast"),
    )
    assert list(table["mode"]) == ["fp32", "bf16-master"] * 2
    assert list(table["variant"]) == ["plain", "plain", "fast", "fast"]
    assert (table["timed_steps"] == 2).all() and (table["tokens_per_s"] > 0).all()
    assert table.loc[0, "speedup_vs_fp32"] == 1.0
    train_precision.merge_rows(
        tmp_path / "throughput.csv", table.assign(machine="machine A"), ["machine", "mode", "variant"]
    )
    again = table.assign(machine="machine B", tokens_per_s=1.0)
    merged = train_precision.merge_rows(tmp_path / "throughput.csv", again, ["machine", "mode", "variant"])
    assert len(merged) == 8 and set(merged["machine"]) == {"machine A", "machine B"}  # other machines' rows stay
    merged = train_precision.merge_rows(tmp_path / "throughput.csv", again.iloc[:1], ["machine", "mode", "variant"])
    assert len(merged) == 8  # a re-measurement replaces its own row
    (tmp_path / "machine.json").write_text(
        '{"machine A": {"cpu": {"model": "X", "bf16_flags": []}, '
        '"matmul_bf16_over_fp32": 1.0, "matmul_probe": "p", "torch": "t", "threads": 2}}'
    )
    train_precision.write_readme(tmp_path)
    page = (tmp_path / "README.md").read_text()
    assert "## Tokens per second" in page and "### machine B" in page and "bf16-master" in page
    assert "Recovery" not in page


@pytest.mark.parametrize("variant", ["plain", "fast"])
def test_profile_splits_one_step_by_kind_and_phase(variant):
    row, top = train_profile.profile_step(
        tiny_causal_lm("gqa"), "fp32", variant, micro_batch_size=2, grad_accum=2, seq_len=16
    )
    assert row["tokens_per_step"] == 64 and row["step_s"] > 0
    kinds = [row[f"{kind}_share"] for kind in [*train_profile.KINDS, "other"]]
    phases = [row[f"{phase}_share"] for phase in [*train_profile.PHASES, "outside"]]
    assert sum(kinds) == pytest.approx(1.0, abs=0.01) and sum(phases) == pytest.approx(1.0, abs=0.01)
    assert row["matmul_share"] > 0 and row["forward_share"] > 0 and row["backward_share"] > 0
    assert row["optimizer_share"] > 0 and row["teacher_share"] == 0  # ce: no teacher
    assert row["loss_share"] > 0  # the log-softmax, whole or by chunks
    assert list(top["self_s"]) == sorted(top["self_s"], reverse=True) and len(top) <= train_profile.TOP_OPS
    assert isinstance(top, pd.DataFrame) and top["share"].sum() <= 1.0
