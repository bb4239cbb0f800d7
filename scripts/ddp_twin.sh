#!/usr/bin/env bash
# The same fine-tune in one process and in two (torchrun, gloo on CPU): the multi-GPU code path at small scale.
# Both read 8 rows per optimizer step (1 x 4 rows x 2 accumulation steps; 2 processes x 4 rows x 1), so their
# losses must agree; the records land in results/ddp_twin/{one_process,two_processes}/ and the losses are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(model=tiny_random train=smoke train.precision=fp32 train.tokens=4096 eval=none logger=none
        data.max_documents=24 calibration.num_sequences=4 calibration.seq_len=32 calibration.batch_size=2
        kv_measure_tokens=64 rope.r=2 svd.d_kv=8 train.micro_batch_size=4)
python -m mha2mla_exp "${common[@]}" train.grad_accum=2 results_dir=results/ddp_twin/one_process "$@"
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m mha2mla_exp "${common[@]}" train.grad_accum=1 \
  results_dir=results/ddp_twin/two_processes "$@"
python - <<'PY'
import json, pathlib
curves = {}
for name in ("one_process", "two_processes"):
    [metrics] = pathlib.Path("results/ddp_twin", name).glob("default/*/metrics.jsonl")
    curves[name] = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
one, two = curves["one_process"], curves["two_processes"]
print(f"{'step':>4}  {'1 process':>10}  {'2 processes':>11}  {'|diff|':>8}")
for step in sorted(one):
    print(f"{step:>4}  {one[step]:>10.6f}  {two[step]:>11.6f}  {abs(one[step] - two[step]):>8.1e}")
PY
