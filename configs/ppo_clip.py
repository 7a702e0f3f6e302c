"""Preset: algo.loss=ppo_clip. The paper's objective: token-level clipped ratio against the stored behaviour log-prob (ε = 0.2)."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/ppo_clip"
  c.algo.loss = "ppo_clip"
  c.algo.advantage = "grpo"
  return c
