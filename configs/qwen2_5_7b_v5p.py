"""Qwen2.5-7B-Instruct on GSM8K-style word problems: a TPU v5p slice (v5p-8, 4 chips).

``launch/tpu_pod.sh configs/qwen2_5_7b_v5p.py --config.model.path=/path/to/Qwen2.5-7B-Instruct``.
Everything as ``configs/qwen2_5_7b_h100x8.py`` (the paper's settings, Adam at a constant
6.8e-8) on a v5p mesh: parameters and Adam state fully sharded over the slice's chips
(fsdp spans every device, so larger slices shard further), gradients accumulated over 16
micro-batches of 4 rows (one per chip).
``bench/memory_plan.py --config configs/qwen2_5_7b_v5p.py --devices 4 --chip v5p``
(XLA:CPU's memory analysis of the compiled learner step, sampler, rescoring, drift
monitor and evaluation; not measured on a TPU):
  per device, GB        args      out  aliased     temp    total   +resident
    learner         22.85    22.85    22.85    24.76    47.61      47.61
    sampler          8.92     1.30     1.30     5.40    14.31      29.55
    rescoring        7.62     0.00     0.00     2.35     9.96      25.20
    drift            7.62     0.00     0.00     3.46    11.08      26.32
    eval sampler    12.86     5.24     5.24    13.15    26.00      41.24
    eval entropy     7.62     0.00     0.00     2.35     9.96      25.20
    train state 22.85 GB (parameters 7.62), buffer 0.00 GB
    +resident: total + the state and buffer not among the program's arguments (sampler: 15.24 GB)
  peak per device: 47.61 GB of 95 GB (50%); fits 95 GB with 20% headroom (<= 76.0 GB): yes
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_7b_h100x8")
  c.workdir = "runs/qwen2_5_7b_v5p"
  c.algo.grad_accum_steps = 16
  return c
