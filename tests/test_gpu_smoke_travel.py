"""The GPU smoke test fits with room to grow and deletes only its own folders (issues 53 and 57): the working tree
plus the carry prepare recorded stays under 48 MiB of the device tool's 64; the carry holds only what the GPU
image lacks; the driver works in a private temporary folder and never follows a symbolic link into a deletion."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from mha2mla_exp.bench import gpu_smoke, travel

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_and_the_recorded_carry_stay_under_48_mib():
    """The tree (tracked and untracked-not-ignored files, as the device tool copies it) grows with every results
    commit; with the carry it came to 58.8 of the 60 MiB the script allowed."""
    tree, carry = travel.tree_bytes(ROOT), travel.recorded_carry_bytes(ROOT)
    assert carry > 0
    assert tree + carry <= travel.TEST_MIB * travel.MIB, travel.describe(tree, carry)


def test_the_carry_holds_only_what_the_gpu_image_lacks():
    """The image has torch 2.11, triton 3.6, transformers 5.24 and accelerate 1.15 (transformers 5.25 cost 14 MiB)."""
    record = json.loads((ROOT / travel.CARRY_RECORD).read_text())
    carried = {name.split("-")[0].lower() for name in record["files"] if name.endswith(".whl")}
    assert carried.isdisjoint({"torch", "triton", "transformers", "accelerate", "regex", "tokenizers", "safetensors"})
    assert {"hydra_core", "omegaconf", "lm_eval", "datasets"} <= carried
    assert record["carry_bytes"] == sum(record["files"].values())


def test_the_tree_is_counted_as_the_device_tool_copies_it(tmp_path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "kept.txt").write_text("x" * 100)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_text("x" * 10_000)
    (tmp_path / travel.CARRY_DIR).mkdir()
    (tmp_path / travel.CARRY_DIR / "w.whl").write_text("x" * 1000)  # counted as the carry, not twice
    assert travel.tree_bytes(tmp_path) == 100 + len("ignored/\n")
    assert travel.carry_files(tmp_path) == {"w.whl": 1000}


def test_the_driver_works_in_a_private_temporary_folder_of_its_own():
    """It used a fixed `mha2mla_gpu_smoke` folder in the system temp dir, resolved symlinks, then deleted under it."""
    first, second = gpu_smoke.parse_args(["--dry"]), gpu_smoke.parse_args(["--dry"])
    assert first.work != second.work and first.work.parent != Path("/tmp") / "mha2mla_gpu_smoke_dry"
    scratch = first.work.parent
    assert scratch.is_dir() and stat.S_IMODE(scratch.stat().st_mode) == 0o700 and not any(scratch.iterdir())
    for args in (first, second):
        args.work.parent.rmdir()


def test_a_symlinked_work_folder_is_refused(tmp_path):
    victim = tmp_path / "victim"
    (victim / "runs").mkdir(parents=True)
    (victim / "runs" / "precious").write_text("kept")
    link = tmp_path / "work"
    link.symlink_to(victim)
    with pytest.raises(SystemExit):
        gpu_smoke.parse_args(["--dry", "--work", str(link), "--out", str(tmp_path / "out")])
    assert (victim / "runs" / "precious").read_text() == "kept"


def test_a_fresh_runs_folder_never_follows_a_symlink_into_a_deletion(tmp_path):
    victim = tmp_path / "victim"
    (victim / "inner").mkdir(parents=True)
    (victim / "precious").write_text("kept")
    (victim / "inner" / "precious").write_text("kept")
    work = tmp_path / "work"
    work.mkdir()
    (work / "runs").symlink_to(victim)  # the runs folder itself a link: the link goes, not what it points at
    gpu_smoke.fresh_folder(work / "runs")
    assert not (work / "runs").exists() and (victim / "precious").read_text() == "kept"

    (work / "runs_fsdp").mkdir()
    (work / "runs_fsdp" / "old").write_text("a finished run")
    (work / "runs_fsdp" / "link").symlink_to(victim / "inner")  # a link inside: removed, never followed
    gpu_smoke.fresh_folder(work / "runs_fsdp")
    assert not (work / "runs_fsdp").exists() and (victim / "inner" / "precious").read_text() == "kept"


def test_the_slimmed_lm_eval_wheel_keeps_the_package_and_drops_the_bundled_tasks(tmp_path):
    import zipfile

    wheel = tmp_path / "lm_eval-0.4.13-py3-none-any.whl"
    kept = ["lm_eval/__init__.py", "lm_eval/tasks/__init__.py", "lm_eval/tasks/manager.py", "lm_eval/api/task.py"]
    dropped = ["lm_eval/tasks/hellaswag/hellaswag.yaml", "lm_eval/tasks/mmlu/default/utils.py"]
    record = "lm_eval-0.4.13.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, "x" * 1000)
        z.writestr(record, "".join(f"{name},sha256=x,1000\n" for name in kept + dropped))
    assert travel.slim_wheel(wheel) > 0
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == sorted([*kept, record])
        assert [line.split(",")[0] for line in z.read(record).decode().splitlines()] == kept
