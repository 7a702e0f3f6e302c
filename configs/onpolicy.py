"""On-policy baseline: the default with N = R = B (every rollout used exactly once)."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/onpolicy"
  c.rollout.per_step = 256  # R = B = N: every rollout trained on exactly once, fresh
  c.train.batch_size = 256
  c.buffer.capacity = 256
  return c
