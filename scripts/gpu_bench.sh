#!/usr/bin/env bash
# Inference benchmark on a CUDA machine, in one call: kernel tests natively, the Triton launch-config
# sweep, the attention microbenchmark (the issue-7 target) and the end-to-end decode grid.
# Results: results/bench/<gpu tag>/ (e.g. h200), also copied flat into $OUT when $OUT is set.
#
# Needs on the GPU machine: python3 with torch (CUDA), triton, matplotlib, psutil, pyyaml, pytest
# (all in the H200 image), and NO network. transformers must be the version this repo pins (5.24),
# which the image lacks, so its wheel travels in .whl/:
#   1. here, with PyPI:   bash scripts/gpu_bench.sh prepare      (fills .whl/, git-ignored, ~15 MB)
#   2. there, one call:   bash scripts/gpu_bench.sh              (carry: [".whl"])
# real-smollm2 is left out: its asset (540 MB) is too large to carry and fetching it there would only
# hang on the missing network; the smollm-135m shape with random weights times the same computation.
# Budget: the stages' timeouts add up to 570 s, so run it with the device tool's timeout_s=600. Each
# stage writes as it goes (the benchmark after the microbenchmark and after every shape), so a stage cut
# by its timeout still leaves its CSVs; only bench.png is drawn at the very end. Files in $OUT (8 at
# most come back): decode/capacity/attention/tune CSVs, bench.png, machine.json and two logs.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "prepare" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    pyver() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
    # pure-python transformers, plus regex (a compiled dependency transformers checks at import)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "transformers==$(pyver transformers)" "regex==$(pyver regex)"
    ls -la .whl
    exit 0
fi

PY=${PYTHON:-python3}
. scripts/carried_wheels.sh
install_carried_wheels || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
TAG=$($PY -c "import torch; from mha2mla_exp.bench.__main__ import machine_tag; print(machine_tag(torch.device('cuda')))") || exit 1
RES=results/bench/$TAG
mkdir -p "$RES"

echo "== kernel tests (native CUDA)"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$RES/test_kernels.log" | tail -5

echo "== launch-config sweep at the Llama-2-7B layer, batch 16 / 16k"
timeout 120 $PY -m mha2mla_exp.mla.kernels.tune --batch 16 --context 16384 --out "$RES/tune.csv" 2>&1 | tail -12

echo "== benchmark (attention microbenchmark, then decode grid)"
timeout 300 $PY -m mha2mla_exp.bench --shapes smollm-135m,llama2-7b,smollm-1.7b --out "$RES" 2>&1 | grep -v ' INFO ' | tee "$RES/bench.log" | tail -60

if [[ -n "${OUT:-}" ]]; then
    cp "$RES"/*.csv "$RES"/*.png "$RES"/*.json "$RES"/*.log "$OUT"/ 2>/dev/null
fi
ls -la "$RES"
