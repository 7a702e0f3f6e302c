#!/usr/bin/env bash
# Layout: 2 nodes (--nodes), 8 processes per node, 1 GPU per process (--gpus-per-task=1).
# For 1 process per node driving its 8 GPUs, submit launch/slurm_gpu.sh.
#   sbatch launch/slurm_gpu_per_device.sh configs/qwen2_5_7b.py --config.model.path=/shared/Qwen2.5-7B-Instruct
# Submit from the repository root. SLURM binds one GPU to each task (--gpus-per-task
# implies --gpu-bind=per_task:1), so each process sees one GPU, local id 0, and
# jaxreplay.parallel.multihost passes local_device_ids=[0] (JAX alone would pass
# [SLURM_LOCALID], a GPU the task does not see). Coordinator, process count
# (SLURM_NTASKS = 16) and id (SLURM_PROCID) come from SLURM as in slurm_gpu.sh, whose
# notes on the .venv, the model and a shared or gs:// workdir apply here too.
#SBATCH --job-name=jaxreplay
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=4
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# shellcheck source=/dev/null
. .venv/bin/activate
CONFIG=${1:-configs/default.py}
shift || true
srun --kill-on-bad-exit=1 python -m jaxreplay.main --config "$CONFIG" \
  --config.distributed.initialize=True "$@"
