#!/usr/bin/env bash
# Recovery at equal tokens with the plain fine-tune step and with its fast paths (issue 26): the cpu_precision
# conversion and rows in fp32, seeds 0 and 1, 16,384 tokens each (about 5 min a run on 2 cores). The fast paths
# (train.fused_loss, train.optimizer_impl) are not part of a run's identity, so each variant gets a results
# folder of its own. Relaunching skips finished runs. Then the table: results/bench/cpu_train/README.md.
# Usage: sweeps/cpu_fast_paths.sh [extra overrides]
set -euo pipefail
source "$(dirname "$0")/cpu_allocator.sh"
root=results/bench/cpu_train/fast_paths_runs
declare -A variant=([plain]="train.fused_loss=false train.optimizer_impl=loop"
                    [fast]="train.fused_loss=true train.optimizer_impl=fused")
for name in plain fast; do
  # shellcheck disable=SC2086
  python -m mha2mla_exp +experiment=cpu_precision train.precision=fp32 ${variant[$name]} \
      results_dir=$root/$name logger=none "$@"
done
python -m mha2mla_exp.bench.train_precision summary $root/plain/cpu_precision $root/fast/cpu_precision --as fast_paths
