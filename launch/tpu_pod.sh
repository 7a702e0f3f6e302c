#!/usr/bin/env bash
# Multi-host TPU pod: run the same command on every worker, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command "cd jaxreplay && bash launch/tpu_pod.sh configs/default.py"
# JAX discovers the pod topology itself on TPU VMs (jax.distributed.initialize() with no
# arguments). --config.workdir should be a gs:// path (or a filesystem all workers share):
# Orbax writes one checkpoint from all workers, and worker 0 writes the run files.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && . .venv/bin/activate
pip install -q -e . "jax[tpu]>=0.10,<0.11"
CONFIG=${1:-configs/default.py}; shift || true
python -m jaxreplay.main --config "$CONFIG" --config.distributed.initialize=True "$@"
