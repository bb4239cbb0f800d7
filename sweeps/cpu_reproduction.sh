#!/usr/bin/env bash
# The CPU-budget runs behind results/REPORT.md (2 CPU cores, SmolLM2-135M offline, SOTU text); each
# experiment's file in conf/experiment/ states its budget. Relaunching skips finished runs.
# Usage: sweeps/cpu_reproduction.sh [recovery|table3|table1|table5|headline|eval_original|passkey_nope|
#        kv_precision_cpu|kv_precision_cpu_transformers|rorope_zero_shot|rorope_recovery|cpu_precision|
#        recovery_lr_screen|recovery_study|cpu10x_table3|cpu10x_table5|cpu10x_seed1|cpu10x_table1|teacher_recovery|all]
#        [extra overrides, e.g. results_dir=results/runs]
set -euo pipefail
source "$(dirname "$0")/cpu_allocator.sh"
what=${1:-all}; shift || true
for experiment in recovery cpu_table3 cpu_table1 cpu_table5 headline eval_original passkey_nope kv_precision_cpu \
    kv_precision_cpu_transformers rorope_zero_shot rorope_recovery cpu_precision recovery_lr_screen recovery_study \
    cpu10x_table3 cpu10x_table5 cpu10x_seed1 cpu10x_table1 teacher_recovery; do
  if [[ $what == all || $experiment == $what || $experiment == cpu_$what ]]; then
    python -m mha2mla_exp +experiment=$experiment logger=none "$@"
    if [[ $experiment == cpu10x_seed1 ]]; then   # r = 8 is a Table 5 cell: a run of its own
      python -m mha2mla_exp +experiment=cpu10x_seed1 +cells/table5=2-norm_r8 hydra.mode=RUN logger=none "$@"
    fi
  fi
done
