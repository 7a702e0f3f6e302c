#!/usr/bin/env bash
# Single-host GPU run: installs JAX with CUDA wheels, then runs a config.
#   bash launch/gpu.sh configs/default.py --config.train.steps=500
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && . .venv/bin/activate
pip install -q -e . "jax[cuda12]>=0.10,<0.11"
CONFIG=${1:-configs/default.py}; shift || true
python -m jaxreplay.main --config "$CONFIG" "$@"
