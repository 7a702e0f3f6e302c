"""Qwen2.5-7B-Instruct on GSM8K-style word problems: a TPU pod slice or a multi-GPU host.

Loads a local Hugging Face checkpoint (``--config.model.path=/path/to/Qwen2.5-7B-Instruct``,
downloaded beforehand; nothing is fetched at run time). Parameters are laid out by the
partition rules in ``jaxreplay.parallel.sharding`` (fsdp × tensor); launch with
``launch/tpu_pod.sh`` or ``launch/gpu.sh``. Same task and reward as
``configs/qwen2_5_0_5b.py``; the replay shape is the paper's large-model setting scaled
to a pod: R = 512 rollouts per step (64 prompts × G = 8), B = 1024, N = 4096 (at most
7 versions stale).
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "qwen2_5_0_5b")
  c.workdir = "runs/qwen2_5_7b"
  c.sampler.max_new_tokens = 1024
  c.task.prompt_width = 384
  c.rollout.update(per_step=512, group_size=8)
  c.buffer.capacity = 4096
  c.train.update(steps=500, batch_size=1024)
  c.algo.update(lr=5e-7, num_minibatches=16)
  c.eval.update(every=50, num_examples=512)
  c.checkpoint.update(every=25, max_to_keep=3)
  return c
