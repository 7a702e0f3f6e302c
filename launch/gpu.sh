#!/usr/bin/env bash
# Layout: 1 node, 1 process per node, every GPU of the node per process (a one-process
# job: jax.distributed is not started; the mesh spans jax.devices()).
# Single-host GPU run: installs JAX with CUDA wheels, then runs a config.
#   bash launch/gpu.sh configs/default.py --config.train.steps=500
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# shellcheck source=/dev/null
. .venv/bin/activate
pip install -q -e . "jax[cuda12]>=0.10,<0.11"
CONFIG=${1:-configs/default.py}
shift || true
python -m jaxreplay.main --config "$CONFIG" "$@"
