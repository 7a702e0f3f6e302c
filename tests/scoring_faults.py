"""Reward functions that break their scoring worker on purpose (importable by the worker
processes of ``jaxreplay.tasks.scoring``, which get the test process's ``sys.path``)."""

import math
import os
import time

from jaxreplay.tasks.math_answer import MathReward


class FaultyReward:
  """By completion text: "crash" kills the worker mid-call (as a segfault or the OOM killer
  would), "hang" never returns, "raise" raises, "nan" returns NaN; otherwise 1.0 for "ok"
  and 0.0 for anything else."""

  def __call__(self, text, example):
    if text == "crash":
      os._exit(3)
    if text == "hang":
      time.sleep(3600)
    if text == "raise":
      raise RuntimeError("scorer bug")
    if text == "nan":
      return math.nan
    return float(text == "ok")


class GatedReward(FaultyReward):
  """``FaultyReward`` whose worker stays starting (in ``warm_up``, not yet ready) until the
  file ``DIR/go`` exists, so that a test can kill it while it starts, however fast the
  machine (at most 600 s, then it starts anyway)."""

  def __init__(self, directory):
    self.directory = directory

  def warm_up(self):
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(self.directory, "go")) and time.monotonic() < deadline:
      time.sleep(0.01)


class OneShotFaults(MathReward):
  """``MathReward``, except that the first call to find ``DIR/crash`` kills its worker and
  the first to find ``DIR/hang`` never returns (each file is removed first, so each fault
  happens once per run whatever the completions are)."""

  def __init__(self, directory):
    self.directory = directory

  def __call__(self, completion, example):
    for fault in ("crash", "hang"):
      path = os.path.join(self.directory, fault)
      try:
        os.remove(path)
      except FileNotFoundError:
        continue
      if fault == "crash":
        os._exit(3)
      time.sleep(3600)
    return super().__call__(completion, example)


class FaultyGrades(MathReward):
  """``MathReward`` whose graders fail on purpose, by completion text: ``strict`` kills its
  worker mid-call (as a segfault or the OOM killer would) on a completion containing
  "crash", and ``lenient`` raises on one containing "raise"; otherwise they grade as
  ``MathReward``'s do."""

  def strict(self, completion, example):
    if "crash" in completion:
      os._exit(3)
    return super().strict(completion, example)

  def lenient(self, completion, example):
    if "raise" in completion:
      raise RuntimeError("grader bug")
    return super().lenient(completion, example)
