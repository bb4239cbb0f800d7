"""A run survives a SIGKILL at each of its write points, and two launches of one setting at once make one record.

The run: a 4-step fine-tune of the tiny random model with a checkpoint after every step, so each step of the
checkpoint swap is met. One uninterrupted launch is the reference (it runs beside two concurrent launches of the
same setting: one record, every process exits cleanly). Then a second results folder lives the same run as a chain
of launches, each killed by `MHA2MLA_FAULT` (mha2mla_exp/faults.py) at the next write point of the run's life and
relaunched by the next: the chain must end with the reference's record (steps, losses, perplexities), every curve
line, the reference's files exactly, and no file outside its results folder changed. Launches are forked from a
server that imported everything once (multiprocessing's forkserver), so the whole suite takes well under two minutes.
docs/RELIABILITY.md reports these figures.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from mha2mla_exp.faults import FAULT_ENV
from mha2mla_exp.runner.ranks import SLOW_EVAL_ENV
from tests.launches import COMMON

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = [o for o in COMMON if not o.startswith(("train.tokens=", "train.checkpoint_every="))] + [
    "train.tokens=1024",  # 4 steps of 8 rows x 32 tokens
    "train.checkpoint_every=1",  # checkpoints after steps 1, 2, 3: the swap's every step is met
    "train.log_every=1",
    "eval.perplexity.max_batches=1",
    # and one lm-eval suite, so the per-document samples file is written too: one passkey, one long document
    "model.finetune_length=320",  # the evaluation window the passkey prompt fits in
    "eval.long_context.enabled=true",
    "eval.long_context.lengths=[320]",
    "eval.long_context.depths=[0.5]",
    "eval.long_context.samples_per_depth=1",
    "eval.long_context.ppl_lengths=[128]",
    "eval.long_context.ppl_docs=1",
    "eval.long_context.max_gen_toks=6",
    "data.seq_len=64",  # held-out rows (the probes, the perplexity) of 64 tokens: a tenth of the cost
]
# the write points of one run's life, in the order a run meets them; each launch of the chain is killed at the
# first passage of its point, the next launch resumes (the comment: where the killed launch stands)
KILL_POINTS = [
    "record.running",  # results.json says running, nothing made yet
    "conversion.kept",  # the kept conversion complete, training not started
    "checkpoint.written",  # step 1's checkpoint.tmp written but for progress.json (incomplete)
    "checkpoint.progress_written",  # step 1's checkpoint.tmp complete, not swapped in
    "checkpoint.moved_aside",  # step 2's swap: checkpoint -> checkpoint.old, no `checkpoint`
    "checkpoint.swapped",  # step 3's swap: checkpoint.tmp -> checkpoint, checkpoint.old not yet removed
    "kept.weights_saved",  # the trained weights renamed into model/, trained.json not written
    "trained.kept",  # trained.json written, the resume checkpoint not yet removed
    "record.model_ready",  # the trained model's curve and record in the run folder, before evaluation
    "eval.written",  # the evaluation and its per-document samples file written, the record not yet
    "record.ok",  # the final record written, the process not yet ended
]
TORN_AFTER = "checkpoint.progress_written"  # the relaunch after it also meets a curve line cut mid-write

_forkserver = multiprocessing.get_context("forkserver")
_forkserver.set_forkserver_preload(
    ["mha2mla_exp.runner", "mha2mla_exp.mla.modeling", "mha2mla_exp.evaluation", "transformers", "lm_eval"]
)


def _launch(overrides: list[str], fault: str | None, outcome: str, env: dict[str, str]) -> None:
    """One launch, as `python -m mha2mla_exp` makes it, in a process forked from the server; its outcome (the
    returned record's status and error) is written to `outcome`."""
    import torch
    from hydra import compose, initialize_config_dir

    from mha2mla_exp.runner import run, run_config

    torch.set_num_threads(1)  # the launches share the cores: no thread pool spinning against another's
    os.environ.pop(FAULT_ENV, None)
    if fault:
        os.environ[FAULT_ENV] = fault
    os.environ.update(env)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    record = run(run_config(cfg))
    Path(outcome).write_text(json.dumps({"status": record["status"], "error": record.get("error")}))


def start(overrides: list[str], outcome: Path, fault: str | None = None, env: dict[str, str] | None = None):
    process = _forkserver.Process(target=_launch, args=(overrides, fault, str(outcome), env or {}))
    process.start()
    return process


def outcome_of(process, outcome: Path, timeout: float = 300) -> tuple[int, dict | None]:
    process.join(timeout)
    assert process.exitcode is not None, f"{outcome.name}: still running after {timeout} s"
    return process.exitcode, json.loads(outcome.read_text()) if outcome.exists() else None


def _launch_cpu_seconds() -> float:
    """CPU seconds of every launch so far (the fork server's reaped children), for docs/RELIABILITY.md."""
    from multiprocessing import forkserver

    stat = Path(f"/proc/{forkserver._forkserver._forkserver_pid}/stat")
    if not stat.exists():  # not Linux
        return float("nan")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def the_record(results_dir: Path) -> tuple[dict, list[dict], Path]:
    [path] = list((results_dir / "default").glob("*/results.json"))
    curve = [json.loads(line) for line in (path.parent / "metrics.jsonl").read_text().splitlines()]
    return json.loads(path.read_text()), curve, path.parent


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, launched three times at once: two that exit when the setting is running, one that
    waits for it (`run_busy=wait`)."""
    root = tmp_path_factory.mktemp("reference")
    overrides = [*TINY_RUN, f"results_dir={root / 'runs'}"]
    modes = {"exit_a": [], "exit_b": [], "wait": ["run_busy=wait"]}
    started = time.perf_counter()
    slow = {SLOW_EVAL_ENV: "2"}  # the run holds its lock 2 s longer: the others surely meet it running
    processes = {name: start([*overrides, *extra], root / f"{name}.json", env=slow) for name, extra in modes.items()}
    ends = {name: outcome_of(p, root / f"{name}.json") for name, p in processes.items()}
    seconds = time.perf_counter() - started
    record, curve, run_dir = the_record(root / "runs")
    return {"ends": ends, "record": record, "curve": curve, "run_dir": run_dir, "root": root / "runs", "s": seconds}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, reference):
    """The same run lived as a chain of launches, each killed at the next write point, then a last launch."""
    root = tmp_path_factory.mktemp("chain")
    results = root / "runs"
    neighbour = results / "other" / "neighbour-run"  # a run of another setting beside it, and a file beside that
    neighbour.mkdir(parents=True)
    (neighbour / "results.json").write_text('{"status": "ok"}\n')
    (root / "notes.txt").write_text("not the run's\n")
    outside = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (neighbour / "results.json", root / "notes.txt")}
    overrides = [*TINY_RUN, f"results_dir={results}"]
    launches = []
    started = time.perf_counter()
    for index, point in enumerate([*KILL_POINTS, None]):
        if launches and launches[-1]["point"] == TORN_AFTER:
            [curve] = results.glob("_trained/*__ft*/metrics.jsonl")
            with curve.open("a") as f:
                f.write('{"step": 2, "tokens": 512, "lo')  # a line cut mid-write, as a kill in append leaves it
        exitcode, outcome = outcome_of(start(overrides, root / f"{index}.json", point), root / f"{index}.json")
        launches.append({"point": point, "exitcode": exitcode, "outcome": outcome})
    seconds = time.perf_counter() - started
    print(f"\nfault suite: reference {reference['s']:.1f} s, chain {seconds:.1f} s; {_launch_cpu_seconds():.1f} CPU-s")
    record, curve, run_dir = the_record(results)
    return {
        "launches": launches,
        "record": record,
        "curve": curve,
        "run_dir": run_dir,
        "results": results,
        "outside": outside,
        "s": seconds,
    }


def test_two_launches_of_a_running_setting_make_one_record_and_both_exit_cleanly(reference):
    ends = reference["ends"]
    assert all(code == 0 for code, _ in ends.values()), ends  # every process exits cleanly
    statuses = {name: outcome["status"] for name, (_, outcome) in ends.items()}
    assert list(statuses.values()).count("ok") >= 1 and reference["record"]["status"] == "ok"
    exits = [statuses["exit_a"], statuses["exit_b"]]
    assert sorted(exits) in (["busy", "ok"], ["busy", "busy"]), statuses  # one ran; the other saw it running
    busy = next(outcome for name, (_, outcome) in ends.items() if outcome["status"] == "busy")
    assert busy["error"].startswith("already running: pid ") and ", host " in busy["error"] and "since" in busy["error"]
    assert statuses["wait"] == "ok"  # it waited for the run and found its record
    assert len(list(reference["root"].glob("default/*/results.json"))) == 1
    assert not reference["record"]["resumed"]  # the waiting launch did not run it a second time


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_at_each_write_point_is_survived_by_the_relaunch(chain, point):
    launches = chain["launches"]
    index = next(i for i, launch in enumerate(launches) if launch["point"] == point)
    killed, relaunch = launches[index], launches[index + 1]
    assert killed["exitcode"] == -signal.SIGKILL and killed["outcome"] is None  # it died at its point
    assert relaunch["exitcode"] in (0, -signal.SIGKILL), relaunch  # it went on (to its own point, or the end)
    assert relaunch["outcome"] is None or relaunch["outcome"]["status"] == "ok"  # never busy: the lock died too


def test_the_chain_ends_with_the_uninterrupted_runs_record(chain, reference):
    assert chain["launches"][-1] == {"point": None, "exitcode": 0, "outcome": {"status": "ok", "error": None}}
    got, want = chain["record"], reference["record"]
    assert got["status"] == "ok" and got["resumed"] is True
    assert got["train"]["steps"] == want["train"]["steps"] == 4
    for key in ("final_loss", "first_loss"):
        assert got["train"][key] == pytest.approx(want["train"][key], abs=1e-5)
    assert got["train"]["heldout_ppl_probe"] == pytest.approx(want["train"]["heldout_ppl_probe"], rel=1e-5)
    assert got["eval"]["perplexity"]["heldout"] == pytest.approx(want["eval"]["perplexity"]["heldout"], rel=1e-5)
    assert got["eval"]["long_context"] == pytest.approx(want["eval"]["long_context"], rel=1e-5)
    assert got["eval"]["meta"]["samples"] == want["eval"]["meta"]["samples"]  # the samples file: same rows
    assert (got["kv"], got["rope_pairs"], got["model"]) == (want["kv"], want["rope_pairs"], want["model"])


def test_every_curve_line_is_kept_once(chain, reference):
    got, want = chain["curve"], reference["curve"]
    assert [line["step"] for line in got] == [line["step"] for line in want] == [0, 1, 2, 3, 4]  # probe, steps
    for a, b in zip(got, want):
        assert a.get("loss") == pytest.approx(b.get("loss"), abs=1e-5)
        assert (a.get("heldout_ppl_probe") is None) == (b.get("heldout_ppl_probe") is None)
        assert a.get("heldout_ppl_probe", 0) == pytest.approx(b.get("heldout_ppl_probe", 0), rel=1e-5)
    [kept_curve] = chain["results"].glob("_trained/*__ft*/metrics.jsonl")
    assert kept_curve.read_text() == (chain["run_dir"] / "metrics.jsonl").read_text()  # the torn line dropped


def test_the_chain_leaves_the_reference_runs_files_and_touches_nothing_else(chain, reference):
    got = files_under(chain["results"]) - {"other/neighbour-run/results.json"}
    assert got == files_under(reference["root"])  # no checkpoint, temp folder or stale note left behind
    for path, (content, mtime) in chain["outside"].items():
        assert (path.read_bytes(), path.stat().st_mtime_ns) == (content, mtime)
