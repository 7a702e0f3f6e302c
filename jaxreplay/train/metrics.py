"""Metric sinks: one JSON object per line in ``RUN_DIR/metrics.jsonl``, plus TensorBoard."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from etils import epath


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

  In a multi-process job every process builds one, and only process 0's writes
  (``primary``); the others' methods do nothing, so each record is written once.

  Args:
    run_dir: directory (local or an ``etils.epath`` URL); creates ``metrics.jsonl``
      (appended on resume) and ``tb/``.
    tensorboard: also write TensorBoard scalars via tensorboardX.
    primary: whether this process writes (default: ``jax.process_index() == 0``).
  """

  def __init__(self, run_dir, tensorboard: bool = True, primary: bool | None = None):
    if primary is None:
      import jax
      primary = jax.process_index() == 0
    self.primary = primary
    self.path = epath.Path(run_dir) / "metrics.jsonl"
    self._f = self._tb = None
    if not primary:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._f = self.path.open("a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(epath.Path(run_dir) / "tb"))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Writes one record ``{"step": step, **metrics}`` (floats; NaN/inf as strings)."""
    if self._f is None:
      return
    rec = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and k != "step":
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    """Closes the files (idempotent)."""
    if self._f is not None:
      self._f.close()
      self._f = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


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
