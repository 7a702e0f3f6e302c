"""Preset: algo.loss=decoupled. Decoupled PPO: behaviour correction plus a proximal trust region (two optimizer steps per learner step)."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/decoupled"
  c.algo.loss = "decoupled"
  c.algo.advantage = "grpo"
  c.algo.update_epochs = 2
  return c
