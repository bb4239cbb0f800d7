#!/usr/bin/env bash
# Paper Table 1 at the paper's budget. Usage: sweeps/paper_table1.sh [hydra/launcher=slurm] [more overrides]
set -euo pipefail
for model in smollm_135m smollm_360m; do
  python -m mha2mla_exp +experiment=main_table model=$model data=smollm_corpus train=paper_135m eval=commonsense_full "$@"
done
for model in smollm_1b7 llama2_7b; do
  python -m mha2mla_exp +experiment=main_table model=$model data=smollm_corpus train=paper_7b eval=commonsense_full "$@"
done
