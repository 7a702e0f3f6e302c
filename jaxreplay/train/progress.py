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
             leave=False, file=sys.stderr)
  try:
    yield bar
  finally:
    bar.close()
  if log is not None:
    log(f"{name}: {time.time() - t0:.1f}s")
