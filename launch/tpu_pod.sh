#!/usr/bin/env bash
# Layout: 1 node per TPU VM worker of the slice (4 on a v4-32), 1 process per node, all
# of the worker's TPU chips per process (4 on a v4 host).
# Run the same command on every worker, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all \
#     --command "cd jaxreplay && bash launch/tpu_pod.sh configs/default.py --config.workdir=gs://BUCKET/runs/r1"
# JAX discovers the slice itself on TPU VMs (jax.distributed.initialize() with no
# arguments), and the mesh follows the interconnect (mesh_utils.create_device_mesh).
# --config.workdir should be a gs:// path (hence the [gcp] extra: gcsfs for etils.epath)
# or a filesystem all workers share: Orbax writes one checkpoint from all workers, and
# worker 0 writes the run files.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# shellcheck source=/dev/null
. .venv/bin/activate
pip install -q -e ".[gcp]" "jax[tpu]>=0.10,<0.11"
CONFIG=${1:-configs/default.py}
shift || true
python -m jaxreplay.main --config "$CONFIG" --config.distributed.initialize=True "$@"
