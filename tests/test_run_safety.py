"""What keeps a run's files its own: names that cannot leave the results folder, the folder lock (a live holder
reported, a SLURM job's own earlier incarnation waited for), `prune` beside a process that holds a kept model, a
torn curve line, resume without unpickling, a local model folder that is never a hub id, a hub model's commit
recorded, and W&B runs counted once by the aggregate."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mha2mla_exp.runner import ConfigError, run, run_config
from mha2mla_exp.runner.lock import FolderBusy, FolderLock
from mha2mla_exp.runner.record import MetricsLog

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train=smoke", "train.precision=fp32", "rope.r=2", "svd.d_kv=8"]


def composed(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=["model=tiny_random", "logger=none", "eval=none", f"results_dir={tmp_path / 'runs'}", *overrides],
        )


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.name=../../../escaped", "model.name"),
        ("model.name=/tmp/absolute", "model.name"),
        ("model.name=org/name", "model.name"),  # a hub id as a name nests folders
        ("experiment=../outside", "experiment"),
        ("experiment=a\\b", "experiment"),
        ("data.tag=../tag", "data.tag"),
        ("data.name=..", "data.name"),
        ("+data@train.data=sotu train.data.tag=x/y", "train.data.tag"),
    ],
)
def test_a_name_that_would_leave_the_results_folder_is_refused_before_loading(tmp_path, override, field):
    if override.startswith("experiment="):  # an experiment file's `experiment:` (the CLI's `experiment` is the group)
        cfg = composed(tmp_path)
        cfg.experiment = override.partition("=")[2]
    else:
        cfg = composed(tmp_path, *override.split())
    with pytest.raises(ConfigError, match=f"{field.replace('.', '[.]')}: must be a plain name"):
        run(run_config(cfg))
    assert list(tmp_path.iterdir()) == []  # nothing written, anywhere


def test_a_live_holder_is_named_and_its_lock_is_not_taken(tmp_path):
    holder = FolderLock(tmp_path / "run")
    holder.acquire(wait=False)
    try:
        with pytest.raises(FolderBusy, match=r"already running: pid \d+, host .+, since 20"):
            FolderLock(tmp_path / "run").acquire(wait=False)
    finally:
        holder.release()
    assert FolderLock(tmp_path / "run").try_acquire()  # released: the next launch takes it


def test_a_requeued_slurm_job_waits_for_its_own_earlier_lock_instead_of_reporting_busy(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    held = threading.Event()

    def earlier_incarnation():  # what a network file system's lease still holds after the node died, then lets go
        lock = FolderLock(tmp_path / "run")
        lock.acquire(wait=False)
        held.set()
        time.sleep(0.5)
        lock.release()

    threading.Thread(target=earlier_incarnation).start()
    held.wait()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued job
    started = time.perf_counter()
    requeued = FolderLock(tmp_path / "run")
    requeued.acquire(wait=False)
    assert time.perf_counter() - started >= 0.4 and requeued.holder()["slurm_restart"] == 1
    monkeypatch.setenv("SLURM_JOB_ID", "999")  # another job: told busy at once, not made to wait
    with pytest.raises(FolderBusy, match="SLURM job 4242"):
        FolderLock(tmp_path / "run").acquire(wait=False)
    requeued.release()


def test_prune_skips_a_model_another_process_holds(tmp_path, capsys):
    from mha2mla_exp.runner.trained import main

    folder = tmp_path / "_trained" / "m-abc"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.safetensors").write_bytes(b"weights")
    (folder / "trained.json").write_text("{}")
    with FolderLock(folder):  # a run reusing (or making) it
        assert main(["prune", "m-abc", "--results-dir", str(tmp_path)]) == 1
    assert (folder / "model" / "model.safetensors").read_bytes() == b"weights"
    assert "skipped m-abc: in use (pid" in capsys.readouterr().out
    assert main(["prune", "m-abc", "--results-dir", str(tmp_path)]) == 0  # free: pruned
    assert not (folder / "model").exists() and (folder / "trained.json").exists()


def test_a_curve_line_cut_by_a_crash_is_dropped_and_a_damaged_one_is_refused(tmp_path, caplog):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.append({"step": step, "loss": 1.0 / step})
    with log.path.open("a") as f:
        f.write('{"step": 4, "lo')
    log.truncate_after(2)
    assert [row["step"] for row in log.read()] == [1, 2] and "cut by a crash" in caplog.text
    log.path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        log.truncate_after(5)


def test_a_checkpoint_holds_no_pickle_resume_would_load(tmp_path):
    """bf16-master's optimizer and fp32 copies and the lr schedule are plain tensors or JSON, read weights-only."""
    import torch

    from mha2mla_exp.train import FineTuneRecipe, precision_for
    from tests.conftest import tiny_causal_lm
    from tests.test_train_recipe import rows, train_cfg

    def recipe():
        made = FineTuneRecipe(
            tiny_causal_lm("gqa"), rows(), train_cfg(), tmp_path, precision=precision_for("bf16-master", "cpu"), seed=0
        )
        made.setup()
        return made

    trained = recipe()
    trained.step()
    trained.checkpoint(1.0)
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert not [name for name in saved if name.startswith("custom_checkpoint")], saved
    progress = json.loads((tmp_path / "checkpoint" / "progress.json").read_text())
    assert progress["scheduler"]["last_epoch"] == 1
    for name in ("optimizer.pt", "master_weights.pt"):
        torch.load(tmp_path / "checkpoint" / name, weights_only=True)  # plain state dicts
    resumed = recipe()
    resumed.resume()
    assert resumed.step_count == 1 and resumed.scheduler.state_dict() == trained.scheduler.state_dict()
    assert torch.equal(resumed.master.master[0], trained.master.master[0])
    assert resumed.optimizer.state_dict()["state"][0]["step"] == trained.optimizer.state_dict()["state"][0]["step"]


def test_a_local_folder_that_does_not_exist_is_an_error_not_a_hub_id(tmp_path):
    from mha2mla_exp.models import model_folder

    with pytest.raises(ValueError, match="does not exist"):
        model_folder(tmp_path / "HuggingFaceTB" / "SmolLM-135M")  # shaped like a hub id, meant as a path
    cfg = composed(tmp_path, "model=local", f"model.id={tmp_path / 'typo'}")
    with pytest.raises(ConfigError, match="model.id: local model folder .* does not exist"):
        run(run_config(cfg))


def test_a_hub_models_commit_is_recorded_and_a_revision_pin_is_part_of_the_identity(tmp_path, monkeypatch):
    import transformers
    import transformers.utils.hub

    from mha2mla_exp.models import build_random_model, load_model
    from mha2mla_exp.runner import stages, validate
    from mha2mla_exp.schema.sections import ModelConfig
    from tests.conftest import TINY_BYTE_LM

    commit = "c0ffee" + "0" * 34
    model, tokenizer = build_random_model(TINY_BYTE_LM)
    asked = []

    class Resolved(str):  # huggingface_hub's ResolvedRevision: the name asked for, the commit it points to
        resolved = commit

    def from_pretrained(made):
        return classmethod(lambda cls, model_id, revision=None, **kw: asked.append(revision) or made)

    monkeypatch.setattr(transformers.utils.hub, "resolve_revision", lambda repo, revision: Resolved(revision or ""))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained(tokenizer))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained(model))
    hub = ModelConfig(name="tiny", source="hub", id="org/tiny", revision="main", dtype="float32")
    loaded, _ = load_model(hub)
    assert asked == [commit, commit]  # tokenizer and weights read at the one commit `main` pointed to
    assert stages.source_commit(hub.source, loaded) == {"hub_commit": commit}
    assert stages.source_commit(TINY_BYTE_LM.source, loaded) == {}

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plans = [
        validate(
            run_config(composed(tmp_path, "model=smollm_135m", "train=none", *pin)),
            bf16_pays=lambda *a: (False, "test"),
        )
        for pin in ([], ["model.revision=" + "b" * 40])
    ]
    identities = [plan.identity for plan in plans]
    assert identities[0].run_hash != identities[1].run_hash and identities[0].setting_hash != identities[1].setting_hash


def test_a_run_on_disk_and_in_wandb_is_one_setting_for_the_aggregate(tmp_path, monkeypatch):
    import sys
    import types

    from mha2mla_exp.aggregate.records import canonical_run, read_run
    from mha2mla_exp.aggregate.wandb_source import wandb_record
    from mha2mla_exp.runner.config import run_config
    from mha2mla_exp.runner.run import _Tracker

    captured = {}
    fake = types.SimpleNamespace(init=lambda **kwargs: captured.update(kwargs) or types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = run_config(composed(tmp_path, "logger=wandb_offline"))
    identity = {"config_hash": "c1", "trained_hash": "t1", "eval_hash": "e1", "setting_hash": "s1"}
    _Tracker(config, tmp_path / "runs" / "r", identity)
    logged = types.SimpleNamespace(
        name="r", state="finished", config=captured["config"], summary={"status": "ok"}, url="https://w/r"
    )
    from_wandb = canonical_run(wandb_record(logged))
    on_disk = tmp_path / "disk"
    on_disk.mkdir()
    (on_disk / "results.json").write_text(json.dumps({"status": "ok", "setting_hash": "s1", "run_name": "r"}))
    assert from_wandb["setting"] == canonical_run(read_run(on_disk / "results.json"))["setting"] == "s1"


def test_a_finished_record_is_kept_unless_rerun_is_asked_for(tmp_path, capsys):
    from types import SimpleNamespace

    from mha2mla_exp.runner import run_dir_for, validate
    from mha2mla_exp.runner.run import _finished

    main_process = SimpleNamespace(is_main_process=True)
    never = lambda *a: (False, "test")  # noqa: E731
    plan = validate(run_config(composed(tmp_path, *SMALL)), bf16_pays=never)
    run_dir = run_dir_for(plan)
    run_dir.mkdir(parents=True)
    for status, finished in (("running", False), ("failed", False), ("ok", True), ("diverged", True)):
        (run_dir / "results.json").write_text(json.dumps({"status": status}))
        assert (_finished(run_dir, main_process, rerun=plan.config.rerun) is not None) is finished, status
    assert "already done (diverged)" in capsys.readouterr().out
    rerun = validate(run_config(composed(tmp_path, *SMALL, "rerun=true")), bf16_pays=never)
    assert run_dir_for(rerun) == run_dir  # an observer: the same run, made again
    assert _finished(run_dir, main_process, rerun=rerun.config.rerun) is None


def test_a_sweep_with_a_busy_cell_says_so_and_is_not_complete(tmp_path):
    from omegaconf import OmegaConf

    from mha2mla_exp.runner.sweep import SweepFailed, SweepSummary, summary_table

    cells = [
        {"cell": 0, "overrides": "a", "status": "ok"},
        {"cell": 1, "overrides": "b", "status": "busy", "error": "already running: pid 7, host h, since t: runs/x"},
    ]
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cells))
    assert "busy" in summary_table(cells) and "already running: pid 7" in summary_table(cells)
    with pytest.raises(SweepFailed, match="1 cells already running in another process"):
        SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
