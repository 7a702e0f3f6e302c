#!/usr/bin/env bash
# Multi-node GPUs under SLURM: one process per node, each driving that node's 8 GPUs.
#   sbatch launch/slurm_gpu.sh configs/qwen2_5_7b.py --config.model.path=/shared/Qwen2.5-7B-Instruct
# srun starts the same command on every node; jax.distributed.initialize() reads
# SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID itself
# (coordinator = the first node). The repository, its .venv (make it once with
# launch/gpu.sh or `pip install -e . "jax[cuda12]>=0.10,<0.11"`), the model and
# --config.workdir must be on a filesystem every node sees (or a gs:// workdir): Orbax
# writes one checkpoint from all processes, and process 0 writes the run files.
# For one process per GPU instead: --ntasks-per-node=8 --gpus-per-task=1; JAX then takes
# the GPU of SLURM_LOCALID.
#SBATCH --job-name=jaxreplay
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
. .venv/bin/activate
CONFIG=${1:-configs/default.py}; shift || true
srun --kill-on-bad-exit=1 python -m jaxreplay.main --config "$CONFIG" \
  --config.distributed.initialize=True "$@"
