#!/usr/bin/env bash
# Paper Table 2 (LongBench by KV precision) at the paper's budget; each trained model is evaluated at every precision.
set -euo pipefail
for model in smollm_360m smollm_1b7 llama2_7b; do
  python -m mha2mla_exp +experiment=paper_table2 model=$model "$@"
done
