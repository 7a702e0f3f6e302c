"""SIGKILL at any point, then the same command again, until done: the final train state,
buffer and RNG equal those of an uninterrupted run bit for bit (synchronous loop, CPU).

One run is killed at six points: while the base-policy cache is being written (before any
checkpoint exists), while an async Orbax save is in flight (twice, via the test-only
``JAXREPLAY_FAULT`` hook), and by the parent at random-ish times (during start-up, and
twice between steps). After each kill the leftovers are checked: no half-written cache
entry or checkpoint is ever read.
"""

import glob
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from conftest import xla_flags
from jaxreplay.train.metrics import has_metrics, read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12
OVERRIDES = [
    "task.train_size=400", "task.heldout_size=100",
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
    "model.head_dim=16", "model.d_ff=64", "warmstart.steps=20", "warmstart.batch_size=32",
    "rollout.per_step=16", "rollout.group_size=4", "train.batch_size=16", "buffer.capacity=32",
    "algo.warmup_steps=1", "algo.entropy_coef=0.01", f"train.steps={STEPS}",
    "eval.every=4", "eval.num_examples=8", "eval.samples_per_example=1",
    "checkpoint.every=1", "checkpoint.max_to_keep=3", "log.progress=False",
    "log.tensorboard=False",
]


def _cmd(workdir, cache):
  return [sys.executable, "-m", "jaxreplay.main", "--config", os.path.join(ROOT, "configs",
                                                                           "small.py"),
          f"--config.workdir={workdir}", f"--config.warmstart.cache_dir={cache}",
          *[f"--config.{o}" for o in OVERRIDES]]


def _env(tmp, fault=None):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(1),
             JAX_COMPILATION_CACHE_DIR=str(tmp / "xla_cache"),  # later starts compile less
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1")
  env.pop("JAXREPLAY_FAULT", None)
  if fault:
    env["JAXREPLAY_FAULT"] = fault
  return env


def _run(tmp, workdir, cache, fault=None):
  p = subprocess.run(_cmd(workdir, cache), env=_env(tmp, fault), capture_output=True, text=True,
                     timeout=300, cwd=ROOT)
  return p.returncode, p.stdout + p.stderr


def _steps_logged(workdir):
  if not has_metrics(workdir):
    return []
  return [r["step"] for r in read_records(workdir)]


def _kill_when(tmp, workdir, cache, until, delay=0.0):
  """Starts the run and SIGKILLs it ``delay`` s after ``until(workdir, output)`` holds
  (``output``: what the run has printed so far); returns (rc, output)."""
  p = subprocess.Popen(_cmd(workdir, cache), env=_env(tmp), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, cwd=ROOT)
  lines = []

  def read():
    for line in p.stdout:
      lines.append(line)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  deadline = time.monotonic() + 240  # a hung run fails the checks below instead of the suite
  while not until(workdir, "".join(lines)) and p.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  time.sleep(delay)
  p.send_signal(signal.SIGKILL)
  p.wait(timeout=60)
  reader.join(timeout=60)
  return p.returncode, "".join(lines)


def _complete_steps(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def _in_flight_dir(log, step):
  """The temporary directory the ``kill_during_save:STEP`` fault saw (from its message)."""
  m = re.search(rf"fault kill_during_save:{step}: SIGKILL \(save in flight: (\S+) existed\)", log)
  assert m, log[-2000:]
  return m.group(1)


def _final_state(workdir):
  from jaxreplay.train import checkpoint as ckpt
  mgr = ckpt.make_manager(os.path.join(workdir, "checkpoints"), 3)
  assert mgr.latest_step() == STEPS
  out = mgr.restore(STEPS, args=ckpt.ocp.args.Composite(state=ckpt.ocp.args.StandardRestore(),
                                                         meta=ckpt.ocp.args.JsonRestore()))
  return out.state, out.meta


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_gives_identical_final_state(tmp_path):
  t_start = time.time()
  rng = random.Random(0)
  cache, wd, ref = tmp_path / "cache", tmp_path / "run", tmp_path / "ref"
  timings = {}

  # 1. killed while writing the base-policy cache: parameters saved, info.json not yet;
  #    no checkpoint exists.
  rc, log = _run(tmp_path, wd, cache, "kill_during_cache_write")
  assert rc == -signal.SIGKILL, log[-2000:]
  (entry,) = glob.glob(str(cache / "*"))
  assert os.path.isdir(os.path.join(entry, "params"))
  assert not os.path.exists(os.path.join(entry, "info.json"))
  assert not os.path.exists(wd / "checkpoints") or not _complete_steps(wd)
  timings["cache_kill"] = time.time() - t_start

  # 2. restarts cleanly (trains the base policy again, writes a complete cache entry), then
  #    is killed while the async save of step 2 is in flight.
  rc, log = _run(tmp_path, wd, cache, "kill_during_save:2")
  assert rc == -signal.SIGKILL, log[-2000:]
  assert "saved base policy" in log
  assert os.path.exists(os.path.join(entry, "info.json"))
  assert _complete_steps(wd) == [1]  # step 2 never became a checkpoint directory
  assert _in_flight_dir(log, 2) in os.listdir(wd / "checkpoints")  # its half-written one
  timings["save_kill_2"] = time.time() - t_start

  # 3. a real kill during start-up (Python/JAX import, task, restore), before any step: at a
  #    random-ish moment, or as soon as the run says it resumed if that comes first
  logged = _steps_logged(wd)
  kill_at = time.monotonic() + rng.uniform(0.5, 1.5)
  rc, log = _kill_when(tmp_path, wd, cache,
                       lambda w, out: time.monotonic() > kill_at or "resumed from" in out)
  assert rc == -signal.SIGKILL, log[-2000:]
  assert _complete_steps(wd) == [1] and _steps_logged(wd) == logged

  # 4. a real kill once step 4 is logged and step 3's checkpoint is complete (this run
  #    starts at step 2): it lands in step 4's save or step 5, wherever the run then is
  rc, log = _kill_when(tmp_path, wd, cache,
                       lambda w, out: max(_steps_logged(w), default=0) >= 4
                       and max(_complete_steps(w), default=0) >= 3)
  assert rc == -signal.SIGKILL, log[-2000:]
  assert "loaded base policy" in log and "resumed" in log and "at step 1" in log
  killed_at = max(_complete_steps(wd))
  assert 3 <= killed_at <= STEPS - 3, killed_at  # step 4's save may be done, or not
  timings["real_kill_4"] = time.time() - t_start

  # 5. killed while the async save of step killed_at + 2 is in flight
  target = killed_at + 2
  rc, log = _run(tmp_path, wd, cache, f"kill_during_save:{target}")
  assert rc == -signal.SIGKILL, log[-2000:]
  assert f"at step {killed_at}" in log
  assert max(_complete_steps(wd)) == target - 1
  # the half-written checkpoint directory of the save in flight is there ...
  assert _in_flight_dir(log, target) in os.listdir(wd / "checkpoints")

  # 6. a real kill at a random-ish moment after this run has logged one step
  n0 = len(_steps_logged(wd))
  rc, log = _kill_when(tmp_path, wd, cache, lambda w, out: len(_steps_logged(w)) > n0,
                       rng.uniform(0, 0.2))
  assert rc in (-signal.SIGKILL, 0), log[-2000:]  # it may just have finished
  # ... and ignored: the run resumed from the last complete checkpoint
  assert f"at step {target - 1}" in log
  timings["real_kill_6"] = time.time() - t_start

  # 7. the same command until it completes
  rc, log = _run(tmp_path, wd, cache)
  assert rc == 0, log[-3000:]
  assert not [d for d in os.listdir(wd / "checkpoints") if not d.isdigit()]  # tmp dirs cleaned
  timings["resumed_to_end"] = time.time() - t_start

  # the uninterrupted reference, from the same cached base policy
  rc, log = _run(tmp_path, ref, cache)
  assert rc == 0 and "loaded base policy" in log, log[-3000:]
  timings["reference"] = time.time() - t_start

  a, meta_a = _final_state(wd)
  b, meta_b = _final_state(ref)
  leaves_a = jax.tree_util.tree_leaves_with_path(a)
  leaves_b = jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b] and len(leaves_a) > 20
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
  assert meta_a["counts"] == meta_b["counts"] and meta_a["data_position"] == meta_b["data_position"]
  assert meta_a["last_eval"] == meta_b["last_eval"]
  # and the parameters did move during RL (the comparison is not of two base policies)
  first = jax.tree.leaves(_oldest_params(wd))
  assert any(not np.array_equal(x, y) for x, y in zip(first, jax.tree.leaves(a["train"]["params"])))
  print("kill test timings (s, cumulative):", {k: round(v, 1) for k, v in timings.items()})


def _oldest_params(workdir):
  """Parameters of the oldest checkpoint kept (step STEPS - 2)."""
  from jaxreplay.train import checkpoint as ckpt
  mgr = ckpt.make_manager(os.path.join(workdir, "checkpoints"), 3)
  s = min(mgr.all_steps())
  assert s == STEPS - 2
  return mgr.restore(s, args=ckpt.ocp.args.Composite(
      state=ckpt.ocp.args.StandardRestore())).state["train"]["params"]
