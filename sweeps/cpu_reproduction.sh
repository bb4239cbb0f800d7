#!/usr/bin/env bash
# The CPU-budget runs behind results/REPORT.md (2 CPU cores, SmolLM2-135M offline, SOTU text).
# Budgets: 16,384 fine-tuning tokens per ablation run (8 steps x 8 x 256), held-out perplexity on 32 rows x 512
# tokens; the recovery experiment 32,768 tokens and the commonsense suite at 50 docs per task (eval=quick).
# SVD rows start from activation-aware SVD (svd.init=activation): from the paper's weight SVD, 16k tokens
# leave every row broken (ppl in the thousands) and the strategy comparison says nothing.
# Table 5 runs r=8 and NoPE; its r=4 rows are Table 3's partial-RoPE rows (same budget); add *_r2 to the glob for r=2.
# Usage: sweeps/cpu_reproduction.sh [recovery|table3|table1|table5|all] [extra overrides]
set -euo pipefail
what=${1:-all}; shift || true
common=(calibration.num_sequences=32 eval.perplexity.max_batches=4 logger=none "$@")
ablation=(train.tokens=16384 eval=none eval.perplexity.max_batches=4 "${common[@]}")

if [[ $what == recovery || $what == all ]]; then
  python -m mha2mla_exp +experiment=recovery "${common[@]}"
fi
if [[ $what == table3 || $what == all ]]; then
  python -m mha2mla_exp +experiment=partial_rope_ablation experiment=cpu_table3 "+cells/table3=glob([ft_*,partial_*])" "${ablation[@]}"
  python -m mha2mla_exp +experiment=partial_rope_ablation experiment=cpu_table3 "+cells/table3=glob(svd_*)" \
    svd.init=activation "${ablation[@]}"
  python -m mha2mla_exp +experiment=partial_rope_ablation experiment=cpu_table3 "+cells/table3=partial_2-norm" \
    rope.score=sum "${ablation[@]}"                                    # the code's score behind the v1 tables
  python -m mha2mla_exp +experiment=partial_rope_ablation experiment=cpu_table3 "+cells/table3=svd_joint_2-norm" \
    "${ablation[@]}"                                                   # the paper's weight SVD, same budget
  python -m mha2mla_exp +experiment=partial_rope_ablation experiment=cpu_table3 "+cells/table3=svd_joint_2-norm" \
    svd.init=activation svd.sigma=sqrt "${ablation[@]}"                # sigma placement: sqrt vs up
fi
if [[ $what == table1 || $what == all ]]; then
  # d_kv=16 at this budget is the recovery experiment's ft_32k run
  python -m mha2mla_exp -m experiment=cpu_table1 svd.d_kv=8,32 svd.init=activation train.tokens=32768 "${common[@]}"
fi
if [[ $what == table5 || $what == all ]]; then
  python -m mha2mla_exp +experiment=r_ablation experiment=cpu_table5 "+cells/table5=glob([*_r8,none])" "${ablation[@]}"
fi
