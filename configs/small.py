"""A small, fast variant of the default for tests and quick CPU checks (~2 min on 2 cores).

Smaller decoder (3 layers × 96), smaller splits, 400 warm-start steps, 80 RL steps.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "jaxreplay_default_config", os.path.join(os.path.dirname(__file__), "default.py"))
_default = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_default)


def get_config():
  c = _default.get_config()
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
