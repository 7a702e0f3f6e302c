#!/usr/bin/env bash
# One prepared GPU check: generation throughput vs Hugging Face with the decode step against
# the HBM roofline, the engine's ragged-length ratios, learner-step MFU at Qwen2.5-0.5B
# shapes in bf16 with cuDNN's fused attention and with XLA's, and the attention alone. Runs
# under the machine's own python3 (JAX with CUDA);
# falls back to the pinned flax/optax/chex wheels carried in .gpu/wheels if the image's
# versions cannot import jaxreplay (make them here first, ignored by git:
# pip download --no-deps -d .gpu/wheels flax==0.12.8 optax==0.2.8 chex==0.1.92), and pass
# carry=[".gpu"] to the device tool. The image's JAX (0.11.2 when measured) is newer than
# pyproject's CPU pin. Writes its logs to ${OUT:-/tmp}. bench/gpu_session.sh runs these, trimmed,
# after the main job end to end and a paged-attention probe, in about 7 minutes.
set -uo pipefail
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax, chex; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
if ! python3 -c "from jaxreplay.models import Transformer; import jaxreplay.sampling, jaxreplay.rl.train_step" 2>$OUT/import_err.txt; then
  tail -3 $OUT/import_err.txt
  python3 -m pip install -q --no-deps --target /tmp/extra .gpu/wheels/*.whl && export PYTHONPATH=/tmp/extra
  python3 -c "import flax; print('using carried flax', flax.__version__)"
fi
Q="--layers 24 --hidden 896 --heads 14 --kv_heads 2 --ffn 4864 --vocab 151936 --dtype bfloat16"
timeout 300 python3 bench/generate.py $Q --batch 64 --prompt 128 --new 256 --rounds 3 2>&1 | grep -v Warning | tee $OUT/generate.txt
timeout 240 python3 bench/generate.py $Q --lengths realistic --scale 0.5 --slots 64 --rounds 2 2>&1 | grep -v Warning | tee $OUT/generate_realistic.txt
# the paged KV cache with JAX's Pallas (Triton) paged-attention kernel (sampler.attention='auto'):
# decode tokens/s and the decode step against the HBM roofline, then the ragged work ratios
timeout 240 python3 bench/generate.py $Q --batch 64 --prompt 128 --new 256 --rounds 3 --paged on --skip_hf 2>&1 | grep -v Warning | tee $OUT/generate_paged.txt
timeout 300 python3 bench/generate.py $Q --lengths realistic --scale 0.5 --slots 64 --rounds 2 --paged both 2>&1 | grep -v Warning | tee $OUT/generate_realistic_paged.txt
timeout 150 python3 bench/train_step.py --batch 16 --seq 512 2>&1 | tee $OUT/train_step.txt
timeout 120 python3 bench/train_step.py --batch 32 --seq 512 2>&1 | tail -9 | tee $OUT/train_step_b32.txt
# the learner's attention: cuDNN's fused kernel ('auto' above) against XLA's, and alone
timeout 150 python3 bench/train_step.py --batch 16 --seq 512 --attention xla 2>&1 | tail -9 | tee $OUT/train_step_xla.txt
timeout 120 python3 bench/fused_attention.py 2>&1 | tee $OUT/fused_attention.txt
