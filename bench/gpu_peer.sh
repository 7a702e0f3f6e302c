#!/usr/bin/env bash
# One prepared GPU run for issue 39 (about 9 minutes on one H200, each step under its own
# timeout): the real model, SmolLM2-135M-Instruct (GGUF), on the same GPU as
#   1. bench/smollm2_probe.py: which arithmetic families it solves 10-40% of the time, graded
#      by the math reward, strictly (last \boxed{}) and leniently (last number); 300 held-out
#      questions each, at the preset's 128 new tokens;
#   2. bench/peer_trl.py: TRL's GRPOTrainer beside jaxreplay on configs/smollm2_135m.py,
#      on-policy, 20 steps each (torch CUDA vs JAX CUDA);
#   3. the probe again at 256 new tokens, if time is left.
# Runs under the machine's own python3 (JAX with CUDA, PyTorch, transformers). Carried (all
# ignored by git): .gpu/ (bench/gpu_session.sh's wheels), .gpu-peer/ (trl, datasets, dill,
# multiprocess wheels for Python 3.12), and the GGUF file in parts .gguf/{a,b,c}/part
# (98 MB: more than one device call carries, so the parts travel in three calls to a warm
# machine, this script in the last). Writes its logs and JSON to ${OUT:-/tmp}.
set -uo pipefail
OUT=${OUT:-/tmp}
BUDGET_S=${BUDGET_S:-540}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2 TOKENIZERS_PARALLELISM=false
# JAX and PyTorch take turns on the GPU: neither reserves it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$SECONDS

source bench/gpu_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpu-peer/*.whl 2>&1 | grep -v -i warning
python3 -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"

GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
cat .gguf/a/part .gguf/b/part .gguf/c/part >"$GGUF"
SUM=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [[ $(sha256sum "$GGUF" | cut -d' ' -f1) != "$SUM" ]]; then
  echo "the GGUF parts do not add up to the wheel's file (sha256 differs)"
  exit 1
fi
echo "=== GGUF assembled at $((SECONDS - start)) s"

step probe_128 150 60 python3 bench/smollm2_probe.py --path "$GGUF" --questions 300 \
  --max-new-tokens 128 --no-timing --out "$OUT/probe_128.json" | grep -v -i warning |
  tee "$OUT/probe_128.txt"
step peer_trl 330 150 python3 bench/peer_trl.py --steps 20 --set model.path="$GGUF" \
  --out "$OUT/peer_trl.json" | grep --line-buffered -v -i -E "warn|Converting|Loading weights" |
  tee "$OUT/peer_trl.txt"
step probe_256 120 60 python3 bench/smollm2_probe.py --path "$GGUF" --questions 300 \
  --max-new-tokens 256 --no-timing --out "$OUT/probe_256.json" | grep -v -i warning |
  tail -14 | tee "$OUT/probe_256.txt"
echo "=== done at $((SECONDS - start)) s"
