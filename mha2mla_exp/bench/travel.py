"""What travels to a lent GPU with the smoke test: the working tree (tracked files and the untracked ones git does
not ignore, as the device tool copies it) and the carried folder `.whl/` (the wheels the GPU image lacks and the
SOTU asset), against the device tool's 64 MiB. `scripts/gpu_smoke.sh prepare` refuses more than `PREPARE_MIB`
and writes the carry's listing to `CARRY_RECORD`, so that a test (tests/test_gpu_smoke_travel.py) sees the tree
grow past `TEST_MIB` with the carry included, on a machine that never ran prepare.

    python -m mha2mla_exp.bench.travel [--slim] [--record]   # the sizes; --slim: lm-eval's bundled tasks left
                                                              # out of its carried wheel; --record: CARRY_RECORD
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import zipfile
from pathlib import Path

from .. import atomic

ROOT = Path(__file__).resolve().parents[2]
CARRY_DIR = ".whl"
CARRY_RECORD = Path("results") / "bench" / "gpu" / "carry.json"
MIB = 1 << 20
DEVICE_MIB = 64  # what the device tool takes in, tree and carry together
PREPARE_MIB = 40  # what prepare allows: room for the results still to come
TEST_MIB = 48  # what the test allows the committed tree plus the recorded carry


def tree_files(root: Path = ROOT) -> list[Path]:
    """The working tree as the device tool copies it: tracked files and untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    names = [name for name in out.decode().split("\0") if name and not name.startswith(f"{CARRY_DIR}/")]
    return [root / name for name in names if (root / name).is_file()]  # the carry is counted once, as the carry


def tree_bytes(root: Path = ROOT) -> int:
    return sum(path.stat().st_size for path in tree_files(root))


def carry_files(root: Path = ROOT) -> dict[str, int]:
    folder = root / CARRY_DIR
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def recorded_carry_bytes(root: Path = ROOT) -> int:
    """The carry as prepare last recorded it (CARRY_RECORD)."""
    return json.loads((root / CARRY_RECORD).read_text())["carry_bytes"]


# lm-eval's wheel is 8.7 MiB, nearly all of it the bundled task definitions (lm_eval/tasks/<suite>/); the smoke's
# tasks are the project's own (TaskManager(include_path=..., include_defaults=False)): the carried copy leaves them
# out
SLIM_DROP = {"lm_eval": re.compile(r"^lm_eval/tasks/[^/]+/")}


def slim_wheel(path: Path) -> int:
    """Rewrite the carried wheel `path` without what SLIM_DROP names for its package (its RECORD lines too), in
    place; the bytes saved."""
    package = path.name.split("-")[0]
    drop = SLIM_DROP[package]
    before = path.stat().st_size
    with (
        atomic.atomic_path(path) as slim,
        zipfile.ZipFile(path) as src,
        zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            if drop.match(info.filename):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not drop.match(line)]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    return before - path.stat().st_size


def describe(tree: int, carry: int) -> str:
    return (
        f"working tree {tree / MIB:.1f} MiB + carry {carry / MIB:.1f} MiB = {(tree + carry) / MIB:.1f} MiB "
        f"(prepare's limit {PREPARE_MIB} MiB, the device tool's {DEVICE_MIB} MiB)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.travel", description=__doc__)
    parser.add_argument("--record", action="store_true", help=f"write the carry's listing to {CARRY_RECORD}")
    parser.add_argument("--slim", action="store_true", help="first rewrite the carried wheels SLIM_DROP names")
    args = parser.parse_args(argv)
    if args.slim:
        for package in SLIM_DROP:
            for wheel in sorted((ROOT / CARRY_DIR).glob(f"{package}-*.whl")):
                print(f"slimmed {wheel.name}: {slim_wheel(wheel) / MIB:.1f} MiB of bundled task definitions left out")
    files = carry_files()
    tree, carry = tree_bytes(), sum(files.values())
    if args.record:
        atomic.write_json(
            ROOT / CARRY_RECORD,
            {"carry_dir": CARRY_DIR, "files": files, "carry_bytes": carry, "tree_bytes_at_prepare": tree},
        )
    for name, size in files.items():
        print(f"  {size / MIB:7.2f} MiB  {CARRY_DIR}/{name}")
    print(describe(tree, carry))
    if tree + carry > PREPARE_MIB * MIB:
        print(f"refusing: more than {PREPARE_MIB} MiB would travel")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
