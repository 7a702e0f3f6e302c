"""Preset: algo.loss=gspo. GSPO: sequence-level ratio (geometric mean of token ratios), clipped."""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/gspo"
  c.algo.loss = "gspo"
  c.algo.advantage = "grpo"
  c.algo.eps_low = 3e-4
  c.algo.eps_high = 4e-4
  c.algo.aggregation = "seq_mean_token_mean"
  return c
