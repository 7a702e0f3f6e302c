"""Metric sinks: one JSON object per line in ``RUN_DIR/metrics.jsonl``, plus TensorBoard."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def _clean(v: Any):
  try:
    f = float(v)
  except (TypeError, ValueError):
    return v
  if math.isnan(f) or math.isinf(f):
    return str(f)
  return int(f) if isinstance(v, (int,)) and not isinstance(v, bool) else f


class MetricWriter:
  """Appends per-step metric dicts to JSONL and (optionally) TensorBoard.

  Args:
    run_dir: directory; creates ``metrics.jsonl`` (appended on resume) and ``tb/``.
    tensorboard: also write TensorBoard scalars via tensorboardX.
  """

  def __init__(self, run_dir: str, tensorboard: bool = True):
    os.makedirs(run_dir, exist_ok=True)
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._f = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Writes one record ``{"step": step, **metrics}`` (floats; NaN/inf as strings)."""
    rec = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and k != "step":
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The records of ``RUN_DIR/metrics.jsonl`` by step, the last one written per step.

  A run resumed after a crash recomputes (identically) the steps after its last
  checkpoint and appends them again; the later record of a step wins.

  Raises:
    FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl (is it a jaxreplay run directory?)")
  by_step: dict = {}
  with open(path) as f:
    for i, line in enumerate(f):
      if line.strip():
        rec = json.loads(line)
        by_step[rec.get("step", -1 - i)] = rec
  return [by_step[k] for k in sorted(by_step)]
