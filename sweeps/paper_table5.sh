#!/usr/bin/env bash
# Paper Table 5 (r ablation on 135M) at the paper's budget.
set -euo pipefail
for model in smollm_135m; do
  python -m mha2mla_exp +experiment=paper_table5 model=$model "$@"
done
