#!/usr/bin/env bash
# Paper Table 3 (partial-RoPE strategies, with and without joint SVD at d_kv=16; joint vs split) at the paper's budget.
set -euo pipefail
. "$(dirname "$0")/paper_launch.sh"
for model in smollm_135m smollm_1b7; do
  paper_launch table3 "$model" "$@"
done
