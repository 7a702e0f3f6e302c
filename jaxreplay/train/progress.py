"""Progress of the long phases: a tqdm bar while a phase runs, one log line with its duration
when it ends.

Phases: loading or converting the starting model, the warm start, each held-out evaluation
(its decode chunks, labelled with the step it evaluates) and the checkpoint writes a run
waits for. ``log.progress=False`` silences every bar; the closing log lines stay, so a log
file still gives each phase's duration.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

from tqdm import tqdm


# Seconds between a bar's redraws when its stream is not a terminal (a log file, a SLURM
# output, a pipe): there each redraw is another line of carriage returns in the file.
LOG_FILE_REDRAW_S = 30.0


def redraw_interval(stream=None) -> float:
  """tqdm's ``mininterval`` for a bar on ``stream`` (default ``sys.stderr``, tqdm's own).

  Args:
    stream: a file object; one without ``isatty``, or whose ``isatty()`` fails, counts as a
      file.

  Returns:
    Seconds: tqdm's default 0.1 on a terminal, ``LOG_FILE_REDRAW_S`` elsewhere.
  """
  stream = sys.stderr if stream is None else stream
  try:
    return 0.1 if stream.isatty() else LOG_FILE_REDRAW_S
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    return LOG_FILE_REDRAW_S


def steps_bar(start: int, total: int, *, enabled: bool) -> tqdm:
  """The learner's step bar over steps ``start`` .. ``total`` - 1 (a resumed run starts at
  its checkpoint's step), on stderr, redrawn at ``redraw_interval``."""
  return tqdm(range(start, total), initial=start, total=total, disable=not enabled,
              dynamic_ncols=True, mininterval=redraw_interval())


@contextlib.contextmanager
def phase(name: str, *, enabled: bool, log: Callable[[str], None] | None = None,
          total: int | None = None, unit: str = "it") -> Iterator[tqdm]:
  """A progress bar for the ``with`` block, closed with the log line ``"NAME: S.Ss"``.

  Args:
    name: the phase, shown on the bar and in the log line (e.g. ``"eval step 25"``).
    enabled: show the bar (``log.progress``); False: a disabled bar (its ``update`` does
      nothing, nothing is printed).
    log: message sink of the closing line; None: no line.
    total: the bar's length, if known (it may be set later through ``bar.total``).
    unit: the bar's unit.

  Yields:
    The ``tqdm`` bar.
  """
  t0 = time.time()
  bar = tqdm(total=total, desc=name, unit=unit, disable=not enabled, dynamic_ncols=True,
             leave=False, file=sys.stderr, mininterval=redraw_interval())
  try:
    yield bar
  finally:
    bar.close()
  if log is not None:
    log(f"{name}: {time.time() - t0:.1f}s")
