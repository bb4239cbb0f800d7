#!/usr/bin/env bash
# Paper Table 5 (r ablation on 135M) at the paper's budget.
set -euo pipefail
. "$(dirname "$0")/paper_launch.sh"
for model in smollm_135m; do
  paper_launch table5 "$model" "$@"
done
