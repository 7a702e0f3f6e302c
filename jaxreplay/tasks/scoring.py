"""Scoring a batch of completions: in this process, or in a pool of worker processes.

A reward call can fail in three ways: it raises, returns a non-finite value, or runs too
long. Each gives reward 0 and is counted as a failure; the batch always gets one finite
reward per completion. How "too long" is enforced depends on where the call runs:

* ``Scorer(reward_fn, workers=0, timeout_s)``: in this process, each call on a daemon thread
  abandoned after ``timeout_s``. A thread cannot be killed, so a call stuck in C code keeps
  running (and holds a core) until it returns; use it only for scorers that cannot hang —
  reasoning-gym's own string scorers (the embedded default) — where it costs no start-up.
* ``Scorer(reward_fn, workers=K, timeout_s)``: K worker processes (``python -m
  jaxreplay.tasks.scoring``) each score one completion at a time; a call past ``timeout_s``
  gets its worker SIGKILLed and a fresh one started in its place, and a worker that dies
  mid-call (segfault, OOM kill) is replaced the same way. math-verify needs this: its own
  timeouts use ``signal.alarm`` (main thread only) and sympy can spin in C-level integer
  arithmetic that no signal interrupts (``9^{9^{9^{9}}}``).

The same scorer also grades by a named method of its reward function (``grader``: an
evaluation's strict and lenient grades of math tasks, ``math_answer.MathReward.strict`` /
``.lenient``), through the same workers, timeout and failure accounting.

Rewards do not depend on which worker scored them, so pooled and in-process scoring give
the same rewards for calls that finish in time. The workers are separate interpreters
started with ``subprocess`` (not ``fork``: the trainer's process runs JAX's threads, and a
forked child may inherit a held lock), and they import only the reward function's modules.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

import numpy as np

# Seconds a new worker may take to import the reward function's modules (sympy and
# math-verify take 1-3 s on a quiet 2-core machine; much longer when it is loaded).
STARTUP_TIMEOUT_S = 300.0
# Workers of one call killed by a signal while starting that are replaced; one more stops
# the run (something kills every new worker, e.g. too little memory for the pool).
MAX_START_KILLS = 3
_READY = b"ready"
# Items sent to a worker at once: fewer round trips (each a context switch on both sides),
# and at most this many re-sent when the worker is replaced.
_MAX_CHUNK = 16


def _call_with_timeout(fn: Callable[[], float], timeout_s: float) -> tuple[bool, Any]:
  """Runs ``fn()`` on a daemon thread; returns (ok, value). A call still running after
  ``timeout_s`` seconds is abandoned (its thread cannot be killed but never blocks exit)."""
  box = {}

  def target():
    try:
      box["value"] = fn()
    except Exception as e:  # noqa: BLE001 - reported as a failure by the caller
      box["error"] = e

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout_s)
  if t.is_alive() or "error" in box:
    return False, None
  return True, box["value"]


def score_in_process(reward_fn: Callable[[str, Any], float], texts: Sequence[str],
                     examples: Sequence[Any], timeout_s: float | None = None
                     ) -> tuple[np.ndarray, int]:
  """Rewards of decoded completions, scored in this process.

  Args:
    reward_fn: ``(text, example) -> float``.
    texts: B decoded completions. examples: the B matching examples.
    timeout_s: per-call limit in seconds, each call on a thread (None: no limit, no thread).

  Returns:
    (rewards [B] float32, failures: int — calls that raised, returned a non-finite value
    or ran past ``timeout_s``; each of them has reward 0).
  """
  out = np.zeros((len(texts),), np.float32)
  failures = 0
  for i, (t, e) in enumerate(zip(texts, examples)):
    if timeout_s is None:
      try:
        ok, value = True, float(reward_fn(t, e))
      except Exception:  # noqa: BLE001 - a crashing scorer must not stop the run
        ok, value = False, None
    else:
      ok, value = _call_with_timeout(lambda t=t, e=e: float(reward_fn(t, e)), timeout_s)
    if ok and np.isfinite(value):
      out[i] = value
    else:
      failures += 1
  return out, failures


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  send: Connection  # parent -> worker
  recv: Connection  # worker -> parent
  ready: bool = False
  started: float = 0.0
  items: collections.deque = dataclasses.field(default_factory=collections.deque)  # in flight
  deadline: float = 0.0  # for the first item in flight


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """Counters of a pool since it started.

  Attributes:
    scored: calls finished in time. failures: calls that raised, returned a non-finite
    value, timed out or lost their worker. timeouts: calls killed at the timeout.
    crashes: workers that died mid-call. restarts: workers started to replace one.
  """

  scored: int = 0
  failures: int = 0
  timeouts: int = 0
  crashes: int = 0
  restarts: int = 0


class Scorer:
  """Scores batches of completions with a reward function, with a per-call timeout.

  ``scorer(texts, examples, grader=None) -> (rewards [B] float32, failures int)``; with
  ``grader`` each call is ``getattr(reward_fn, grader)(text, example)``. ``workers=0`` scores
  in this process (``score_in_process``); ``workers >= 1`` in that many worker processes,
  started on the first call and stopped by ``close()`` (also at interpreter exit, and a
  worker exits by itself when this process dies and its pipe closes).

  Args:
    reward_fn: picklable ``(text, example) -> float`` (with workers, it is pickled once per
      worker start; the examples are pickled per call). If it has a ``warm_up()`` method, a
      worker calls it before taking work, so slow imports do not count against a timeout.
    workers: K >= 0 processes. timeout_s: per-call limit in seconds; 0 or None: none (only
      with ``workers=0``).

  A worker killed by a signal (mid-call, idle, or still starting) is replaced, and the
  call goes on; a call raises ``RuntimeError`` when a worker exits by itself while
  starting (an import error would repeat), when more than ``MAX_START_KILLS`` are killed
  while starting, or when one takes over ``STARTUP_TIMEOUT_S`` to start.

  Raises:
    ValueError: ``workers < 0``, or ``workers >= 1`` without a positive timeout (a stuck
      worker would never be replaced).
  """

  def __init__(self, reward_fn: Callable[[str, Any], float], workers: int = 0,
               timeout_s: float | None = None):
    if workers < 0:
      raise ValueError(f"workers={workers} must be >= 0")
    if workers and not (timeout_s or 0) > 0:
      raise ValueError(f"a pool of {workers} workers needs timeout_s > 0, got {timeout_s!r}")
    self.reward_fn = reward_fn
    self.workers = workers
    self.timeout_s = timeout_s or None
    self._pool: list[_Worker] = []
    self._payload: bytes | None = None
    self._stats = PoolStats()
    self._lock = threading.Lock()  # the async generator thread and evaluation may both score
    self._finalizer = weakref.finalize(self, Scorer._stop_all, self._pool)
    atexit.register(self._finalizer)

  @property
  def stats(self) -> PoolStats:
    """The pool's counters (all zero for ``workers=0``)."""
    return self._stats

  def graders(self) -> tuple[str, ...]:
    """The grader names the reward function offers (its ``GRADERS`` that are methods)."""
    names = getattr(self.reward_fn, "GRADERS", ())
    return tuple(g for g in names if callable(getattr(self.reward_fn, g, None)))

  def __call__(self, texts: Sequence[str], examples: Sequence[Any],
               grader: str | None = None) -> tuple[np.ndarray, int]:
    """Scores of ``texts`` against ``examples``, one per completion.

    Args:
      texts: B decoded completions. examples: the B matching examples.
      grader: None scores with ``reward_fn``; a name scores with that method of it
        (``graders()``), with the same workers, timeout and failure accounting.

    Returns:
      (scores [B] float32, failures: int — calls that raised, returned a non-finite value,
      timed out or lost their worker; each scored 0).

    Raises:
      ValueError: B completions but another number of examples, or a ``grader`` the
        reward function does not offer. RuntimeError: as the class docstring says.
    """
    if len(texts) != len(examples):
      raise ValueError(f"{len(texts)} completions but {len(examples)} examples")
    if grader is not None and grader not in self.graders():
      raise ValueError(f"grader {grader!r} is not one of {type(self.reward_fn).__name__}'s "
                       f"graders {self.graders()}")
    if not self.workers:
      fn = self.reward_fn if grader is None else getattr(self.reward_fn, grader)
      return score_in_process(fn, texts, examples, self.timeout_s)
    with self._lock:
      return self._score_pooled(texts, examples, grader)

  # --- the pool ---------------------------------------------------------------------------

  def _start_worker(self) -> _Worker:
    if self._payload is None:
      self._payload = pickle.dumps(self.reward_fn)
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    # The worker imports what this process can (the same sys.path), on the CPU.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxreplay.tasks.scoring", str(to_r), str(from_w)],
        pass_fds=(to_r, from_w), env=env, stdin=subprocess.DEVNULL, close_fds=True)
    os.close(to_r)
    os.close(from_w)
    w = _Worker(proc=proc, send=Connection(to_w, readable=False),
                recv=Connection(from_r, writable=False), started=time.monotonic())
    w.send.send_bytes(self._payload)
    return w

  @staticmethod
  def _kill(w: _Worker) -> None:
    try:
      w.proc.kill()
    except OSError:
      pass
    w.proc.wait()
    for c in (w.send, w.recv):
      try:
        c.close()
      except OSError:
        pass

  @staticmethod
  def _stop_all(pool: list) -> None:
    for w in pool:
      Scorer._kill(w)
    pool.clear()

  def close(self) -> None:
    """Stops every worker (a later call starts a fresh pool)."""
    self._finalizer()
    self._finalizer = weakref.finalize(self, Scorer._stop_all, self._pool)

  def kill_worker(self, index: int = 0) -> int:
    """SIGKILLs worker ``index`` (0 <= index < workers, pool started) and waits for it to
    die, as the OOM killer would; the next call replaces it. Returns its pid."""
    w = self._pool[index]
    w.proc.kill()
    w.proc.wait()
    return w.proc.pid

  @property
  def pids(self) -> list[int]:
    """Process ids of the current workers (empty before the first call)."""
    return [w.proc.pid for w in self._pool]

  def _replace(self, w: _Worker) -> None:
    self._kill(w)
    self._pool[self._pool.index(w)] = self._start_worker()

  def _score_pooled(self, texts, examples, grader=None) -> tuple[np.ndarray, int]:
    """Chunks of items go to idle workers; a worker answers each item as it finishes, and
    the first unanswered item of a worker has ``timeout_s`` from the previous answer (or
    the send). At the deadline, or when the worker dies, that item fails, the worker is
    replaced, and the rest of its chunk goes back to the queue."""
    while len(self._pool) < self.workers:
      self._pool.append(self._start_worker())
    out = np.zeros((len(texts),), np.float32)
    failed = np.zeros((len(texts),), bool)
    pending = collections.deque(range(len(texts)))
    counts = collections.Counter()

    def fail_first(w: _Worker, why: str):
      failed[w.items.popleft()] = True
      pending.extendleft(reversed(w.items))
      w.items.clear()
      counts[why] += 1
      counts["restarts"] += 1
      self._replace(w)

    while pending or any(w.items for w in self._pool):
      for w in list(self._pool):
        if w.ready and not w.items and pending:
          k = min(_MAX_CHUNK, -(-len(pending) // self.workers))
          chunk = [pending.popleft() for _ in range(min(k, len(pending)))]
          try:
            w.send.send_bytes(pickle.dumps((grader, [(i, texts[i], examples[i])
                                                     for i in chunk])))
          except OSError:  # died while idle: its chunk goes to the replacement
            pending.extendleft(reversed(chunk))
            counts["restarts"] += 1
            self._replace(w)
            continue
          w.items.extend(chunk)
          w.deadline = time.monotonic() + self.timeout_s
      watched = [w for w in self._pool if w.items or not w.ready]
      deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S for w in watched]
      wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
      for conn in wait([w.recv for w in watched], wait_s):
        w = next(x for x in self._pool if x.recv is conn)
        try:
          msg = w.recv.recv_bytes()
        except (EOFError, OSError):
          if not w.ready:
            code = w.proc.wait()
            # Killed by a signal (the OOM killer, an operator) is replaced like a crash in
            # a call; exiting by itself (an import error) would repeat, so it stops the run.
            counts["start_kills"] += 1
            if code >= 0 or counts["start_kills"] > MAX_START_KILLS:
              raise RuntimeError(f"a scoring worker exited with code {code} while starting "
                                 "(its stderr is above)") from None
            counts["restarts"] += 1
            self._replace(w)
            continue
          fail_first(w, "crashes")
          continue
        if not w.ready:
          w.ready = msg == _READY
          continue
        i, ok, value = pickle.loads(msg)
        if not w.items or i != w.items[0]:
          continue
        w.items.popleft()
        w.deadline = time.monotonic() + self.timeout_s
        if ok and np.isfinite(value):
          out[i] = value
          counts["scored"] += 1
        else:
          failed[i] = True
      now = time.monotonic()
      for w in list(self._pool):
        if w.items and now >= w.deadline:
          fail_first(w, "timeouts")
        elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
          raise RuntimeError(f"a scoring worker did not start within {STARTUP_TIMEOUT_S} s")
    n_failed = int(failed.sum())
    s = self._stats
    self._stats = PoolStats(scored=s.scored + counts["scored"], failures=s.failures + n_failed,
                            timeouts=s.timeouts + counts["timeouts"],
                            crashes=s.crashes + counts["crashes"],
                            restarts=s.restarts + counts["restarts"])
    return out, n_failed


def _worker_main(fd_in: int, fd_out: int) -> None:
  """A worker: reads the pickled reward function, says ready, then answers each item of a
  chunk ``(grader, [(index, text, example), ...])`` with ``(index, ok, value)`` as soon as
  it is scored (by the reward function, or its method ``grader`` when not None), until its
  input closes."""
  inp, outp = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
  reward_fn = pickle.loads(inp.recv_bytes())
  warm_up = getattr(reward_fn, "warm_up", None)
  if warm_up is not None:  # heavy imports before "ready", not inside the first call's timeout
    warm_up()
  outp.send_bytes(_READY)
  while True:
    try:
      grader, chunk = pickle.loads(inp.recv_bytes())
    except EOFError:
      return
    fn = reward_fn if grader is None else getattr(reward_fn, grader)
    for i, text, example in chunk:
      try:
        value, ok = float(fn(text, example)), True
      except Exception:  # noqa: BLE001 - reported as a failure to the parent
        value, ok = 0.0, False
      outp.send_bytes(pickle.dumps((i, ok, value)))


if __name__ == "__main__":
  _worker_main(int(sys.argv[1]), int(sys.argv[2]))
