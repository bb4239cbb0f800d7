#!/usr/bin/env bash
# Paper Table 2 (LongBench, KV quantization) at the paper's budget; the fine-tuned weights are shared across precisions.
set -euo pipefail
python -m mha2mla_exp +experiment=longbench_quant model=smollm_360m data=smollm_corpus train=paper_135m eval=longbench "$@"
for model in smollm_1b7 llama2_7b; do
  python -m mha2mla_exp +experiment=longbench_quant model=$model data=smollm_corpus train=paper_7b eval=longbench "$@"
done
