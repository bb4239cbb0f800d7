"""Two processes (torchrun, gloo on CPU) run the same code path a multi-GPU job runs: the same losses as one
process with the same global batch, one record, one metrics line per step, and resume after both ranks are killed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.launches import COMMON, ROOT, app, app_env, launch, only_record

pytestmark = pytest.mark.slow  # each test launches the app two to four times

# `one_process` (tests/conftest.py): the tiny run on one process, 4 rows x 2 accumulations a step, made once a session


def test_two_processes_give_the_one_process_losses(one_process, tmp_path):
    result = launch(tmp_path, 2, "train.micro_batch_size=4", "train.grad_accum=1")  # same 8 rows per step
    assert result.returncode == 0, result.stderr[-3000:]
    (single, single_curve), (double, double_curve) = one_process, only_record(tmp_path)
    assert double["status"] == single["status"] == "ok"
    assert double["machine"]["processes"] == 2 and single["machine"]["processes"] == 1
    assert double["train"]["steps"] == single["train"]["steps"] == 4096 // (32 * 8)
    losses = {row["step"]: row["loss"] for row in single_curve if "loss" in row}
    assert [row["step"] for row in double_curve] == [0, *range(1, single["train"]["steps"] + 1)]  # one line a step
    for row in double_curve[1:]:
        assert row["loss"] == pytest.approx(losses[row["step"]], abs=2e-5)
    assert double["eval"]["perplexity"]["heldout"] == pytest.approx(single["eval"]["perplexity"]["heldout"], rel=1e-4)
    assert result.stdout.count("[mha2mla_exp] ok:") == 1  # one process reports, one record is written


def test_both_ranks_killed_mid_run_resume_to_the_same_losses(one_process, tmp_path):
    killed = launch(tmp_path, 2, "train.micro_batch_size=4", "train.grad_accum=1", env={"MHA2MLA_KILL_AT_STEP": "7"})
    assert killed.returncode != 0
    [progress] = list((tmp_path / "_trained").glob("*/checkpoint/progress.json"))
    assert json.loads(progress.read_text())["step"] == 6  # the last checkpoint before the kill
    record, _ = only_record(tmp_path)
    assert record["status"] == "running"  # a hard kill leaves no chance to write anything else

    resumed = launch(tmp_path, 2, "train.micro_batch_size=4", "train.grad_accum=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (single, single_curve), (record, curve) = one_process, only_record(tmp_path)
    assert record["status"] == "ok" and record["resumed"] is True
    assert [row["step"] for row in curve] == [0, *range(1, single["train"]["steps"] + 1)]  # no duplicate lines
    losses = {row["step"]: row["loss"] for row in single_curve if "loss" in row}
    for row in curve[1:]:
        assert row["loss"] == pytest.approx(losses[row["step"]], abs=2e-5)


def test_a_slurm_cell_with_two_tasks_trains_as_two_processes(one_process, tmp_path):
    # submitit's local executor runs the SLURM launcher's code: one cell, tasks_per_node=2, each task a rank
    result = subprocess.run(
        [
            *app(1),
            "-m",
            *COMMON,
            "train.micro_batch_size=4",
            "train.grad_accum=1",
            f"results_dir={tmp_path}",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
        ],
        cwd=ROOT,
        env=app_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (single, single_curve), (record, curve) = one_process, only_record(tmp_path)
    assert record["status"] == "ok" and record["machine"]["processes"] == 2
    assert [row["step"] for row in curve] == [row["step"] for row in single_curve]
    assert record["train"]["final_loss"] == pytest.approx(single["train"]["final_loss"], abs=2e-5)


def test_a_sweep_under_torchrun_outlasts_an_evaluation_longer_than_the_collective_timeout(tmp_path):
    # the main process spends 20 s more on each cell's evaluation, longer than collectives may wait (15 s): the other
    # process must wait for it at the end of the cell, not in the next cell's first collective
    result = subprocess.run(
        [
            *app(2),
            "-m",
            *COMMON,
            "train.tokens=1024",
            "train.micro_batch_size=4",
            "train.grad_accum=1",
            "distributed.timeout_s=15",
            "seed=0,1",
            f"results_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=app_env(MHA2MLA_SLOW_EVAL_S="20"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "default").glob("*/results.json")]
    assert sorted(r["status"] for r in records) == ["ok", "ok"]
    assert sorted(r["trained_hash"] for r in records)[0] != sorted(r["trained_hash"] for r in records)[1]
    assert all(r["machine"]["processes"] == 2 for r in records)


def test_processes_that_would_time_bf16_differently_train_in_the_main_ones_precision(tmp_path):
    # each rank's probe is made to disagree (rank 0: bf16 pays, rank 1: it does not): one verdict must win
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "from mha2mla_exp.train import precision\n"
        "speed = 4.6 if os.environ.get('RANK', '0') == '0' else 0.5\n"
        "precision.cpu_bf16_speedup = lambda *a: (speed, f'faked on rank {os.environ.get(\"RANK\")}')\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = launch(
        tmp_path / "runs",
        2,
        "train.precision=auto",
        "train.tokens=1024",
        "train.micro_batch_size=4",
        "train.grad_accum=1",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [path] = list((tmp_path / "runs" / "default").glob("*/results.json"))
    record = json.loads(path.read_text())
    assert record["status"] == "ok" and record["machine"]["processes"] == 2
    assert record["train"]["precision"]["mode"] == "bf16-autocast"
    assert "faked on rank 0" in record["train"]["precision"]["reason"]
    assert "measured by the main process" in record["train"]["precision"]["reason"]
    # both ranks computed in bf16: the losses are one process's in bf16-autocast (a rank left in fp32 moves them)
    reference = launch(
        tmp_path / "one",
        1,
        "train.precision=bf16-autocast",
        "train.tokens=1024",
        "train.micro_batch_size=4",
        "train.grad_accum=2",
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    [one] = list((tmp_path / "one" / "default").glob("*/metrics.jsonl"))
    expected = {r["step"]: r["loss"] for r in map(json.loads, one.read_text().splitlines()) if "loss" in r}
    got = {
        r["step"]: r["loss"]
        for r in map(json.loads, (path.parent / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    assert sorted(got) == sorted(expected)
    # step 1 starts from the same weights: only the precision can move it (fp32 against bf16 is ~2e-5 here)
    assert got[1] == pytest.approx(expected[1], abs=2e-6)
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], abs=1e-4)


def test_fsdp_on_two_processes_gives_the_one_process_losses_and_a_model_that_loads(one_process, tmp_path):
    result = launch(tmp_path, 2, "train.micro_batch_size=4", "train.grad_accum=1", "train.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    (single, single_curve), (sharded, curve) = one_process, only_record(tmp_path)
    assert sharded["status"] == "ok" and sharded["train"]["strategy"] == "fsdp"
    losses = {row["step"]: row["loss"] for row in single_curve if "loss" in row}
    assert [row["step"] for row in curve] == [0, *range(1, single["train"]["steps"] + 1)]
    for row in curve[1:]:
        assert row["loss"] == pytest.approx(losses[row["step"]], abs=1e-4)
    # the kept model (gathered from the shards, saved by the main process) is the one evaluated: a relaunch with
    # another evaluation loads it and scores the same held-out rows the same
    reloaded = launch(tmp_path, 1, "train.micro_batch_size=4", "train.grad_accum=2", "kv_measure_tokens=32")
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "default").glob("*/results.json")]
    again = next(r for r in records if r["run_name"] != sharded["run_name"])
    assert again["reused_trained_model"] is True
    assert again["eval"]["perplexity"]["heldout"] == pytest.approx(sharded["eval"]["perplexity"]["heldout"], rel=1e-5)
    assert sharded["eval"]["perplexity"]["heldout"] == pytest.approx(single["eval"]["perplexity"]["heldout"], rel=1e-3)


def test_fsdp_ranks_killed_mid_run_resume_to_the_same_losses(one_process, tmp_path):
    fsdp = ["train.micro_batch_size=4", "train.grad_accum=1", "train.strategy=fsdp"]
    killed = launch(tmp_path, 2, *fsdp, env={"MHA2MLA_KILL_AT_STEP": "7"})
    assert killed.returncode != 0
    resumed = launch(tmp_path, 2, *fsdp)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (_, single_curve), (record, curve) = one_process, only_record(tmp_path)
    assert record["train"]["resumed_from_step"] == 6
    losses = {row["step"]: row["loss"] for row in single_curve if "loss" in row}
    for row in curve[1:]:
        assert row["loss"] == pytest.approx(losses[row["step"]], abs=1e-4)


def test_a_stream_read_by_the_main_process_alone_gives_two_processes_the_one_process_losses(tmp_path):
    import random

    rng = random.Random(0)
    words = ["union", "state", "congress", "nation", "peace", "law", "trade", "people", "year", "the", "of"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))}) + "\n"
            for _ in range(600)
        )
    )
    mixture = f'[{{name: toy, path: json, data_files: "{corpus}", weight: 1.0, text_field: text}}]'
    streamed = [o for o in COMMON if not o.startswith("data.max_documents")] + [
        "data=smollm_corpus",
        f"data.mixture={mixture}",
        "data.held_out_documents=40",
        "data.seq_len=32",
        "data.shuffle_rows=16",
    ]

    site = tmp_path / "site"  # rank 1 may not read the training stream at all: its rows come from rank 0
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from mha2mla_exp.data import stream\n"
        "    def refuse(self, *a):\n"
        "        raise AssertionError('rank 1 read the training stream')\n"
        "    stream.TrainStream.step_rows = refuse\n"
    )

    def curve_of(out, processes, accumulation):
        path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
        result = subprocess.run(
            [*app(processes), *streamed, "train.micro_batch_size=4", f"train.grad_accum={accumulation}"]
            + [f"results_dir={out}"],
            cwd=ROOT,
            env=app_env(PYTHONPATH=path),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        record, metrics = only_record(out)
        assert record["data"]["streamed"] is True
        return {row["step"]: row["loss"] for row in metrics if "loss" in row}

    one, two = curve_of(tmp_path / "one", 1, 2), curve_of(tmp_path / "two", 2, 1)
    assert sorted(two) == sorted(one) and len(one) == 4096 // (32 * 8)
    for step, loss in two.items():
        assert loss == pytest.approx(one[step], abs=2e-5)
