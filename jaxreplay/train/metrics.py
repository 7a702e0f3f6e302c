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
  """All records of ``RUN_DIR/metrics.jsonl`` in order."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
