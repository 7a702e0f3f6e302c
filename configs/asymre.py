"""Preset: algo.loss=asymre. AsymRE (the paper's §5.5 variant): (r − (V̂ + δV))·log π, no ratio, δV = −0.1."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/asymre"
  c.algo.loss = "asymre"
  c.algo.advantage = "dr_grpo"
  c.algo.delta_v = -0.1
  return c
