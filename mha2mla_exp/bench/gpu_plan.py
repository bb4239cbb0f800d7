"""The paper-scale launch plans a GPU run will meet, printed on any machine (issue 53): one dry-run cell of Table 1
per launch below, planned for `device=cuda` with the launch's process count (WORLD_SIZE, as torchrun or SLURM's
tasks set it; the processes themselves are not started here), offline (HF_HUB_OFFLINE: what only the hub can
answer is a note).

    HF_HUB_OFFLINE=1 python -m mha2mla_exp.bench.gpu_plan [--out results/bench/gpu_plan]

Writes one text file per launch, the plan exactly as `python -m mha2mla_exp ... dry_run=true` prints it, and
README.md listing the launches and their verdicts, with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from pathlib import Path
from types import SimpleNamespace

from .. import atomic

ROOT = Path(__file__).resolve().parents[2]
CELL = ["+experiment=table1", "budget=paper", "variant=mla", "svd.d_kv=16", "logger=none", "dry_run=true"]
LAUNCHES = {  # file name -> (processes, overrides, what it shows)
    "llama2_7b_1_process": (1, ["model=llama2_7b"], "the 8-GPU FSDP plan on one process: refused for memory"),
    "llama2_7b_8_processes": (
        8,
        ["model=llama2_7b"],
        "the 7B on the 8 processes of its plan: host memory with the save",
    ),
    "smollm_1b7_1_process": (1, ["model=smollm_1b7"], "the 8-GPU DDP plan on one process: refused for time"),
    "smollm_1b7_1_process_intended": (
        1,
        ["model=smollm_1b7", "train.allow_fewer_processes=true"],
        "the same, said to be intended: accepted, its wall time stated",
    ),
    "smollm_135m_8_processes": (8, ["model=smollm_135m"], "SmolLM-135M on 8 processes, no extra option"),
}


def plan_text(processes: int, overrides: list[str], results_dir: Path) -> tuple[str, str]:
    """The dry run's printed plan and its status for a launch of `processes` processes on a GPU."""
    from hydra import compose, initialize_config_dir

    from ..confutil import CONF_DIR
    from ..runner.config import run_config
    from ..runner.run import _plan_only, plan_run, run_dir_for

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(processes)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                config_name="config", overrides=[*CELL, *overrides, "device=cuda", f"results_dir={results_dir}"]
            )
        dist = SimpleNamespace(num_processes=processes, is_main_process=True)  # the launch's, not started
        plan = plan_run(run_config(cfg), dist)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            outcome = _plan_only(plan, run_dir_for(plan), dist)
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous
    return printed.getvalue(), outcome["status"]


def main(argv: list[str] | None = None) -> int:
    import torch

    from ..machine import machine_info

    parser = argparse.ArgumentParser(prog="python -m mha2mla_exp.bench.gpu_plan", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "gpu_plan")
    args = parser.parse_args(argv)
    rows = []
    for name, (processes, overrides, shows) in LAUNCHES.items():
        text, status = plan_text(processes, overrides, Path("runs"))
        command = f"WORLD_SIZE={processes} python -m mha2mla_exp {' '.join([*CELL, *overrides, 'device=cuda'])}"
        atomic.write_text(args.out / f"{name}.txt", f"$ {command}\n{text}")
        launch = re.search(r"this launch has \d+: (.*)", text)
        rows.append(
            f"| [{name}.txt]({name}.txt) | {processes} | {launch.group(1) if launch else '-'} | {status} | {shows} |"
        )
        print(f"{name}: {status}")
    readme = [
        "# Paper-scale launch plans (dry runs for device=cuda, written on a CPU machine)",
        "",
        "`HF_HUB_OFFLINE=1 python -m mha2mla_exp.bench.gpu_plan` (mha2mla_exp/bench/gpu_plan.py): one Table 1 cell",
        "per launch, planned with the launch's process count as torchrun or SLURM's tasks would set it; offline, so",
        "the hub's answers are notes, and the dry run's status is `blocked` where the launch is accepted: this",
        "machine lacks python-edu's S3 access (a cluster with it plans them `planned`). Each is planned for",
        "`device=cuda` on this CPU machine: precision bf16-autocast, evaluation dtype bfloat16, and the run and",
        "trained-model folders (hashes) a GPU launch of the same command uses (tests/test_launch_plan.py).",
        "",
        "| plan | processes | the launch | dry-run status here | shows |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Machine: {machine_info(torch.device('cpu'))}",
        "",
    ]
    atomic.write_text(args.out / "README.md", "\n".join(readme))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
