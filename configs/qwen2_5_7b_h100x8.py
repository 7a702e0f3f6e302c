"""Qwen2.5-7B-Instruct on GSM8K-style word problems: one 8-GPU H100/H200 node.

``python -m jaxreplay.main --config configs/qwen2_5_7b_h100x8.py
--config.model.path=/path/to/Qwen2.5-7B-Instruct`` (downloaded beforehand; nothing is fetched
at run time); several nodes: ``launch/slurm_gpu.sh`` (the fsdp axis spans every device).
Same task, reward and paper settings as ``configs/qwen2_5_0_5b.py`` (G = 16, 64 rollouts per
update, ε = 0.2, temperature 1.0, pass@1 at T = 0.1 / top-p 0.95) with the paper's 7B
learning rate: Adam at a constant 6.8e-8.

Layout: parameters and Adam state (float32, ~91 GB in all) fully sharded over the 8 GPUs
(mesh fsdp = 8), bf16 compute, layers scanned with full rematerialisation, log-probs over
the vocabulary in chunks of 256 positions, gradients accumulated over 8 micro-batches of
8 rows (one per GPU); the rescoring of behaviour log-probs, the drift monitor (64 items
every 10 steps) and the held-out entropy score in those rows and chunks too.
``bench/memory_plan.py --config configs/qwen2_5_7b_h100x8.py --devices 8 --chip h100``
(XLA:CPU's memory analysis of the compiled learner step, sampler, rescoring, drift
monitor and evaluation; not measured on a GPU):
  per device, GB        args      out  aliased     temp    total   +resident
    learner         11.43    11.43    11.43    16.87    28.30      28.30
    sampler          4.46     0.65     0.65     4.36     8.82      16.44
    rescoring        3.81     0.00     0.00     3.75     7.55      15.18
    drift            3.81     0.00     0.00     5.77     9.58      17.20
    eval sampler     6.45     2.64     2.64     7.94    14.38      22.01
    eval entropy     3.81     0.00     0.00     3.75     7.56      15.18
    train state 11.43 GB (parameters 3.81), buffer 0.00 GB
    +resident: total + the state and buffer not among the program's arguments (sampler: 7.62 GB)
  peak per device: 28.30 GB of 80 GB (35%); fits JAX's pool 0.75 x 80 = 60.0 GB with 20%
    headroom (<= 48.0 GB): yes
(``--chip h200``: the same 28.30 GB of 141 GB.)
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_0_5b")
  c.workdir = "runs/qwen2_5_7b"
  c.sampler.max_new_tokens = 1024
  c.task.prompt_width = 384
  c.algo.update(lr=6.8e-8, grad_accum_steps=8, logprob_chunk=256)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.drift.update(every=10, num_samples=64)  # a quarter of the buffer, 8 rows at a time
  c.eval.update(every=50, num_examples=512)
  c.checkpoint.update(every=25, max_to_keep=3)
  return c
