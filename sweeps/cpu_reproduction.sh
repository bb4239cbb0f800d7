#!/usr/bin/env bash
# The CPU-budget runs behind results/REPORT.md (2 CPU cores, SmolLM2-135M offline, SOTU text), each named by the
# folder its records live under: a study at a budget (conf/budget/) or a study of its own (conf/experiment/).
# Relaunching skips finished runs.
# Usage: sweeps/cpu_reproduction.sh [recovery|table3|table1|table5|headline|eval_original|passkey_nope|
#        kv_precision_cpu|kv_precision_cpu_transformers|rorope_zero_shot|rorope_recovery|cpu_precision|
#        recovery_lr_screen|recovery_study|cpu10x_table3|cpu10x_table5|cpu10x_seed1|cpu10x_table1|teacher_recovery|all]
#        [extra overrides, e.g. results_dir=results/runs]
set -euo pipefail
source "$(dirname "$0")/cpu_allocator.sh"
what=${1:-all}; shift || true
declare -A launch=(
  [cpu_table3]="+experiment=table3 budget=cpu" [cpu_table1]="+experiment=table1 budget=cpu"
  [cpu_table5]="+experiment=table5 budget=cpu" [cpu10x_table3]="+experiment=table3 budget=cpu10x"
  [cpu10x_table5]="+experiment=table5 budget=cpu10x" [cpu10x_table1]="+experiment=table1 budget=cpu10x"
)
for experiment in recovery cpu_table3 cpu_table1 cpu_table5 headline eval_original passkey_nope kv_precision_cpu \
    kv_precision_cpu_transformers rorope_zero_shot rorope_recovery cpu_precision recovery_lr_screen recovery_study \
    cpu10x_table3 cpu10x_table5 cpu10x_seed1 cpu10x_table1 teacher_recovery; do
  if [[ $what == all || $experiment == $what || $experiment == cpu_$what ]]; then
    # shellcheck disable=SC2086
    python -m mha2mla_exp ${launch[$experiment]:-+experiment=$experiment} logger=none "$@"
  fi
done
