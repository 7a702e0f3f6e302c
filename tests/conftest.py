"""Test set-up: 8 fake CPU devices (for sharding tests), set before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_xdist_auto_num_workers(config):
  """Workers for ``-n auto`` (pyproject's addopts): one per core, at most 4. Each worker is a
  JAX process with 8 fake devices, and ``--dist loadfile`` keeps a file's module fixtures
  (a trained base policy, a sweep) in one worker; the cap bounds memory on many-core hosts
  (measured: 2 workers on 2 cores, 25.4 min against 34.0 min in one process)."""
  return max(1, min(os.cpu_count() or 1, 4))


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


def run_processes(script: str, args: list, n: int = 2, devices: int = 2, env: dict | None = None,
                  timeout_s: float = 600) -> list[str]:
  """Runs ``tests/SCRIPT PROCESS_ID N PORT *ARGS`` as ``n`` local JAX processes (``devices``
  fake CPU devices each, a free coordinator port) and waits for all of them.

  Returns:
    Each process's combined stdout and stderr.

  Raises:
    AssertionError: a process exited non-zero (its output's tail in the message).
    subprocess.TimeoutExpired: a process ran past ``timeout_s`` (all are killed).
  """
  import socket
  import subprocess
  import sys
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = str(sock.getsockname()[1])
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu", **(env or {}))
  procs = [subprocess.Popen([sys.executable, os.path.join(here, script), str(i), str(n), port,
                             *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(n)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
  return logs
