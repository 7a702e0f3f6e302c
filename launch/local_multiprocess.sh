#!/usr/bin/env bash
# Layout: 1 node, NUM processes per node (default 2), DEVICES fake CPU devices per process
# (default 2): one global mesh of NUM × DEVICES devices. The multi-host code path without
# a cluster (CPU: fake devices, gloo collectives).
#   bash launch/local_multiprocess.sh 2 configs/small.py --config.workdir=runs/mp
# Every process runs the same command with its own --config.distributed.process_id;
# process 0 prints the summary and writes the run files.
set -euo pipefail
cd "$(dirname "$0")/.."
NUM=${1:-2}
shift || true
CONFIG=${1:-configs/default.py}
shift || true
DEVICES=${DEVICES:-2}
PORT=${PORT:-$((20000 + RANDOM % 20000))}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES"
pids=()
for ((i = 0; i < NUM; i++)); do
  python -m jaxreplay.main --config "$CONFIG" --config.distributed.initialize=True \
    --config.distributed.coordinator_address="127.0.0.1:$PORT" \
    --config.distributed.num_processes="$NUM" --config.distributed.process_id="$i" \
    --config.log.progress=False "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
