# Sourced by sweeps/paper_table*.sh: launch one paper table at the paper's budget (budget=paper) for one model with
# the processes its plan needs (model.gpu_plan.gpus in conf/model/<model>.yaml; 1 where it has none). Locally a
# multi-GPU plan runs under torchrun; with hydra/launcher=slurm every cell is a job of that many tasks and GPUs on
# one node.
# A launch with fewer processes than the plan needs would be refused before loading (train/memory.py).
paper_launch() {
  local experiment=$1 model=$2; shift 2
  local gpus
  gpus=$(sed -n 's/^gpu_plan: {gpus: \([0-9]*\).*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../conf/model/$model.yaml")
  gpus=${gpus:-1}
  if [[ " $* " == *" hydra/launcher=slurm "* ]]; then
    python -m mha2mla_exp +experiment="$experiment" budget=paper model="$model" \
      hydra.launcher.tasks_per_node="$gpus" hydra.launcher.gpus_per_node="$gpus" "$@"
  elif (( gpus > 1 )); then
    torchrun --standalone --nproc_per_node "$gpus" -m mha2mla_exp +experiment="$experiment" budget=paper \
      model="$model" "$@"
  else
    python -m mha2mla_exp +experiment="$experiment" budget=paper model="$model" "$@"
  fi
}
