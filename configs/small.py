"""A small, fast variant of the default for tests and quick CPU checks (~2 min on 2 cores).

Smaller decoder (3 layers × 96), smaller splits, 400 warm-start steps, 80 RL steps.
"""

from jaxreplay.config import sibling_config


def get_config():
  c = sibling_config(__file__, "default")
  c.workdir = "runs/small"
  c.task.train_size = 5000
  c.task.heldout_size = 400
  c.model.update(d_model=96, n_layers=3, n_heads=3, n_kv_heads=1, head_dim=32, d_ff=288)
  c.warmstart.steps = 400
  c.warmstart.lr = 3e-3
  c.algo.lr = 3e-4
  c.train.steps = 80
  c.eval.every = 40
  c.eval.num_examples = 256
  c.eval.samples_per_example = 4
  c.checkpoint.every = 40
  return c
