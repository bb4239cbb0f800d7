#!/usr/bin/env bash
# Paper Table 1 at the paper's budget, four models. Usage: sweeps/paper_table1.sh [hydra/launcher=slurm] [overrides]
set -euo pipefail
. "$(dirname "$0")/paper_launch.sh"
for model in smollm_135m smollm_360m smollm_1b7 llama2_7b; do
  paper_launch table1 "$model" "$@"
done
