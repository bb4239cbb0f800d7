"""Where one fine-tune step's time goes on this CPU: torch.profiler over one optimizer step per precision mode and
step variant, operators by self time, grouped into what they are (matmul, attention, loss, memory traffic, the
rest) and where they run (the recipe's `record_function` phases: teacher, forward, backward, optimizer).

    python -m mha2mla_exp.bench.train_profile --out results/bench/cpu_train            # fp32, plain and fast
    python -m mha2mla_exp.bench.train_profile --modes bf16-autocast --micro-batch-size 1 --grad-accum 1

Writes profile.csv (one row per mode x variant: step seconds, the share of each kind and phase) and
profile_ops.csv (the top operators of each), merged with what earlier runs on other machines wrote (rows are
keyed by machine, mode, variant). The sum of operators' self times is the step's time on the calling thread
(intra-op threads work inside an operator), so shares are shares of the step.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from ..confutil import typed_section
from ..data.rows import FiniteRows
from ..machine import allocator
from ..schema.sections import TrainConfig
from ..train import precision_for
from ..train.recipe import FineTuneRecipe
from .train_precision import RECIPE, VARIANTS, machine_label, merge_rows, study_model

PHASES = ("teacher", "forward", "backward", "optimizer")
KINDS = {  # operator -> kind; anything else is "other" (elementwise math, norms, activations, Python overhead)
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm"),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "loss": (
        "aten::_log_softmax",
        "aten::_log_softmax_backward_data",
        "aten::nll_loss_forward",
        "aten::nll_loss_backward",
        "aten::_softmax",
        "aten::_softmax_backward_data",
        "aten::exp",
        "aten::xlogy",
    ),
    "memory": (
        "aten::copy_",
        "aten::fill_",
        "aten::zero_",
        "aten::clone",
        "aten::cat",
        "aten::_to_copy",
        "aten::index_add_",
        "aten::embedding_dense_backward",
        "aten::slice_backward",
        "aten::empty",
        "aten::empty_strided",
    ),
}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}
TOP_OPS = 12


def profile_step(model, mode: str, variant: str, micro_batch_size: int, grad_accum: int, seq_len: int = 256):
    """(one row of shares, the top operators) for one profiled optimizer step after one warm-up step."""
    recipe = (
        RECIPE
        | VARIANTS[variant]
        | {"micro_batch_size": micro_batch_size, "grad_accum": grad_accum, "seq_len": seq_len}
    )
    tokens = seq_len * micro_batch_size * grad_accum
    rows = FiniteRows(
        torch.randint(
            0,
            model.config.vocab_size,
            (64 * micro_batch_size * grad_accum, seq_len),
            generator=torch.Generator().manual_seed(0),
        ),
        seed=0,
    )
    train = typed_section(TrainConfig, recipe | {"tokens": tokens * 4, "compile": False})
    with tempfile.TemporaryDirectory() as tmp:
        recipe_run = FineTuneRecipe(
            copy.deepcopy(model), rows, train, Path(tmp), precision=precision_for(mode, "cpu"), seed=0
        )
        recipe_run.setup()
        recipe_run.step()  # warm-up: allocator, kernel selection, the optimizer's state
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            recipe_run.step()
            seconds = time.perf_counter() - start
    return summarise(prof.events(), mode, variant, tokens, seconds)


def summarise(events, mode: str, variant: str, tokens: int, seconds: float) -> tuple[dict, pd.DataFrame]:
    """Self time by kind and by phase (from the profiler's event tree), and the top operators by self time."""
    by_kind = dict.fromkeys([*KINDS, "other"], 0.0)
    by_phase = dict.fromkeys([*PHASES, "outside"], 0.0)
    ops: dict[str, list] = {}
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        self_s = event.self_cpu_time_total / 1e6
        by_kind[KIND_OF.get(event.name, "other")] += self_s
        by_phase[_phase(event)] += self_s
        entry = ops.setdefault(event.name, [0.0, 0])
        entry[0] += self_s
        entry[1] += 1
    total = sum(by_kind.values()) or 1.0
    row = {
        "mode": mode,
        "variant": variant,
        "tokens_per_step": tokens,
        "step_s": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "profiled_s": round(total, 3),
    }
    row |= {f"{kind}_share": round(s / total, 3) for kind, s in by_kind.items()}
    row |= {f"{phase}_share": round(s / total, 3) for phase, s in by_phase.items()}
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
    table = pd.DataFrame(
        [
            {
                "mode": mode,
                "variant": variant,
                "op": name,
                "kind": KIND_OF.get(name, "other"),
                "self_s": round(s, 3),
                "share": round(s / total, 3),
                "calls": calls,
            }
            for name, (s, calls) in top
        ]
    )
    return row, table


def _phase(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in PHASES:
            return parent.name
        parent = parent.cpu_parent
    return "outside"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha2mla_exp.bench.train_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench/cpu_train"))
    parser.add_argument("--modes", default="fp32")
    parser.add_argument("--variants", default="plain,fast", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--micro-batch-size", type=int, default=RECIPE["micro_batch_size"])
    parser.add_argument("--grad-accum", type=int, default=RECIPE["grad_accum"])
    args = parser.parse_args(argv)
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown {variant!r}; expected some of {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    model, machine = study_model(), machine_label()
    rows, tops = [], []
    for mode in args.modes.split(","):
        for variant in args.variants.split(","):
            row, top = profile_step(model, mode, variant, args.micro_batch_size, args.grad_accum)
            print(row, flush=True)
            rows.append({"machine": machine, "allocator": allocator()} | row)
            tops.append(top.assign(machine=machine, allocator=allocator()))
    keys = ["machine", "allocator", "mode", "variant"]
    merge_rows(args.out / "profile.csv", pd.DataFrame(rows), keys)
    merge_rows(args.out / "profile_ops.csv", pd.concat(tops)[["machine", "allocator", *top.columns]], keys)
    from .train_precision import write_readme

    write_readme(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
