"""Preset: algo.loss=tis. Truncated importance sampling: the ratio capped at algo.is_cap and stopped from the gradient."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/tis"
  c.algo.loss = "tis"
  c.algo.advantage = "grpo"
  c.algo.is_cap = 2.0
  return c
