"""The actor–learner strategy (``train.mode='async'``; Arnal et al. 2026, §3).

A generator thread with its own copy of the weights (refreshed every
``train.weight_sync_every`` learner steps) inserts R rollouts at a time while the learner
trains; a samples-per-insert rate limiter (``replay.rate_limiter``) holds the replay ratio
ρ. On one host ρ stands in for the W/T split (W/T = μ/ρ, see ``accounting``). Thread
timing decides which weights generate which rollouts, so this strategy is not
bit-reproducible, and a resumed run loses the rollouts the generator had in flight.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxreplay.replay import rate_limiter as rate_lib
from jaxreplay.train import carry as carry_lib
from jaxreplay.train import generation, progress, samples
from jaxreplay.train.carry import Carry
from jaxreplay.train.ledger import Ledger
from jaxreplay.train.record import record_step


class NoBatchError(RuntimeError):
  """No batch became drawable within ``train.async_timeout_s`` in an ``async`` run: the run
  stops, its last checkpoint kept (``jaxreplay.main`` prints the message as one line)."""


def _copy(tree):
  """A fresh device copy of a pytree (survives donation of the original)."""
  return jax.tree.map(jnp.copy, tree)


class AsyncGenerator:
  """The generator thread and the state it shares with the learner (under ``cond``).

  The thread loops: wait until the rate limiter allows inserting R rollouts, generate
  them outside the lock with its own parameter copy, then (under the lock) add them to
  the buffer, count them and advance the data position. The learner holds the lock while
  it samples, trains and records (``wait_for_sample`` returns with it held), and calls
  ``publish`` to refresh the generator's weights. Every wait has a timeout; an exception
  in the thread is re-raised in the learner.

  Args (keyword-only):
    produce: ``(params, ref_params, version, position, key) -> (Rollout, Generation)``.
    insert: ``(buffer, rollout, step) -> (buffer, lost)`` (``learner.make_inserter``).
    limiter: ``RateLimiter``. limiter_state: its counters.
    buffer: the starting ``BufferState``. position: the starting data position.
    params, ref_params, version: the starting weights and their policy version.
    insert_size: R. sample_size: B. key: PRNG key of the generator's stream.
    timeout_s: longest the learner waits for a sample before raising.
    learner_step: learner steps completed (stamped as the insertion step).
    ready: optional ``(buffer, version) -> bool``, the learner may draw
      (``learner.make_ready``); the learner waits for it besides the rate limiter.
  """

  def __init__(self, *, produce: Callable, insert: Callable, limiter: rate_lib.RateLimiter,
               limiter_state: rate_lib.RateLimiterState, buffer, position: int, params,
               ref_params, version: int, insert_size: int, sample_size: int, key: jax.Array,
               timeout_s: float, learner_step: int,
               ready: Callable | None = None):
    self._produce, self._insert, self.limiter = produce, insert, limiter
    self.limiter_state, self.buffer, self.position = limiter_state, buffer, position
    self._weights = (_copy(params), ref_params if ref_params is None else _copy(ref_params),
                     version)
    self._r, self._b, self._key, self._timeout = insert_size, sample_size, key, timeout_s
    self.learner_step, self._ready = learner_step, ready
    self.cond = threading.Condition()
    self._stop = False
    self.error: BaseException | None = None
    self.pending: list[dict] = []  # generation metrics since the learner last looked
    self.ledger = Ledger()  # ledger increments since the learner last looked
    self.busy_s = self.wait_s = 0.0
    # True while the thread waits for the rate limiter to allow an insert (under ``cond``,
    # notified when it starts waiting)
    self.waiting_to_insert = False
    self._thread = threading.Thread(target=self._loop, name="jaxreplay-generator", daemon=True)

  def start(self) -> "AsyncGenerator":
    """Starts the thread; returns ``self``."""
    self._thread.start()
    return self

  def _loop(self):
    chunk = 0
    try:
      while True:
        t0 = time.monotonic()
        with self.cond:
          while not self._stop and not rate_lib.can_insert(
              self.limiter, self.limiter_state, self._r, int(self.buffer.size)):
            if not self.waiting_to_insert:
              self.waiting_to_insert = True
              self.cond.notify_all()
            self.cond.wait(0.5)
          self.waiting_to_insert = False
          if self._stop:
            return
          params, ref, version = self._weights
          position = self.position
        t1 = time.monotonic()
        rollout, produced = self._produce(params, ref, version, position,
                                          jax.random.fold_in(self._key, chunk))
        with self.cond:
          self.buffer, lost = self._insert(self.buffer, rollout, jnp.int32(self.learner_step))
          lost = jax.device_get(lost)
          self.limiter_state = rate_lib.record_insert(self.limiter_state, self._r)
          self.pending.append(produced.metrics)
          self.ledger = self.ledger + produced.ledger + Ledger(
              evicted_unused_rollouts=int(lost[0]), evicted_unused_tokens=int(lost[1]))
          self.position = produced.position
          self.wait_s += t1 - t0
          self.busy_s += time.monotonic() - t1
          self.cond.notify_all()
        chunk += 1
    except BaseException as e:  # noqa: BLE001 - handed to the learner thread
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def _check(self):
    if self.error is not None:
      raise RuntimeError(f"the generator thread failed: {type(self.error).__name__}: "
                         f"{self.error}") from self.error

  def wait_for_sample(self) -> float:
    """Blocks (lock held on return) until the rate limiter allows a sample and B items are
    eligible; returns seconds waited.

    Raises:
      RuntimeError: the generator failed. NoBatchError: no sample was allowed for
        ``timeout_s``.
    """
    t0 = time.monotonic()
    while not (rate_lib.can_sample(self.limiter, self.limiter_state, self._b,
                                   int(self.buffer.size))
               and (self._ready is None or self._ready(self.buffer, self.learner_step))):
      self._check()
      if time.monotonic() - t0 > self._timeout:
        ready = self._ready is None or self._ready(self.buffer, self.learner_step)
        raise NoBatchError(f"async mode: no batch became available in {self._timeout:.0f} s "
                           f"(inserted={int(self.limiter_state.inserted)}, "
                           f"sampled={int(self.limiter_state.sampled)}, "
                           f"buffer size={int(self.buffer.size)}, enough drawable items: "
                           f"{ready}"
                           + ("" if ready else "; check buffer.max_staleness, "
                              "buffer.max_times_sampled and buffer.sampler") + ")")
      self.cond.wait(0.5)
    self._check()
    return time.monotonic() - t0

  def publish(self, params, version: int):
    """Hands the generator a copy of the learner's weights (call with the lock held); the
    frozen reference it was given at the start stays."""
    self._weights = (_copy(params), self._weights[1], version)

  def take(self) -> tuple[list[dict], Ledger]:
    """Generation metrics and the ledger increment since the last call (lock held)."""
    out = (self.pending, self.ledger)
    self.pending, self.ledger = [], Ledger()
    return out

  def stop(self, timeout_s: float = 120.0) -> bool:
    """Stops the thread and joins it (an in-flight generation finishes first).

    Returns:
      True when the thread has ended within ``timeout_s``.
    """
    with self.cond:
      self._stop = True
      self.cond.notify_all()
    if self._thread.is_alive():
      self._thread.join(timeout_s)
    return not self._thread.is_alive()


def _produce(run, params, ref_params, version: int, position: int, key):
  """``generation.generate_rollouts`` for the run's config, task and model."""
  return generation.generate_rollouts(run.source, params, position, key, version, ref_params)


def train_async(run, carry: Carry) -> Carry:
  """Learner steps ``carry.step .. train.steps − 1`` against an ``AsyncGenerator``.

  Each step waits (lock held) until the rate limiter allows a sample, runs the learner
  step, records the sample, publishes the weights every ``train.weight_sync_every``
  steps and records the step (lock held, so the generator cannot donate the buffer while
  it is logged or checkpointed). The generator thread is stopped and joined on every exit
  path; rollouts it inserted after the last step still count in the ledger.

  Args:
    run: the ``build.Run``. carry: the starting carry.

  Returns:
    The carry after the last step.

  Raises:
    RuntimeError: the generator failed, or no batch for ``train.async_timeout_s`` seconds.
  """
  train, b = run.train, run.train.batch_size
  bar = progress.steps_bar(carry.step, train.steps, enabled=run.progress)
  gen_s0, wait_s0 = carry.timers.generate_s, carry.timers.generator_wait_s  # before a resume
  gen = AsyncGenerator(
      produce=functools.partial(_produce, run), insert=run.fns.insert, limiter=run.limiter,
      limiter_state=carry.limiter_state, buffer=carry.buffer, position=carry.position,
      params=carry.state.params, ref_params=carry.state.ref_params, version=carry.step,
      insert_size=run.rollout.per_step, sample_size=b, key=carry_lib.generator_key(carry),
      timeout_s=train.async_timeout_s, learner_step=carry.step,
      ready=run.fns.ready).start()
  try:
    for step in bar:
      with gen.cond:
        waited = gen.wait_for_sample()
        t1 = time.monotonic()

        # --- SAMPLE + UPDATE ---------------------------------------------------------------
        trained = samples.peek_trained(run, carry.state.params, gen.buffer,
                                       jax.random.fold_in(carry.key, step), carry.state.step,
                                       step + 1)
        state, gen.buffer, metrics = run.fns.learner_step(carry.state, gen.buffer,
                                                      jax.random.fold_in(carry.key, step))
        metrics = jax.device_get(metrics)
        gen.limiter_state = rate_lib.record_sample(gen.limiter_state, b)
        gen.learner_step = step + 1
        if (step + 1) % train.weight_sync_every == 0:
          gen.publish(state.params, step + 1)
        t = carry.timers
        timers = t.replace(learner_wait_s=t.learner_wait_s + waited,
                           train_s=t.train_s + time.monotonic() - t1,
                           generate_s=gen_s0 + gen.busy_s, generator_wait_s=wait_s0 + gen.wait_s)

        # --- RECORD (what the generator inserted since the last step, then this step) ----
        pending, inc = gen.take()
        carry = carry.replace(state=state, buffer=gen.buffer, limiter_state=gen.limiter_state,
                              ledger=carry.ledger + inc, timers=timers, position=gen.position,
                              step=step + 1)
        extra = {"limiter_inserted": int(gen.limiter_state.inserted),
                 "limiter_sampled": int(gen.limiter_state.sampled),
                 "rollouts_since_last_step": len(pending) * run.rollout.per_step}
        gen_metrics = generation.mean_metrics(pending)
        carry = record_step(run, carry, metrics, gen_metrics, extra, trained=trained)
        bar.set_postfix(reward=f"{gen_metrics.get('reward', float('nan')):.2f}",
                        acc=f"{carry.last_eval['acc_sampled']:.2f}", refresh=False)
        gen.cond.notify_all()
  finally:
    bar.close()
    if not gen.stop():
      run.log("async mode: the generator thread did not stop in time (left as a daemon)")
  with gen.cond:
    return carry.replace(buffer=gen.buffer, limiter_state=gen.limiter_state, position=gen.position,
                         ledger=carry.ledger + gen.take()[1])
