#!/usr/bin/env bash
# Paper Table 5 (r ablation on 135M).
set -euo pipefail
python -m mha2mla_exp +experiment=r_ablation model=smollm_135m data=smollm_corpus train=paper_135m eval=commonsense_full "$@"
