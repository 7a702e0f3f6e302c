"""Preset: algo.loss=reinforce. REINFORCE with group-normalised advantages and no ratio (on-policy reference)."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/reinforce"
  c.algo.loss = "reinforce"
  c.algo.advantage = "grpo"
  return c
