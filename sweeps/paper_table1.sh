#!/usr/bin/env bash
# Paper Table 1 at the paper's budget, four models. Usage: sweeps/paper_table1.sh [hydra/launcher=slurm] [overrides]
set -euo pipefail
for model in smollm_135m smollm_360m smollm_1b7 llama2_7b; do
  python -m mha2mla_exp +experiment=paper_table1 model=$model "$@"
done
