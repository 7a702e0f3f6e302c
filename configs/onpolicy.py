"""On-policy baseline: the default with N = R = B (every rollout used exactly once)."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "jaxreplay_default_config", os.path.join(os.path.dirname(__file__), "default.py"))
_default = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_default)


def get_config():
  c = _default.get_config()
  c.workdir = "runs/onpolicy"
  c.rollout.per_step = 256  # R = B = N: every rollout trained on exactly once, fresh
  c.train.batch_size = 256
  c.buffer.capacity = 256
  return c
