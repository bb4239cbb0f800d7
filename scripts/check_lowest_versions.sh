#!/usr/bin/env bash
# Do pyproject.toml's promises hold? Run it whenever pyproject.toml changes (about 10 min on 2 CPU cores), then
# commit what it writes under results/install/ and copy its summary into docs/INSTALL.md:
#   1. every direct dependency at its floor (uv's --resolution lowest-direct; torch held at the CPU build, $TORCH)
#      in a fresh venv, and the fast tests below run against it;
#   2. pip refusing a Python outside requires-python (3.14, which Hydra cannot start on) with its own message.
#
#   bash scripts/check_lowest_versions.sh      # PYTHON=python3.11 TORCH=torch==2.13.0+cpu WORK=/tmp/mha2mla_lowest
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
# the CPU build, exactly (a bare 2.13.0 would resolve to PyPI's CUDA build): from $PIP_FIND_LINKS where pip finds
# it, else UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH=${TORCH:-torch==2.13.0+cpu}
WORK=${WORK:-/tmp/mha2mla_lowest}
OUT=results/install
# one test file per dependency family, a few minutes on idle cores: Hydra and the schema, lm-eval (its YAML loader
# for LongBench, logged samples), the quanto and HQQ caches, pandas and scipy in the aggregate, and a tiny run end
# to end (torch, transformers, datasets, accelerate, safetensors; its records' modes)
TESTS=(
    tests/test_schema.py tests/test_eval_samples.py tests/test_eval_longbench.py tests/test_kv_quant.py
    tests/test_aggregate_paired.py tests/test_atomic_writes.py
)

mkdir -p "$OUT"
rm -rf "$WORK" && "$PYTHON" -m venv "$WORK/venv"
venv="$WORK/venv/bin"
"$venv/pip" install -q --upgrade pip uv  # an old pip (23.0) does not check requires-python against --python-version
log="$OUT/lowest_versions.log"
command=("$venv/uv" pip install --python "$venv/python" --resolution lowest-direct
    ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} -e ".[dev]" "$TORCH")
{
    echo "# scripts/check_lowest_versions.sh, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
    echo "\$ ${command[*]}"
} >"$log"
"${command[@]}" >>"$log" 2>&1
"$venv/python" -c "import torch; from mha2mla_exp.machine import machine_info; print('machine:', machine_info(torch.device('cpu')))" >>"$log"
"$venv/uv" pip freeze --python "$venv/python" >"$OUT/lowest_versions.txt"

echo "\$ python -m pytest -q ${TESTS[*]}" >>"$log"
status=0
"$venv/python" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning "${TESTS[@]}" >>"$log" 2>&1 || status=$?

cap="$OUT/python_cap.log"
[ -e build ] && kept_build=1 || kept_build=
"$venv/pip" wheel -q --no-deps -w "$WORK/dist" . >/dev/null
[ -n "$kept_build" ] || rm -rf build  # setuptools' in-tree build folder, made just now
refusal=("$venv/pip" install --dry-run --no-deps --python-version 3.14 --only-binary=:all: --target "$WORK/py314"
    "$WORK"/dist/mha2mla_exp-*.whl)
{
    echo "# $(date -u +%Y-%m-%dT%H:%MZ): pip asked to install the project for Python 3.14"
    echo "\$ pip install --dry-run --no-deps --python-version 3.14 --only-binary=:all: --target DIR mha2mla_exp-*.whl"
    "${refusal[@]}" 2>&1 | grep -v "^WARNING: Location" || true
} >"$cap"
grep -q "requires a different Python: 3.14" "$cap" || { echo "pip did not refuse Python 3.14: $cap" >&2; status=1; }

tail -n 3 "$log"
exit "$status"
