"""Qwen2.5-7B-Instruct with LoRA adapters on one H200 GPU: learner and sampler on the one device.

``python -m jaxreplay.main --config configs/qwen2_5_7b_lora_h200.py
--config.model.path=/path/to/Qwen2.5-7B-Instruct``. Task, reward, G = 16, R = B = 64,
N = 256, sequence widths (384 prompt + 1,024 completion tokens) and evaluation of
``configs/qwen2_5_7b_h100x8.py``; only rank-8 adapters on every block linear layer train
(``model.lora``, ``jaxreplay/models/lora.py``; alpha 32), the base stays frozen.

Memory: the frozen base in bfloat16 (15.2 GB), 20.19M float32 adapter parameters (0.08 GB),
the only ones with Adam state (0.16 GB) and gradients;
layers scanned with full rematerialisation, log-probs in chunks of 256 positions, gradients
accumulated over 8 micro-batches of 8 rows. The held-out evaluation decodes 64 rows at a time
(``eval.batch_rows``; 256 planned at 109.02 GB, past the pool).
``bench/memory_plan.py --config configs/qwen2_5_7b_lora_h200.py --devices 1 --chip h200``
(XLA:CPU's memory analysis of the compiled learner step, sampler, rescoring, drift
monitor and evaluation; not measured on a GPU; 2026-12-05):
  per device, GB        args      out  aliased     temp    total   +resident
    learner         15.48    15.48    15.48    49.00    64.48      64.48
    sampler         20.52     5.21     5.21    41.67    62.19      62.35
    rescoring       15.31     0.00     0.00    36.79    52.10      52.27
    drift           15.32     0.00     0.00    36.79    52.10      52.27
    eval sampler    20.55     5.24     5.24    41.67    62.22      62.39
    eval entropy    15.31     0.00     0.00    36.79    52.10      52.27
    train state 15.47 GB (parameters 15.31), buffer 0.00 GB
    +resident: total + the state and buffer not among the program's arguments (sampler: 0.17 GB)
  peak per device: 64.48 GB of 141 GB (46%); fits JAX's pool 0.75 x 141 = 105.8 GB with 20%
    headroom (<= 84.6 GB): yes
  (33.85 GB without XLA:CPU's float32 copies of the bf16 weights for its dots, which a GPU
  does not make.)

Split 1/1 on two H200s (``--devices 2 --set train.mode=async --set
mesh.generator_devices=1 --set rollout.behaviour_logprobs=sampler``, same machine and date):
learner mesh peak 64.48 GB (learner step; the first publish's base gather 30.63 GB, every
later one 0.29 GB), generator mesh 62.27 GB (sampler, beside 0.04 GB of next adapters);
both fit the same 84.6 GB.
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_7b_h100x8")
  c.workdir = "runs/qwen2_5_7b_lora_h200"
  # The frozen base never takes an optimizer step, so bfloat16 (15.2 GB) loses nothing a
  # float32 master copy would keep; the adapters are float32 whatever this says.
  c.model.param_dtype = "bfloat16"
  c.model.lora.update(rank=8, alpha=32.0)
  # LoRA's best learning rate is about 10x full fine-tuning's (Schulman et al. 2025, "LoRA
  # Without Regret"): 10 x the 7B preset's 6.8e-8.
  c.algo.lr = 6.8e-7
  c.mesh.update(data=1, fsdp=1, tensor=1)
  # The evaluation engine's KV cache beside the learner's state: 256 slots of 1,408
  # positions take 20.9 GB and lift the peak past the pool (109.02 GB planned); 64 slots
  # take the sampler's 5.2 GB (the held-out requests then decode 64 at a time).
  c.eval.batch_rows = 64
  return c
