"""Where the suite's time goes: wall and CPU seconds per test, and how much of it is JAX compiling.

A pytest plugin and a report. Run the suite with it, then print the table::

  PYTHONPATH=tests python -m pytest tests -p compile_profile
  python tests/compile_profile.py            # per file, longest first

Each pytest process (every xdist worker) writes ``compile_profile_WORKER.json`` into
``$COMPILE_PROFILE_DIR`` (default ``.compile_profile/`` under the current directory): per test
id, its wall and CPU seconds and the durations JAX reports through ``jax.monitoring`` —
``/jax/core/compile/backend_compile_duration`` (XLA compiling one program),
``jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``, and the persistent compilation
cache's hits (``/jax/compilation_cache/compile_time_saved_sec``) — each summed, with its
count under ``NAME#n``. Compiles in processes a test starts (subprocess runs) are not seen:
their time shows as wall without CPU.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

BACKEND = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"

_totals: dict = collections.defaultdict(lambda: collections.defaultdict(float))
_current = {"id": "<between tests>"}


def _directory() -> str:
  return os.environ.get("COMPILE_PROFILE_DIR", ".compile_profile")


def _listener(event: str, duration: float, **_) -> None:
  entry = _totals[_current["id"]]
  entry[event] += duration
  entry[event + "#n"] += 1


def pytest_configure(config):
  """Registers the ``jax.monitoring`` listener (once per process)."""
  import jax.monitoring
  jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Attributes what happens during ``item`` (set-up, call, tear-down) to its id."""
  _current["id"] = item.nodeid
  wall, cpu = time.perf_counter(), time.process_time()
  yield
  entry = _totals[item.nodeid]
  entry["wall"] += time.perf_counter() - wall
  entry["cpu"] += time.process_time() - cpu
  _current["id"] = "<between tests>"


def pytest_sessionfinish(session, exitstatus):
  """Writes this process's totals (at session end: an xdist worker may be stopped before
  its ``pytest_unconfigure`` finishes)."""
  os.makedirs(_directory(), exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(os.path.join(_directory(), f"compile_profile_{worker}.json"), "w") as f:
    json.dump({k: dict(v) for k, v in _totals.items()}, f)


def by_file(directory: str) -> dict[str, collections.Counter]:
  """{test file: summed entries} over every ``compile_profile_*.json`` in ``directory``.

  Raises:
    FileNotFoundError: no profile in ``directory``.
  """
  paths = sorted(glob.glob(os.path.join(directory, "compile_profile_*.json")))
  if not paths:
    raise FileNotFoundError(f"no compile_profile_*.json in {directory!r}: run pytest with "
                            "-p compile_profile first")
  files: dict = collections.defaultdict(collections.Counter)
  for path in paths:
    with open(path) as f:
      for test_id, entry in json.load(f).items():
        files[test_id.split("::")[0]].update(entry)
  return files


def main(argv=None) -> int:
  directory = (argv or sys.argv[1:] or [_directory()])[0]
  files = by_file(directory)
  total = sum(files.values(), collections.Counter())
  print(f"{'file':48s} {'wall s':>7s} {'cpu s':>7s} {'compile s':>9s} {'compiles':>8s} "
        f"{'cache hits':>10s}")
  for name, e in sorted(files.items(), key=lambda kv: -kv[1]["wall"]) + [("total", total)]:
    print(f"{name:48s} {e['wall']:7.1f} {e['cpu']:7.1f} "
          f"{e[BACKEND] + e[TRACE] + e[LOWER]:9.1f} {int(e[BACKEND + '#n']):8d} "
          f"{int(e[SAVED + '#n']):10d}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
