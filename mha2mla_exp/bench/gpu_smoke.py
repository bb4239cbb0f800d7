"""GPU smoke test (issue 44): every CUDA path of the project at small scale, in one command under 8 minutes.

On a lent GPU (one H100/H200, no network, 10 minutes a command), from the repository root:
    here, once, with PyPI:  bash scripts/gpu_smoke.sh prepare    # the missing wheels into .whl/ (tree + carry < 40 MiB)
    there, one call:        bash scripts/gpu_smoke.sh            # carry: [".whl"]; device timeout_s=600
It installs the carried wheels into /tmp/site, runs `python -m mha2mla_exp.bench.gpu_smoke` with a 450 s
budget and copies the stage files into $OUT. Commit what lands in results/bench/gpu/.
On a CPU (CI, tests/test_gpu_smoke.py): `python -m mha2mla_exp.bench.gpu_smoke --dry --out DIR`, the same stages
at tiny sizes (Triton through its interpreter, FSDP through one gloo process).

Stages, each in its own process under its own timeout, each writing `<out>/<nn>_<stage>.json` when it ends
({"stage", "status": pass | fail | error | timeout, "reason", "seconds", "measurements"}), then `summary.json`:
  machine          GPU, torch / CUDA / triton / transformers versions, the project's commit
  decode_kernel    absorbed decode through the Triton kernel in bf16 against the PyTorch reference in fp32
  train_precision  the runner's fine-tune in bf16-autocast against its fp32 twin (same data, seed, steps)
  evaluation       the original and the converted (fine-tuned) model evaluated by the runner on the same device
                   in the same eval dtype: held-out perplexity, passkey retrieval and long-document perplexity
  fsdp             `torchrun --nproc_per_node 1 -m mha2mla_exp ... train.strategy=fsdp`: the FSDP path on one
                   device (a mesh of one), its losses against the bf16 twin's
  decode_bench     `python -m mha2mla_exp.bench` on a small grid: MHA vs MLA (expanded, absorbed, +Triton)
The models are random-weight Llamas (model=tiny_random; on the GPU widened to SmolLM2-135M's shape): the real
SmolLM2 asset (98 MB) cannot be carried in one call. The exit code is non-zero when any stage does not pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import atomic

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("machine", "decode_kernel", "train_precision", "evaluation", "fsdp", "decode_bench")
PASS = "pass"


@dataclass(frozen=True)
class Plan:
    """What each stage runs: the GPU sizes, or the CPU dry mode's tiny ones."""

    dry: bool
    model: tuple[str, ...]  # runner overrides of the model group
    train: tuple[str, ...]  # runner overrides of the fine-tune (both twins)
    long_context: tuple[str, ...]  # runner overrides of the evaluation stage's suite
    decode_cases: tuple[dict, ...]  # absorbed-decode inputs: batch, heads, kv heads, rope dims, latent, keys/values
    bench: tuple[str, ...]  # python -m mha2mla_exp.bench arguments
    stage_caps_s: dict = field(default_factory=dict)  # each stage's own timeout (the budget may cut it shorter)
    budget_s: float = 450.0  # all stages together: the GPU call's 10 minutes less the install and the transfers
    loss_rtol: float = 0.03  # bf16 vs fp32: relative gap of the mean loss over the last tenth of the steps
    fsdp_checkpoint_every: int = 150  # steps: the FSDP run writes a checkpoint mid-run (the twins need none)
    decode_dtype: str = "bfloat16"  # the dry mode's float16: Triton's interpreter computes in numpy, which has no bf16


COMMON = ("eval=none", "logger=none", "kv_measure_tokens=64", "rope=2-norm", "svd=joint")

GPU = Plan(
    dry=False,
    # a random Llama of SmolLM2-135M's shape behind the byte-level tokenizer (no asset needed)
    model=(
        "model=tiny_random",
        "model.shape.num_layers=30",
        "model.shape.hidden_size=576",
        "model.shape.num_heads=9",
        "model.shape.num_kv_heads=3",
        "model.shape.head_dim=64",
        "model.shape.context_length=2048",
        "model.intermediate_size=1536",
        "model.finetune_length=1024",
        "rope.r=4",
        "svd.d_kv=32",
        "data.max_documents=60",
        "calibration.num_sequences=16",
        "calibration.seq_len=256",
    ),
    # 300 optimizer steps of 8 x 256 tokens
    train=(
        "train=cpu_short",
        "train.tokens=614400",
        "train.seq_len=256",
        "train.micro_batch_size=8",
        "train.grad_accum=1",
        "train.warmup_steps=20",
        "train.checkpoint_every=1000",
        "train.log_every=1",
    ),
    long_context=(
        "eval=long_context",
        "eval.perplexity.max_batches=4",
        "eval.long_context.lengths=[512,1024]",
        "eval.long_context.depths=[0.0,0.5,1.0]",
        "eval.long_context.samples_per_depth=2",
        "eval.long_context.ppl_lengths=[1024]",
        "eval.long_context.ppl_docs=2",
    ),
    decode_cases=(
        {
            "name": "smollm2-135m joint",
            "batch": 8,
            "heads": 9,
            "kv_heads": 3,
            "rope_dims": 8,
            "latent": 96,
            "split": False,
            "keys": 4096,
        },
        {
            "name": "llama2-7b split, left padded",
            "batch": 16,
            "heads": 32,
            "kv_heads": 32,
            "rope_dims": 16,
            "latent": 512,
            "split": True,
            "keys": 4096,
            "padded": True,
        },
        {
            "name": "nope, short",
            "batch": 4,
            "heads": 32,
            "kv_heads": 8,
            "rope_dims": 0,
            "latent": 256,
            "split": False,
            "keys": 300,
        },
    ),
    bench=(
        "--shapes",
        "smollm-135m",
        "--batches",
        "1,16",
        "--contexts",
        "1024,4096",
        "--warmup",
        "2",
        "--repeats",
        "10",
        "--attention-batches",
        "16",
        "--attention-contexts",
        "4096",
        "--no-plot",
    ),
    stage_caps_s={
        "machine": 30,
        "decode_kernel": 60,
        "train_precision": 170,
        "evaluation": 120,
        "fsdp": 90,
        "decode_bench": 90,
    },
)

DRY = Plan(
    dry=True,
    model=(
        "model=tiny_random",
        "model.finetune_length=512",
        "rope.r=2",
        "svd.d_kv=8",
        "data.max_documents=24",
        "calibration.num_sequences=4",
        "calibration.seq_len=32",
        "calibration.batch_size=2",
    ),
    # 16 optimizer steps of 4 x 64 tokens
    train=(
        "train=smoke",
        "train.tokens=4096",
        "train.seq_len=64",
        "train.micro_batch_size=4",
        "train.grad_accum=1",
        "train.warmup_steps=2",
        "train.checkpoint_every=8",
    ),
    long_context=(
        "eval=long_context",
        "eval.perplexity.max_batches=1",
        "eval.long_context.lengths=[512]",
        "eval.long_context.depths=[0.0]",
        "eval.long_context.samples_per_depth=1",
        "eval.long_context.ppl_lengths=[256]",
        "eval.long_context.ppl_docs=1",
    ),
    decode_cases=(
        {
            "name": "tiny joint",
            "batch": 2,
            "heads": 4,
            "kv_heads": 2,
            "rope_dims": 4,
            "latent": 16,
            "split": False,
            "keys": 40,
        },
        {
            "name": "tiny split, left padded",
            "batch": 2,
            "heads": 4,
            "kv_heads": 4,
            "rope_dims": 4,
            "latent": 32,
            "split": True,
            "keys": 24,
            "padded": True,
        },
    ),
    bench=(
        "--device",
        "cpu",
        "--shapes",
        "tiny",
        "--batches",
        "1",
        "--contexts",
        "64",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--no-attention",
        "--no-plot",
        "--threads",
        "1",
    ),
    # about 20 s a stage on 2 idle cores; the caps leave room for a loaded CI machine
    stage_caps_s={
        "machine": 60,
        "decode_kernel": 120,
        "train_precision": 300,
        "evaluation": 300,
        "fsdp": 200,
        "decode_bench": 150,
    },
    budget_s=900.0,
    loss_rtol=0.05,
    fsdp_checkpoint_every=8,
    decode_dtype="float16",
)


def verdict(ok: bool, reason_if_not: str, reason_if_ok: str = "") -> tuple[str, str]:
    return (PASS, reason_if_ok) if ok else ("fail", reason_if_not)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a timeout) never meets half a file."""
    atomic.write_json(path, data, indent=1, default=str)


def stage_path(out: Path, stage: str) -> Path:
    return out / f"{STAGES.index(stage):02d}_{stage}.json"


# ---------------------------------------------------------------------------------------------- runner helpers


def run_bounded(cmd: list[str], log, timeout: float, env: dict | None = None) -> int:
    """`cmd` in its own process group, output to the open file `log`; past `timeout` the whole group is killed
    (a runner's or torchrun's children too, which subprocess.run's timeout would leave running) and
    TimeoutExpired raised."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def run_runner(
    overrides: list[str], results_dir: Path, log: Path, timeout: float, *, torchrun: bool = False, device: str = "auto"
) -> tuple[int, Path | None]:
    """One `python -m mha2mla_exp` run (or a one-process torchrun launch of it), its output in `log`: the exit code
    and the run directory it reported (a finished run found again is reported too, and not redone)."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        if torchrun
        else [sys.executable]
    )
    cmd = [*launcher, "-m", "mha2mla_exp", *overrides, f"device={device}", f"results_dir={results_dir}"]
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        code = run_bounded(cmd, f, timeout, env)
    reported = RUN_LINE.findall(log.read_text())
    return code, Path(reported[-1]) if reported else None


RUN_LINE = re.compile(r"^\[mha2mla_exp\] [^:\n]+: (/\S+)$", re.MULTILINE)  # runner/run.py: "[mha2mla_exp] ok: DIR"


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """The run's record and its loss curve (empty without a fine-tune)."""
    curve_path = run_dir / "metrics.jsonl"
    curve = [json.loads(line) for line in curve_path.read_text().splitlines()] if curve_path.exists() else []
    return json.loads((run_dir / "results.json").read_text()), curve


def runner_stage_run(
    args, stage: str, name: str, overrides: list[str], results_dir: Path, *, torchrun: bool = False
) -> tuple[dict, list[dict]]:
    """A runner run inside a stage, under the stage's deadline, on the plan's device; RuntimeError if it failed."""
    log = args.work / "logs" / f"{stage}.{name}.log"
    code, run_dir = run_runner(
        overrides,
        results_dir,
        log,
        args.stage_deadline - time.monotonic(),
        torchrun=torchrun,
        device="cpu" if args.dry else "cuda",
    )
    if code != 0 or run_dir is None:
        raise RuntimeError(f"the {name} run exited {code}; the end of {log}:\n{log_tail(log)}")
    return read_run(run_dir)


def log_tail(log: Path, chars: int = 2000) -> str:
    """What a failed command said last: the stage's JSON carries it, since only that file comes back."""
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def losses_of(curve: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in curve if "loss" in row}


def tail_mean(losses: dict[int, float]) -> float:
    """Mean loss over the last tenth of the steps (at least 4): one step's noise is not a verdict."""
    steps = sorted(losses)
    tail = steps[-max(4, len(steps) // 10) :]
    return sum(losses[s] for s in tail) / len(tail)


NOISE_SIGMAS = 5  # a gap of end means this many standard errors off happens by chance with odds below 1e-6


def tail_noise(losses: dict[int, float]) -> float:
    """The standard error of `tail_mean`: the step-to-step noise (successive differences / sqrt 2, blind to the
    curve's trend) over the square root of the tail's steps."""
    steps = sorted(losses)
    tail = [losses[s] for s in steps[-max(4, len(steps) // 10) :]]
    diffs = [b - a for a, b in zip(tail, tail[1:])]
    sigma = math.sqrt(sum(d * d for d in diffs) / (2 * len(diffs)))
    return sigma / math.sqrt(len(tail))


def compare_curves(reference: dict[int, float], other: dict[int, float], rtol: float) -> dict:
    """Two loss curves of the same steps: finite, the same steps, end means within the larger of `rtol` of the
    reference and NOISE_SIGMAS standard errors of their difference (the curves' own noise): on a random-weight
    model a fixed percentage alone can be missed by chance."""
    finite = all(math.isfinite(v) for v in (*reference.values(), *other.values()))
    same_steps = sorted(reference) == sorted(other) and len(reference) >= 4
    out = {"steps": len(reference), "finite": finite, "same_steps": same_steps, "rtol": rtol}
    if finite and same_steps:
        ref_end, other_end = tail_mean(reference), tail_mean(other)
        noise = math.hypot(tail_noise(reference), tail_noise(other))
        out |= {
            "reference_end_loss": ref_end,
            "other_end_loss": other_end,
            "end_abs_gap": abs(other_end - ref_end),
            "end_rel_gap": abs(other_end - ref_end) / abs(ref_end),
            "end_gap_standard_error": noise,
            "end_gap_bound": max(rtol * abs(ref_end), NOISE_SIGMAS * noise),
            "first_step_abs_gap": abs(other[min(other)] - reference[min(reference)]),
            "max_step_abs_gap": max(abs(other[s] - reference[s]) for s in reference),
        }
    out["ok"] = finite and same_steps and out.get("end_abs_gap", math.inf) <= out.get("end_gap_bound", -1)
    return out


def runner_runs(plan: Plan) -> dict[str, list[str]]:
    """Every runner run of the smoke by name, as overrides: what the stages launch (and tests validate)."""

    def twin(precision: str) -> list[str]:
        return [*COMMON, *plan.model, *plan.train, f"train.precision={precision}"]

    suite = [*plan.long_context, "eval.dtype=auto"]
    return {
        "fp32": twin("fp32"),
        "bf16-autocast": twin("bf16-autocast"),
        "original": [*COMMON, *plan.model, "variant=original", "train=none", *suite],
        # the bf16 twin's config: its kept fine-tuned model (<work>/runs/_trained) is reused, not retrained
        "converted": [*twin("bf16-autocast"), *suite],
        # the bf16 twin under torchrun with FSDP; a checkpoint mid-run takes the sharded checkpoint's path
        "fsdp": [*twin("bf16-autocast"), "train.strategy=fsdp", f"train.checkpoint_every={plan.fsdp_checkpoint_every}"],
    }


# ---------------------------------------------------------------------------------------------------- stages


def stage_machine(plan: Plan, args) -> tuple[str, str, dict]:
    import torch

    from .report import machine_info

    device = torch.device("cpu" if plan.dry else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        return "fail", "no CUDA device visible to torch (run with --dry on a CPU)", {"torch": torch.__version__}
    return PASS, "", machine_info(device) | project_commit() | {"dry": plan.dry, "packages": package_versions()}


# what the smoke's paths import: the GPU image's own versions (torch, triton, transformers, accelerate...) differ
# from CI's, and the carried wheels' (scripts/gpu_smoke.sh) are installed into /tmp/site
PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "accelerate",
    "huggingface-hub",
    "tokenizers",
    "safetensors",
    "datasets",
    "lm_eval",
    "hydra-core",
    "omegaconf",
    "numpy",
    "pyarrow",
)


def package_versions() -> dict[str, dict]:
    """Each package's version and where it was imported from (the image's site-packages or the carried wheels)."""
    from importlib import metadata

    found = {}
    for name in PACKAGES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = {"version": None}
            continue
        found[name] = {"version": dist.version, "location": str(dist.locate_file(""))}
    return found


def project_commit() -> dict:
    """The commit the code came from: git's answer, else (the device tool copies the working tree without .git)
    $MHA2MLA_COMMIT, else what `scripts/gpu_smoke.sh prepare` wrote into .whl/COMMIT."""

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:  # no git at all
            return ""

    commit = git("rev-parse", "HEAD")
    if commit:
        return {
            "commit": commit,
            "commit_from": "git",
            "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    if os.environ.get("MHA2MLA_COMMIT"):
        return {"commit": os.environ["MHA2MLA_COMMIT"], "commit_from": "$MHA2MLA_COMMIT"}
    prepared = ROOT / ".whl" / "COMMIT"
    if prepared.exists():
        return {"commit": prepared.read_text().strip(), "commit_from": "prepare (.whl/COMMIT): the tree may be newer"}
    return {"commit": None, "commit_from": "unknown: no git, no $MHA2MLA_COMMIT, no .whl/COMMIT"}


def stage_decode_kernel(plan: Plan, args) -> tuple[str, str, dict]:
    import torch

    from ..mla.decode_dispatch import absorbed_decode, triton_available, triton_calls
    from ..mla.decode_reference import absorbed_decode_reference

    if not triton_available():
        return "fail", "triton does not import: the kernel cannot run", {}
    device, dtype = torch.device("cpu" if plan.dry else "cuda"), getattr(torch, plan.decode_dtype)
    eps = torch.finfo(dtype).eps
    rows, ok = [], True
    for case in plan.decode_cases:
        g = torch.Generator().manual_seed(0)
        b, n_h, n_kv, rd, width, s = (case[k] for k in ("batch", "heads", "kv_heads", "rope_dims", "latent", "keys"))
        k_slice = slice(0, width // 2) if case["split"] else slice(0, width)
        v_slice = slice(width // 2, width) if case["split"] else slice(0, width)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        inputs = (rand(b, n_h, rd), rand(b, n_h, k_slice.stop - k_slice.start), rand(b, n_kv, s, rd), rand(b, s, width))
        valid_start = (torch.arange(b, device=device) * (s // (2 * b))) if case.get("padded") else None
        scale = (k_slice.stop - k_slice.start + rd) ** -0.5
        calls = triton_calls()
        out = absorbed_decode(*inputs, k_slice, v_slice, scale, valid_start=valid_start, backend="triton")
        if device.type == "cuda":
            torch.cuda.synchronize()
        ref32 = absorbed_decode_reference(*(t.float() for t in inputs), k_slice, v_slice, scale, valid_start)
        ref_same_dtype = absorbed_decode_reference(*inputs, k_slice, v_slice, scale, valid_start)
        err = (out.float() - ref32).abs().max().item()
        row = {
            **case,
            "kernel_calls": triton_calls() - calls,
            "out_dtype": str(out.dtype).removeprefix("torch."),
            "max_abs_err_vs_fp32_reference": err,
            "reference_in_same_dtype_max_abs_err_vs_fp32": (ref_same_dtype.float() - ref32).abs().max().item(),
            "max_abs_reference": ref32.abs().max().item(),
        }
        # derived from the dtype: twice the error of the reference computed in the same dtype, or twice the dtype's
        # epsilon at the output's scale (the output's own rounding is half an epsilon), whichever is larger
        row["bound"] = (
            args.decode_atol
            if args.decode_atol is not None
            else max(2 * row["reference_in_same_dtype_max_abs_err_vs_fp32"], 2 * eps * row["max_abs_reference"])
        )
        row["ok"] = row["kernel_calls"] == 1 and out.dtype == dtype and math.isfinite(err) and err <= row["bound"]
        ok &= row["ok"]
        rows.append(row)
    worst = max(r["max_abs_err_vs_fp32_reference"] for r in rows)
    from ..mla.decode_triton import interpreted

    atol = max(r["bound"] for r in rows)
    meas = {
        "atol": atol,
        "bound": "per case: max(2 x the same-dtype reference's error, 2 x eps(dtype) x max |reference|)",
        "dtype": plan.decode_dtype,
        "interpreted": interpreted(),
        "device": str(device),
        "cases": rows,
        "worst_err": worst,
    }
    return (
        *verdict(
            ok,
            f"the Triton kernel's {plan.decode_dtype} result is off the fp32 reference by {worst:.3g} "
            f"> its case's bound (or it did not run, or not in {plan.decode_dtype}): see cases",
            f"{plan.decode_dtype} max abs error {worst:.3g}, each case within its dtype-derived bound",
        ),
        meas,
    )


def stage_train_precision(plan: Plan, args) -> tuple[str, str, dict]:
    rtol = args.loss_rtol if args.loss_rtol is not None else plan.loss_rtol
    fresh_folder(args.work / "runs")  # fresh runs: a finished one would only be found again
    runs = {
        precision: runner_stage_run(
            args, "train_precision", precision, runner_runs(plan)[precision], args.work / "runs"
        )
        for precision in ("fp32", "bf16-autocast")
    }
    cmp = compare_curves(losses_of(runs["fp32"][1]), losses_of(runs["bf16-autocast"][1]), rtol)
    meas = {"comparison": cmp}
    for name, (record, _) in runs.items():
        train = record.get("train") or {}
        meas[name] = {
            "status": record["status"],
            "device": record["machine"]["device"],
            "gpu": record["machine"].get("name"),
            "precision": train.get("precision"),
            "tf32": (record.get("placement") or {}).get("tf32"),
            "steps": train.get("steps"),
            "tokens": train.get("tokens"),
            "tokens_per_s": train.get("tokens_per_s"),
            "mfu": train.get("mfu"),
            "first_loss": train.get("first_loss"),
            "final_loss": train.get("final_loss"),
            "heldout_ppl": (record.get("eval") or {}).get("perplexity", {}).get("heldout"),
            "run_dir": record["run_dir"],
        }
    if meas["fp32"]["tokens_per_s"] and meas["bf16-autocast"]["tokens_per_s"]:
        meas["bf16_speedup"] = meas["bf16-autocast"]["tokens_per_s"] / meas["fp32"]["tokens_per_s"]
    modes = [(r.get("train") or {}).get("precision", {}).get("mode") for r, _ in runs.values()]
    ok = cmp["ok"] and modes == ["fp32", "bf16-autocast"]
    why = (
        f"bf16-autocast's losses left its fp32 twin's: {json.dumps(cmp)}"
        if not cmp["ok"]
        else f"the runs did not train in the precisions asked for: {modes}"
    )
    ok_why = f"end loss gap {cmp.get('end_abs_gap', math.nan):.4f} <= bound {cmp.get('end_gap_bound', math.nan):.4f}"
    return (*verdict(ok, why, ok_why), meas)


def stage_evaluation(plan: Plan, args) -> tuple[str, str, dict]:
    """The original and the converted model (the bf16 twin's kept fine-tune, reused) on the suite."""
    device = "cpu" if plan.dry else "cuda"
    meas = {}
    for name in ("original", "converted"):
        record, _ = runner_stage_run(args, "evaluation", name, runner_runs(plan)[name], args.work / "runs")
        ev = record.get("eval") or {}
        scores = {
            "heldout_ppl": ev.get("perplexity", {}).get("heldout"),
            **{k: v for k, v in (ev.get("long_context") or {}).items() if isinstance(v, (int, float))},
            **{
                f"ppl.{k}": v
                for k, v in ev.get("perplexity", {}).items()
                if k.startswith("longdoc") and isinstance(v, (int, float))
            },
        }
        placement = record.get("placement") or {}  # where the runner put the evaluated model (runner/run.py)
        meas[name] = {
            "status": record["status"],
            "device": placement.get("device", record["machine"]["device"]),
            "eval_dtype": record.get("eval_dtype"),
            "eval_dtype_reason": record.get("eval_dtype_reason"),
            "placement": placement or None,
            "scores": scores,
            "seconds": (ev.get("meta") or {}).get("seconds"),
            "trained_model": record.get("trained_model"),
            "train_s": (record.get("timings") or {}).get("train_s"),
            "kv": {k: (record.get("kv") or {}).get(k) for k in ("bytes_per_token_measured", "dtype", "cache")},
            "run_dir": record["run_dir"],
        }
    problems = []
    for name, m in meas.items():
        if m["status"] != "ok":
            problems.append(f"{name}: status {m['status']}")
        if not str(m["device"]).startswith(device):
            problems.append(f"{name}: ran on {m['device']}, not {device}")
        bad = {k: v for k, v in m["scores"].items() if v is None or not math.isfinite(v)}
        if bad or len(m["scores"]) < 3:
            problems.append(f"{name}: missing or non-finite scores {bad or m['scores']}")
    if meas["original"]["eval_dtype"] != meas["converted"]["eval_dtype"]:
        problems.append(f"eval dtypes differ: {meas['original']['eval_dtype']} vs {meas['converted']['eval_dtype']}")
    if not plan.dry and meas["converted"]["eval_dtype"] != "bfloat16":
        problems.append(f"eval.dtype=auto on CUDA gave {meas['converted']['eval_dtype']}, not bfloat16")
    return (*verdict(not problems, "; ".join(problems)), meas)


def stage_fsdp(plan: Plan, args) -> tuple[str, str, dict]:
    """The bf16 twin's fine-tune launched by torchrun as one process with train.strategy=fsdp."""
    rtol = args.loss_rtol if args.loss_rtol is not None else plan.loss_rtol
    # its own results folder: train.strategy is not part of a run's identity, so the twin's folder would hold
    # this run as already done
    fresh_folder(args.work / "runs_fsdp")
    record, curve = runner_stage_run(
        args, "fsdp", "fsdp", runner_runs(plan)["fsdp"], args.work / "runs_fsdp", torchrun=True
    )
    train = record.get("train") or {}
    meas = {
        "status": record["status"],
        "device": record["machine"]["device"],
        "strategy": train.get("strategy"),
        "processes": train.get("processes"),
        "precision": (train.get("precision") or {}).get("mode"),
        "tokens_per_s": train.get("tokens_per_s"),
        "final_loss": train.get("final_loss"),
        "run_dir": record["run_dir"],
    }
    twin = (
        json.loads(stage_path(args.out, "train_precision").read_text())["measurements"].get("bf16-autocast")
        if stage_path(args.out, "train_precision").exists()
        else None
    )
    if twin and Path(twin["run_dir"]).is_dir():  # the single-process twin from train_precision: same data, seed, steps
        _, twin_curve = read_run(Path(twin["run_dir"]))
        meas["against_single_process_twin"] = compare_curves(losses_of(twin_curve), losses_of(curve), rtol)
    problems = []
    if record["status"] != "ok":
        problems.append(f"status {record['status']}")
    if meas["strategy"] != "fsdp":
        problems.append(
            f"the launch trained as {meas['strategy']!r}, not sharded: the recipe did not take the FSDP "
            "path for one process"
        )
    if not all(math.isfinite(v) for v in losses_of(curve).values()) or not curve:
        problems.append("non-finite or missing losses")
    if not meas.get("against_single_process_twin", {"ok": True})["ok"]:
        problems.append(f"losses left the single-process twin's: {meas['against_single_process_twin']}")
    return (*verdict(not problems, "; ".join(problems)), meas)


def stage_decode_bench(plan: Plan, args) -> tuple[str, str, dict]:
    out = args.out / "bench"
    log = args.work / "logs" / "decode_bench.log"
    cmd = [sys.executable, "-m", "mha2mla_exp.bench", *plan.bench, "--out", str(out)]
    with open(log, "w") as f:
        code = run_bounded(cmd, f, args.stage_deadline - time.monotonic())
    if code != 0:
        return "error", f"python -m mha2mla_exp.bench exited {code}; the end of {log}:\n{log_tail(log)}", {}
    import csv

    with open(out / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    keep = (
        "shape",
        "variant",
        "dtype",
        "batch",
        "context",
        "status",
        "step_s_median",
        "tokens_per_s",
        "kv_bytes_per_token",
        "peak_mem_bytes",
        "triton_steps",
    )
    meas = {"command": " ".join(cmd[1:]), "rows": [{k: r.get(k) for k in keep} for r in rows]}
    problems = [
        f"{r['variant']} b{r['batch']} ctx {r['context']}: {r['status']}" for r in rows if r.get("status") != "ok"
    ]
    variants = {r["variant"] for r in rows}
    wanted = {"mha", "mla", "mla_absorbed"} | ({"mla_absorbed_triton"} if not plan.dry else set())
    if not wanted <= variants:
        problems.append(f"variants missing: {sorted(wanted - variants)}")
    return (*verdict(not problems, "; ".join(problems)), meas)


STAGE_FUNCTIONS = {
    "machine": stage_machine,
    "decode_kernel": stage_decode_kernel,
    "train_precision": stage_train_precision,
    "evaluation": stage_evaluation,
    "fsdp": stage_fsdp,
    "decode_bench": stage_decode_bench,
}


# ---------------------------------------------------------------------------------------------- orchestration


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mha2mla_exp.bench.gpu_smoke",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry", action="store_true", help="the CPU dry mode (CI): tiny sizes, Triton interpreted")
    p.add_argument(
        "--out",
        type=Path,
        help="the stage files, summary.json and the benchmark's CSVs (default "
        "results/bench/gpu; with --dry a temporary folder)",
    )
    p.add_argument(
        "--work",
        type=Path,
        help="the runs (their kept models: GBs on the GPU) and the logs (default: a temporary folder)",
    )
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument(
        "--budget-s", type=float, help="all stages together, each also under its cap (default: 450 s, 900 s with --dry)"
    )
    p.add_argument("--loss-rtol", type=float, help="bf16 vs fp32 end-loss gap allowed (default: the plan's)")
    p.add_argument("--decode-atol", type=float, help="Triton bf16 vs fp32 reference error allowed")
    p.add_argument("--run-stage", choices=STAGES, help=argparse.SUPPRESS)  # the child process of one stage
    p.add_argument("--stage-deadline-s", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    for name in ("out", "work"):
        given = getattr(args, name)
        if given is not None and given.is_symlink():
            p.error(f"--{name}: {given} is a symbolic link; give a real folder (the smoke deletes runs under it)")
    # a private folder of its own (mkdtemp: new, mode 0700) unless one is given; absolute, not resolved, so that
    # nothing the smoke deletes is reached through a symbolic link
    scratch = None if args.out and args.work else Path(tempfile.mkdtemp(prefix="mha2mla_gpu_smoke_"))
    args.out = (args.out or (scratch / "out" if args.dry else ROOT / "results" / "bench" / "gpu")).absolute()
    args.work = (args.work or scratch / "work").absolute()  # absolute: the runner reports its run dirs under it
    return args


def fresh_folder(path: Path) -> None:
    """`path` emptied for a fresh run: a symbolic link there is removed itself, never followed (rmtree does not
    follow the links inside a real folder either)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


# A stage that computes itself runs in its own process: TRITON_INTERPRET is read when triton is imported, and
# a hung kernel is killed with its process. The others only launch bounded commands and read what they wrote.
OWN_PROCESS = ("decode_kernel",)


def run_stage(stage: str, args) -> int:
    """Run one stage here, writing its JSON whatever happens."""
    plan = DRY if args.dry else GPU
    start = time.monotonic()
    try:
        status, reason, meas = STAGE_FUNCTIONS[stage](plan, args)
    except subprocess.TimeoutExpired as e:
        status, reason, meas = "timeout", f"a command ran past the stage's time: {' '.join(e.cmd[-4:])}", {}
    except Exception as e:  # recorded as the stage's error; the other stages still run
        import traceback

        status, reason, meas = "error", f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()[-4000:]}
    write_json(
        stage_path(args.out, stage),
        {
            "stage": stage,
            "status": status,
            "reason": reason,
            "dry": plan.dry,
            "seconds": round(time.monotonic() - start, 2),
            "measurements": meas,
        },
    )
    return 0 if status == PASS else 1


def run_stage_in_own_process(stage: str, args, limit: float) -> None:
    cmd = [
        sys.executable,
        "-m",
        "mha2mla_exp.bench.gpu_smoke",
        "--run-stage",
        stage,
        "--out",
        str(args.out),
        "--work",
        str(args.work),
        "--stage-deadline-s",
        str(limit - 3),
        *(["--dry"] if args.dry else []),
        *([f"--loss-rtol={args.loss_rtol}"] if args.loss_rtol is not None else []),
        *([f"--decode-atol={args.decode_atol}"] if args.decode_atol is not None else []),
    ]
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if args.dry else {}))  # on the CPU the kernel is interpreted
    start = time.monotonic()
    log_path = args.work / "logs" / f"{stage}.log"
    with open(log_path, "w") as log:
        try:
            run_bounded(cmd, log, limit, env)
        except subprocess.TimeoutExpired:
            pass  # recorded below: the stage left no file
    if not stage_path(args.out, stage).exists():
        timed_out = time.monotonic() - start >= limit - 1
        write_json(
            stage_path(args.out, stage),
            {
                "stage": stage,
                "status": "timeout" if timed_out else "error",
                "dry": args.dry,
                "reason": f"the stage's process {'ran out of time' if timed_out else 'died'}; the end of {log_path}:\n"
                f"{log_tail(log_path)}",
                "seconds": round(time.monotonic() - start, 2),
                "measurements": {},
            },
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_stage:
        args.stage_deadline = time.monotonic() + (args.stage_deadline_s or 600)
        return run_stage(args.run_stage, args)
    plan = DRY if args.dry else GPU
    budget_s = args.budget_s or plan.budget_s
    deadline = time.monotonic() + budget_s
    summary = {"dry": plan.dry, "budget_s": budget_s, "stages": {}}
    for stage in args.stages:
        path = stage_path(args.out, stage)
        path.unlink(missing_ok=True)
        limit = min(plan.stage_caps_s[stage], deadline - time.monotonic())
        print(f"== {stage} (up to {limit:.0f} s)", flush=True)
        if limit < 5:
            write_json(
                path,
                {
                    "stage": stage,
                    "status": "timeout",
                    "reason": "no time left in the budget",
                    "dry": plan.dry,
                    "seconds": 0,
                    "measurements": {},
                },
            )
        elif stage in OWN_PROCESS:
            run_stage_in_own_process(stage, args, limit)
        else:
            args.stage_deadline = time.monotonic() + limit
            run_stage(stage, args)
        result = json.loads(path.read_text())
        summary["stages"][stage] = {
            "status": result["status"],
            "reason": result["reason"],
            "seconds": result["seconds"],
        }
        print(f"   {result['status']}: {result['reason']} ({result['seconds']} s)", flush=True)
        write_json(args.out / "summary.json", summary)
    failed = [s for s, r in summary["stages"].items() if r["status"] != PASS]
    summary["ok"] = not failed
    write_json(args.out / "summary.json", summary)
    print(f"gpu smoke: {'all stages passed' if not failed else 'NOT passed: ' + ', '.join(failed)} -> {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
