"""Metric sinks: JSON records in ``RUN_DIR/metrics/`` (files an object store accepts), plus
TensorBoard; and ``read_metrics``, the one reader every consumer uses.

Layout: ``RUN_DIR/metrics/000000.jsonl``, ``000001.jsonl``, ... — numbered chunk files of
at most ``MetricWriter.chunk_records`` records each, one JSON object per line, in write
order. A chunk is rewritten whole from the writer's buffer on every record (local files:
a temporary file renamed over it; ``gs://`` and other ``etils.epath`` URLs: one object
upload, all or nothing), so nothing is ever appended to — object stores do not support
appending — and a crash leaves every chunk whole. A resumed run starts a new chunk after
the highest one present. Runs written before this layout hold one ``RUN_DIR/metrics.jsonl``;
``read_metrics`` reads it first, then the chunks.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent import futures
from typing import Any

from etils import epath

from jaxreplay import storage

METRICS_DIR = "metrics"
LEGACY_FILE = "metrics.jsonl"
_CHUNK = re.compile(r"^(\d+)\.jsonl$")


def _clean(v: Any):
  try:
    f = float(v)
  except (TypeError, ValueError):
    return v
  if math.isnan(f) or math.isinf(f):
    return str(f)
  return int(f) if isinstance(v, (int,)) and not isinstance(v, bool) else f


def chunk_files(run_dir: str | os.PathLike) -> list[epath.Path]:
  """The metric chunk files of a run, in write order.

  Args:
    run_dir: run directory (local path or ``etils.epath`` URL such as ``gs://b/run``).

  Returns:
    ``RUN_DIR/metrics.jsonl`` (a run of the old layout) if present, then the files
    ``RUN_DIR/metrics/NNNNNN.jsonl`` sorted by their number; other names there (temporary
    files of an interrupted write) are skipped. Empty when the run has no metrics.
  """
  root = epath.Path(run_dir)
  out = [root / LEGACY_FILE] if (root / LEGACY_FILE).exists() else []
  d = root / METRICS_DIR
  if d.is_dir():
    numbered = [(int(m.group(1)), p) for p in d.iterdir() if (m := _CHUNK.match(p.name))]
    out += [p for _, p in sorted(numbered, key=lambda t: t[0])]
  return out


def has_metrics(run_dir: str | os.PathLike) -> bool:
  """Whether ``run_dir`` holds any metric file (either layout): a run that has started.

  Args:
    run_dir: run directory (local path or ``etils.epath`` URL).

  Returns:
    bool.
  """
  return bool(chunk_files(run_dir))


def read_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
  """Every record of the run in write order, repeats included (a resumed run writes the
  steps after its last checkpoint again).

  Chunks are read concurrently (an object store answers each in one round trip); a line
  that is not a whole JSON object — the tail of ``metrics.jsonl`` of an old-layout run
  killed mid-write — is skipped.

  Args:
    run_dir: run directory (local path or ``etils.epath`` URL).

  Returns:
    list of dicts, each with ``"step"`` (int) and the metrics of that write.

  Raises:
    FileNotFoundError: the run holds no metrics (neither ``metrics/`` nor ``metrics.jsonl``).
  """
  files = chunk_files(run_dir)
  if not files:
    raise FileNotFoundError(f"{run_dir} holds no {METRICS_DIR}/ nor {LEGACY_FILE} "
                            "(is it a jaxreplay run directory?)")
  with futures.ThreadPoolExecutor(min(16, len(files))) as pool:
    texts = list(pool.map(lambda p: p.read_text(), files))
  recs = []
  for text in texts:
    for line in text.splitlines():
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(rec, dict):
        recs.append(rec)
  return recs


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
  """The run's records by step, the last one written per step: what every consumer of a
  run's metrics (report, plot, sweep, theory, bench) reads.

  A run resumed after a crash recomputes (identically) the steps after its last
  checkpoint and writes them again; the later record of a step wins.

  Args:
    run_dir: run directory (local path or ``etils.epath`` URL).

  Returns:
    list of dicts sorted by ``"step"`` (records without a step keep their write order,
    before the rest).

  Raises:
    FileNotFoundError: the run holds no metrics.
  """
  by_step: dict = {}
  for i, rec in enumerate(read_records(run_dir)):
    by_step[rec.get("step", -10**9 + i)] = rec
  return [by_step[k] for k in sorted(by_step)]


class MetricWriter:
  """Writes per-step metric dicts as chunk files under ``RUN_DIR/metrics/`` and (optionally)
  TensorBoard scalars. Works on local paths and on object stores (``gs://``): no file is
  ever appended to or left half-written.

  In a multi-process job every process builds one, and only process 0's writes
  (``primary``); the others' methods do nothing, so each record is written once.

  Args:
    run_dir: directory (local or an ``etils.epath`` URL); creates ``metrics/`` and ``tb/``.
      A resumed run's writer starts at the chunk after the highest one present.
    tensorboard: also write TensorBoard scalars via tensorboardX (``gs://`` needs
      ``google-cloud-storage``).
    primary: whether this process writes (default: ``jax.process_index() == 0``).
    chunk_records: records per chunk file (>= 1). Every record rewrites its chunk, so a
      chunk costs O(chunk_records²) bytes written; a run of S steps leaves about
      S / chunk_records files.

  Raises:
    ValueError: ``chunk_records`` < 1.
  """

  def __init__(self, run_dir, tensorboard: bool = True, primary: bool | None = None,
               chunk_records: int = 100):
    if chunk_records < 1:
      raise ValueError(f"MetricWriter chunk_records={chunk_records}: must be >= 1")
    if primary is None:
      import jax
      primary = jax.process_index() == 0
    self.primary = primary
    self.chunk_records = chunk_records
    self.dir = epath.Path(run_dir) / METRICS_DIR
    self._lines: list[str] = []
    self._chunk = 0
    self._active, self._tb = False, None
    if not primary:
      return
    self.dir.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in self.dir.iterdir() if (m := _CHUNK.match(p.name))]
    self._chunk = max(numbers, default=-1) + 1
    self._active = True
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(epath.Path(run_dir) / "tb"))

  @property
  def active(self) -> bool:
    """Whether ``write`` writes: this process is the primary one and ``close`` not called."""
    return self._active

  @property
  def path(self) -> epath.Path:
    """The chunk file the next record goes to (``RUN_DIR/metrics/NNNNNN.jsonl``)."""
    return self.dir / f"{self._chunk:06d}.jsonl"

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Writes one record ``{"step": step, **metrics}`` (floats; NaN/inf as strings).

    The record is in its chunk file when this returns (the chunk is rewritten whole).

    Args:
      step: the train step (int). metrics: name -> number, string or list (JSON-able).

    Raises:
      OSError: the file or object could not be written.
    """
    if not self._active:
      return
    rec = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    self._lines.append(json.dumps(rec) + "\n")
    storage.write_atomic(str(self.path), "".join(self._lines))
    if len(self._lines) >= self.chunk_records:
      self._lines, self._chunk = [], self._chunk + 1
    if self._tb is not None:
      for k, v in rec.items():
        if isinstance(v, (int, float)) and k != "step":
          self._tb.add_scalar(k, v, step)

  def text(self, step: int, tag: str, text: str) -> None:
    """Writes ``text`` (markdown) to TensorBoard under ``tag`` at ``step``; nothing without
    TensorBoard or on processes other than the primary one."""
    if self._active and self._tb is not None:
      self._tb.add_text(tag, text, int(step))

  def close(self) -> None:
    """Closes TensorBoard (idempotent); every record is already in its chunk file."""
    self._active = False
    if self._tb is not None:
      self._tb.close()
      self._tb = None
