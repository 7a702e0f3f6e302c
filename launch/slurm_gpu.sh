#!/usr/bin/env bash
# Layout: 2 nodes (--nodes), 1 process per node, 8 GPUs per process (all of its node's).
# For 1 process per GPU instead, submit launch/slurm_gpu_per_device.sh.
#   sbatch launch/slurm_gpu.sh configs/qwen2_5_7b.py --config.model.path=/shared/Qwen2.5-7B-Instruct
# Submit from the repository root (sbatch runs a copy of this script; it cd's to
# $SLURM_SUBMIT_DIR). srun starts the same command on every node. jax.distributed takes
# coordinator (first node of SLURM_STEP_NODELIST, port 61440 + SLURM_JOB_ID % 4096, or
# JAX_COORDINATOR_PORT), process count (SLURM_NTASKS) and id (SLURM_PROCID) from SLURM;
# jaxreplay.parallel.multihost gives each process every GPU in its CUDA_VISIBLE_DEVICES
# (JAX alone would take only GPU SLURM_LOCALID). The repository, its .venv (make it once
# with launch/gpu.sh, or `pip install -e . "jax[cuda12]>=0.10,<0.11"`), the model and
# --config.workdir must be on a filesystem every node sees, or the workdir a gs:// URL
# (`pip install -e ".[gcp]"`): Orbax writes one checkpoint from all processes, and
# process 0 writes the run files.
#SBATCH --job-name=jaxreplay
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# shellcheck source=/dev/null
. .venv/bin/activate
CONFIG=${1:-configs/default.py}
shift || true
srun --kill-on-bad-exit=1 python -m jaxreplay.main --config "$CONFIG" \
  --config.distributed.initialize=True "$@"
