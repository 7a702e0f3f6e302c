"""Qwen2.5-7B-Instruct, actor–learner split W/T = 6/2 on one node of 8 H200 GPUs (on H100: below).

``python -m jaxreplay.main --config configs/qwen2_5_7b_h200x8_split.py
--config.model.path=/path/to/Qwen2.5-7B-Instruct``. Task, model, G = 16, R = B = 64, N = 256
and learning rate of ``configs/qwen2_5_7b_h100x8.py``, with generation moved off the learner
(``train.mode='async'``, ``jaxreplay/train/split.py``): each node's last W = 6 GPUs generate
(``mesh.generator_devices``), each with a whole bfloat16 inference copy
(``mesh.generator_tensor=1``: data parallel, no tensor parallel, as in the paper; six
replicas that decode independently, gathering no weight per decode step); the other T = 2
train, parameters and Adam state sharded over them (learner mesh data=1, fsdp=-1). 6/2 is
the paper's most used split (Arnal et al. 2026; γ = 0.65 at Qwen2.5-7B's μ = 5.28).

Settings the split needs or suggests:

* ``train.weight_sync_every=2``: the paper's workers take new weights "every few steps"
  (interval not stated). Each publish streams a whole bf16 replica (15.2 GB) to the 6
  generator GPUs, one block (a layer's tensor, or the embedding) at a time from both learner
  GPUs in turn, and after a swap the generator
  re-prefills its decoding slots; every 2 steps halves that work while the sampling policy
  stays within about 2 versions of the learner's, small against the buffer's horizon.
* ``rollout.behaviour_logprobs='sampler'``: the generator has no learner forward to
  rescore with (the split refuses ``'learner'``), so in bfloat16 a fresh rollout's ratio is
  close to 1, not exactly 1 (``bench/bf16_ratio.py``); each token keeps the version that
  sampled it, so the ratio stays per token when weights swap mid-rollout.
* ``algo.kl_coef=0`` (the base's): no frozen reference is needed during generation.
* ``rate_limiter.samples_per_insert=1.75`` ≈ μ·T/W with the paper's μ = 5.28: the replay
  ratio at which neither side waits when a rollout costs μ trained sequences (the paper:
  average replay ≈ μT/W); the base's B/R = 1 would leave the learner idle ~40% at that μ.
  Re-tune from a run: lower it when the metrics' ``generator_idle`` exceeds
  ``learner_idle``, raise it in the opposite case (μ of this engine: the ledger's
  ``mu_flops``/``mu_time``). At 1.75 a rollout stays N/R = 4 rounds ≈ 7 learner steps.

``bench/memory_plan.py --config configs/qwen2_5_7b_h200x8_split.py --devices 8 --chip h200``
(XLA:CPU's memory analysis of each sub-mesh's compiled programs; not measured on a GPU):
  learner mesh (2 devices):
  per device, GB        args      out  aliased     temp    total   +resident
    learner         45.70    45.70    45.70    44.61    90.31      90.31
    weight sync      1.09     1.09     0.00     2.18     4.36      34.83
    drift           15.24     0.00     0.00     6.94    22.18      52.64
    eval sampler    25.68    10.45    10.45    23.56    49.24      79.71
    eval entropy    15.23     0.00     0.00     4.74    19.97      50.44
    learner mesh peak per device: 90.31 GB of 141 GB (64%); fits JAX's pool 0.9 x 141 =
      126.9 GB with 20% headroom (<= 101.5 GB): yes
  generator mesh (6 devices; inference copy in bfloat16, 15.23 GB per device):
    sampler         16.13     0.90     0.90    33.11    49.24      64.47
    generator mesh peak per device: 64.47 GB of 141 GB (46%); fits JAX's pool 0.9 x 141 =
      126.9 GB with 20% headroom (<= 101.5 GB): yes
  (2.18 GB of the weight sync's temp and 30.46 GB of the sampler's are XLA:CPU's float32
  copies of bf16 weights, which a GPU does not make: 90.31 and 34.01 GB without them.)

On one H100 node (80 GB) the 2-GPU learner does not fit on any backend: its float32
parameters and Adam state are 45.7 GB per GPU and the step adds the float32 gradient and
its accumulator (90.31 GB). On H100s run 6/2 per node on two nodes (``launch/slurm_gpu.sh``;
the learner's fsdp spans 4 GPUs; ``--devices 16 --processes 2 --chip h100``: learner step
49.04 GB, generator 32.79 GB without XLA:CPU's float32 copies — 63.26 GB with them, which the
plan's verdict counts and which does not fit its 57.6 GB bound —, the weight sync 19.05 GB
with the resident state), or 4/4 on one node (``--config.mesh.generator_devices=4``: the same learner figures).
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_7b_h100x8")
  c.workdir = "runs/qwen2_5_7b_split"
  # The learner mesh's plan peaks at 90.31 GB (above); JAX's default GPU pool, 0.75 x 141 =
  # 105.75 GB, would leave it 15% headroom, 0.9 (126.9 GB) leaves 29%, above the plan's 20%.
  c.train.update(mode="async", weight_sync_every=2, device_memory_fraction=0.9)
  c.mesh.update(data=1, fsdp=-1, tensor=1, generator_devices=6, generator_tensor=1)
  c.rollout.behaviour_logprobs = "sampler"
  c.algo.update(kl_coef=0.0, kl_mode="loss")
  c.rate_limiter.samples_per_insert = 1.75
  return c
