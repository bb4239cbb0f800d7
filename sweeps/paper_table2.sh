#!/usr/bin/env bash
# Paper Table 2 (LongBench by KV precision) at the paper's budget; each trained model is evaluated at every precision.
set -euo pipefail
. "$(dirname "$0")/paper_launch.sh"
for model in smollm_360m smollm_1b7 llama2_7b; do
  paper_launch table2 "$model" "$@"
done
