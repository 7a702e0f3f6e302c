"""Test set-up: 8 fake CPU devices (for sharding tests), set before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def load_bench(name: str):
  """The module ``bench/NAME.py`` (bench/ is scripts, not a package)."""
  import importlib.util
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                      name + ".py")
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# The job's entry points take a validated ``RunConfig``; tests build config trees, so these
# validate first, as ``python -m jaxreplay.main`` does.
def run(cfg, log=print):
  """``jaxreplay.train.loop.run`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  return loop.run(config_lib.validate(cfg), log)


def restore(cfg, log=print):
  """``jaxreplay.train.loop.restore`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  return loop.restore(config_lib.validate(cfg), log)


def build(cfg, log=print):
  """``jaxreplay.train.build.build`` of a config tree (validated first)."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import build as build_lib
  return build_lib.build(config_lib.validate(cfg), log)
