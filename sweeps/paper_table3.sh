#!/usr/bin/env bash
# Paper Table 3 (partial-RoPE strategies, with and without joint SVD at d_kv=16; joint vs split).
set -euo pipefail
python -m mha2mla_exp +experiment=partial_rope_ablation model=smollm_135m data=smollm_corpus train=paper_135m eval=commonsense_full "$@"
python -m mha2mla_exp +experiment=partial_rope_ablation model=smollm_1b7 data=smollm_corpus train=paper_7b eval=commonsense_full "$@"
