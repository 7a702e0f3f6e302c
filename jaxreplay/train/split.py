"""The actor–learner split: generator and learner on two sub-meshes, at once.

Arnal et al. (2026, §3) run W inference workers and T trainers per node: rollouts flow
through the buffer while the trainers learn, and the workers receive new weights every few
steps, *during* generation (App. 8.2: one rollout can mix two weight versions). Here
(``train.mode='async'`` with ``mesh.generator_devices`` W > 0):

* the **generator** thread owns the generator mesh (``parallel.submesh``): it decodes its
  rounds as one stream through one set of decode slots (``generation.stream_rollouts``,
  ``engine.stream``: the next round's requests take the slots the round before frees,
  no barrier between rounds) with its own inference copy of the weights and, between
  decode chunks, swaps in the newest
  published copy (an in-flight update, as PipelineRL): the decoding slots are re-prefilled
  with it (or keep their caches, ``sampler.on_weight_swap='keep_kv'``) and each token
  records the version that sampled it, so the importance ratio stays per token and a
  rollout's ``policy_version`` is its oldest version;
* the **learner** (the caller's thread) owns the learner mesh: it inserts finished rounds
  into the buffer, draws and trains as the rate limiter allows, and every
  ``train.weight_sync_every`` steps reshards its parameters onto the generator mesh
  (``submesh.make_weight_sync``) and publishes them.

With several processes each mesh spans all of them, so every decision a mesh's processes
must share — start a round, which weights, how many rounds to insert, stop — is agreed
with a small collective on that mesh (``submesh.agree_min``); timing decides only when,
never what. A checkpoint holds the learner side (train state, buffer, limiter, key, the
data position after the last inserted round); rounds generated but not inserted when the
run stops are lost and counted (``Ledger.lost_in_flight_rollouts``).
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxreplay.parallel import multihost
from jaxreplay.parallel import submesh
from jaxreplay.replay import rate_limiter as rate_lib
from jaxreplay.train import carry as carry_lib
from jaxreplay.train import generation, progress, samples
from jaxreplay.train.actor_learner import NoBatchError
from jaxreplay.train.carry import Carry
from jaxreplay.train.ledger import Ledger
from jaxreplay.train.record import record_step

POLL_S = 0.02  # seconds between checks while waiting (each check is one agreement)


def _int(x) -> int:
  """A replicated scalar as a host int (on every process)."""
  return int(multihost.to_host(x))


class _Stopped(Exception):
  """The processes agreed to stop during a generation round."""


class BusyClock:
  """Seconds each side worked and seconds both worked at the same moment (thread-safe).

  ``set(side, busy)`` at every transition; the clock integrates the two busy flags from the
  ``now`` it was created with. Time only moves forward: a transition stamped before the
  clock's latest reading counts from that reading, so that both sides' seconds never exceed
  the time read, and the seconds both worked never exceed either side's."""

  def __init__(self, now: float):
    self._lock = threading.Lock()
    self._t, self._busy = now, {"generator": False, "learner": False}
    self.busy_s = {"generator": 0.0, "learner": 0.0}
    self.both_s = 0.0

  def _advance(self, now: float | None):
    now = max(time.monotonic() if now is None else now, self._t)
    dt = now - self._t
    for k, b in self._busy.items():
      self.busy_s[k] += dt if b else 0.0
    self.both_s += dt if all(self._busy.values()) else 0.0
    self._t = now

  def set(self, side: str, busy: bool, now: float | None = None):
    """Marks ``side`` ('generator' or 'learner') busy or idle from ``now`` (default: the
    current time) on."""
    with self._lock:
      self._advance(now)
      self._busy[side] = busy

  def read(self) -> tuple[float, dict[str, float], float]:
    """One consistent reading, integrated up to the current time.

    Returns:
      (that time, seconds each side worked as {'generator', 'learner'}, seconds both worked).
    """
    with self._lock:
      self._advance(None)
      return self._t, dict(self.busy_s), self.both_s


class Generator:
  """The generator thread: rounds of R rollouts streamed on the generator mesh (the next
  round starts, rate limiter permitting, while the one before finishes), weights swapped
  in flight, finished rounds queued for the learner in order.

  Args (keyword-only):
    run: the ``build.Run`` (its ``source`` generates on the generator mesh and places the
      rollouts on the learner mesh). params: the starting generator copy
      (``run.weight_sync`` of the learner's parameters). version: their policy version.
    position: data position of the first round. inserted, sampled, size: the learner's
      limiter counters and buffer size at the start. key: the generator's PRNG key
      (round keys fold in their data position, so a resumed run does not repeat them).
    clock: the ``BusyClock``.
  """

  def __init__(self, *, run, params, version: int, position: int, inserted: int, sampled: int,
               size: int, key: jax.Array, clock: BusyClock):
    self._run, self._clock = run, clock
    self._mesh, self._r = run.source.mesh, run.rollout.per_step
    # The thread's eager ops (the round key, the stop post-processing, the advantages) run
    # on this process's first generator device: on the default device, learner device 0,
    # they would queue behind the learner step running there.
    self.device = next(d for d in self._mesh.devices.flat
                       if d.process_index == jax.process_index())
    # the carry's key lives on the learner mesh; the rounds' keys on the generator device
    self._key = jax.device_put(
        jax.random.wrap_key_data(np.asarray(multihost.to_host(jax.random.key_data(key))),
                                 impl=jax.random.key_impl(key)), self.device)
    self.cond = threading.Condition()
    self.published = {version: params}  # version -> generator copy (the newest few)
    self.in_use = version
    self.queue: list = []  # (Rollout on the learner mesh, generation.Generation)
    self.position = position
    self.seen = (inserted, sampled, size)  # the learner's counters, updated by it
    self.stop_requested = False
    self.error: BaseException | None = None
    self.swaps = 0
    self.in_flight = 0  # rounds the engine holds, not yet queued
    self._first = False
    self._busy_since = None
    self.abandoned_rollouts = 0
    self.wait_s = self.busy_s = 0.0
    self._thread = threading.Thread(target=self._loop, name="jaxreplay-generator", daemon=True)

  def start(self) -> "Generator":
    """Starts the thread; returns ``self``."""
    self._thread.start()
    return self

  # -- decisions, agreed over the generator mesh ------------------------------------------
  def _agree(self, may_start: bool) -> tuple[bool, bool, int]:
    """(go on, start a round, newest version every process holds)."""
    with self.cond:
      newest, stop = max(self.published), self.stop_requested
    go, start, version = submesh.agree_min([int(not stop), int(may_start), newest], self._mesh)
    return bool(go), bool(start), version

  def _may_start(self) -> bool:
    with self.cond:
      inserted, sampled, size = self.seen
      queued = (len(self.queue) + self.in_flight) * self._r
    state = rate_lib.RateLimiterState(inserted=inserted + queued, sampled=sampled)
    return rate_lib.can_insert(self._run.limiter, state, self._r, size + queued)

  def _weights(self):
    """The engine's in-flight weight source: the agreed newest copy, or a stop."""
    go, _, version = self._agree(True)
    if not go:
      raise _Stopped
    if version == self.in_use:
      return None
    with self.cond:
      self.in_use = version
      params = self.published[version]
      self.swaps += 1
    return params, version

  def _loop(self):
    with jax.default_device(self.device):  # thread-local
      self._rounds()

  def _rounds(self):
    try:
      # --- WAIT for the rate limiter before the first round (every process must agree) --
      t0 = time.monotonic()
      version = self._wait_for_round(t0)
      if version is None:
        return
      with self.cond:
        self.in_use, params, position = version, self.published[version], self.position
        self.in_flight = 1
      self._first = True
      # --- GENERATE rounds from slots kept full across them, weights swapped in flight --
      try:
        generation.stream_rollouts(self._run.source, params, position, self._key, version,
                                   self._next_round, self._deliver, weights=self._weights)
      except _Stopped:
        with self.cond:
          self.abandoned_rollouts += self._r * self.in_flight
          self.in_flight = 0
      finally:
        self._set_busy(False)
    except BaseException as e:  # noqa: BLE001 - handed to the learner
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def _wait_for_round(self, t0: float) -> int | None:
    """Polls the agreement until a round may start: the agreed newest version, or None
    when the run stops. Counts the wait and marks the generator busy after it."""
    while True:
      go, start, version = self._agree(self._may_start())
      if not go:
        return None
      if start:
        break
      time.sleep(POLL_S)
    t1 = self._set_busy(True)
    with self.cond:
      self.wait_s += t1 - t0
    return version

  def _set_busy(self, busy: bool) -> float:
    """The generator busy (generating) or not from now on, on the clock and in ``busy_s``.
    Returns that time (``time.monotonic()`` seconds: every duration and deadline here is
    on the monotonic clock, which a system clock step cannot move backwards).

    The time is read holding ``cond``: the learner reads ``busy_seconds`` under the same lock,
    so a transition can never be stamped before a reading it follows, and the generator's
    seconds read by successive records never decrease."""
    with self.cond:
      now = time.monotonic()
      if self._busy_since is not None:
        self.busy_s += now - self._busy_since
      self._busy_since = now if busy else None
    self._clock.set("generator", busy, now)
    return now

  def busy_seconds(self, now: float) -> float:
    """Seconds generating so far, the stretch in progress at ``now`` included (a stream
    stays busy across rounds). Call holding ``cond``."""
    return self.busy_s + (0.0 if self._busy_since is None else now - self._busy_since)

  def _next_round(self, block: bool):
    """``stream_rollouts``'s ``next_round``: may the next round start? With ``block``
    (nothing decodes) it waits until one may; a stop raises ``_Stopped``. Returns the
    parameters in use (the round's behaviour policy) or None."""
    if self._first:  # agreed before the stream started
      self._first = False
    elif block:
      t0 = self._set_busy(False)
      if self._wait_for_round(t0) is None:
        raise _Stopped
      with self.cond:
        self.in_flight += 1
    else:
      go, start, _ = self._agree(self._may_start())
      if not go:
        raise _Stopped
      if not start:
        return None
      with self.cond:
        self.in_flight += 1
    with self.cond:
      return self.published[self.in_use]

  def _deliver(self, rollout, produced):
    """``stream_rollouts``'s ``deliver``: a finished round into the learner's queue."""
    with self.cond:
      self.queue.append((rollout, produced))
      self.position = produced.position
      self.in_flight -= 1
      self.cond.notify_all()

  # -- the learner's side ----------------------------------------------------------------
  def publish(self, params, version: int):
    """Makes a new generator copy available; drops copies older than the one in use."""
    with self.cond:
      self.published[version] = params
      for v in [v for v in self.published if v < min(self.in_use, version)]:
        del self.published[v]

  def stop(self, timeout_s: float = 120.0) -> bool:
    """Asks the thread to stop (at its next agreement) and joins it.

    Returns:
      True when the thread has ended within ``timeout_s``.
    """
    with self.cond:
      self.stop_requested = True
      self.cond.notify_all()
    self._thread.join(timeout_s)
    return not self._thread.is_alive()


def _fill(run, gen: Generator, carry: Carry, deadline: float) -> tuple[Carry, list[dict], float]:
  """Inserts finished rounds until the learner may draw (agreed over the learner mesh).

  Returns:
    (carry with the rounds inserted, their generation metrics, seconds waited).

  Raises:
    RuntimeError: a generator failed (on any process).
    NoBatchError: no batch before ``deadline``.
  """
  b, pending, waited = run.train.batch_size, [], 0.0
  while True:
    with gen.cond:
      local = len(gen.queue)
      failed = gen.error is not None
    n, ok = submesh.agree_min([local, int(not failed)], run.mesh)
    if not ok:
      raise RuntimeError(f"the generator failed: {gen.error!r}") from gen.error
    with gen.cond:
      rounds, gen.queue = gen.queue[:n], gen.queue[n:]
    buffer, limiter, ledger, position = (carry.buffer, carry.limiter_state, carry.ledger,
                                         carry.position)
    for rollout, produced in rounds:
      buffer, lost = run.fns.insert(buffer, rollout, jax.numpy.int32(carry.step))
      lost = jax.device_get(lost)
      limiter = rate_lib.record_insert(limiter, run.rollout.per_step)
      ledger = ledger + produced.ledger + Ledger(evicted_unused_rollouts=int(lost[0]),
                                                  evicted_unused_tokens=int(lost[1]))
      position = produced.position
      pending.append(produced.metrics)
    carry = carry.replace(buffer=buffer, limiter_state=limiter, ledger=ledger, position=position)
    size = _int(buffer.size)
    with gen.cond:
      gen.seen = (_int(limiter.inserted), _int(limiter.sampled), size)
      gen.cond.notify_all()
    if (rate_lib.can_sample(run.limiter, limiter, b, size)
        and run.fns.ready(buffer, carry.step)):
      return carry, pending, waited
    if time.monotonic() > deadline:
      raise NoBatchError(
          f"actor–learner split: no batch became available in {run.train.async_timeout_s:.0f} s "
          f"(inserted={_int(limiter.inserted)}, sampled={_int(limiter.sampled)}, buffer size="
          f"{size}; check buffer.max_staleness, buffer.max_times_sampled, buffer.sampler)")
    t0 = time.monotonic()
    with gen.cond:
      gen.cond.wait(POLL_S)
    waited += time.monotonic() - t0


def train_split(run, carry: Carry) -> Carry:
  """Learner steps ``carry.step .. train.steps − 1`` against a ``Generator`` on the
  generator mesh.

  Each step: insert the finished rounds every process holds, wait (polling) until the rate
  limiter and the buffer allow a batch, run the learner step, publish the weights to the
  generator every ``train.weight_sync_every`` steps, record the step. Before the last step's
  record (and checkpoint) the generator is stopped and the rounds it had queued or was
  generating are counted as lost, so a resumed run's ledger keeps them; an exception stops it
  too.

  Args:
    run: the ``build.Run`` (with ``generator_mesh`` and ``weight_sync``). carry: the start.

  Returns:
    The carry after the last step (timers include ``both_busy_s``).

  Raises:
    RuntimeError: the generator failed.
    NoBatchError: no batch for ``train.async_timeout_s`` seconds.
  """
  train, b = run.train, run.train.batch_size
  bar = progress.steps_bar(carry.step, train.steps, enabled=run.progress)
  t_start = time.monotonic()
  clock = BusyClock(t_start)
  t0 = carry.timers
  gen = Generator(run=run, params=run.weight_sync(carry.state.params), version=carry.step,
                  position=carry.position, inserted=_int(carry.limiter_state.inserted),
                  sampled=_int(carry.limiter_state.sampled), size=_int(carry.buffer.size),
                  key=carry_lib.generator_key(carry), clock=clock).start()
  learner_wait = 0.0
  try:
    for step in bar:
      # --- INSERT what the generator finished; WAIT until a batch may be drawn ------------
      carry, pending, waited = _fill(run, gen, carry, time.monotonic() + train.async_timeout_s)
      learner_wait += waited
      clock.set("learner", True)

      # --- SAMPLE + UPDATE -----------------------------------------------------------------
      trained = samples.peek_trained(run, carry.state.params, carry.buffer,
                                     jax.random.fold_in(carry.key, step), carry.state.step,
                                     step + 1)
      t1 = time.monotonic()
      state, buffer, metrics = run.fns.learner_step(carry.state, carry.buffer,
                                                    jax.random.fold_in(carry.key, step))
      metrics = jax.device_get(metrics)
      limiter = rate_lib.record_sample(carry.limiter_state, b)
      train_s = time.monotonic() - t1

      # --- PUBLISH the weights to the generator mesh ---------------------------------------
      if (step + 1) % train.weight_sync_every == 0:
        gen.publish(run.weight_sync(state.params), step + 1)
      with gen.cond:
        gen.seen = (_int(limiter.inserted), _int(limiter.sampled), _int(buffer.size))
        gen.cond.notify_all()
        gen_busy, gen_wait, swaps = gen.busy_seconds(time.monotonic()), gen.wait_s, gen.swaps

      # --- STOP the generator before the last record, so the final checkpoint counts what it
      # had queued or in flight (a resumed run regenerates those prompts) -------------------
      if step + 1 == train.steps:
        if not gen.stop():
          run.log("actor–learner split: the generator thread did not stop in time (left as a "
                  "daemon)")
        carry = carry.replace(ledger=carry.ledger + _lost(gen))

      # --- RECORD ----------------------------------------------------------------------------
      # one reading: the generator thread moves the clock meanwhile
      now, busy, both = clock.read()
      wall = max(now - t_start, 1e-9)
      timers = carry.timers.replace(generate_s=t0.generate_s + gen_busy,
                                    generator_wait_s=(t0.generator_wait_s or 0.0) + gen_wait,
                                    learner_wait_s=(t0.learner_wait_s or 0.0) + learner_wait,
                                    train_s=carry.timers.train_s + train_s,
                                    both_busy_s=(t0.both_busy_s or 0.0) + both)
      carry = carry.replace(state=state, buffer=buffer, limiter_state=limiter, timers=timers,
                            step=step + 1)
      extra = {"limiter_inserted": _int(limiter.inserted), "limiter_sampled": _int(limiter.sampled),
               "rollouts_since_last_step": len(pending) * run.rollout.per_step,
               "generator_idle": 1.0 - busy["generator"] / wall,
               "learner_idle": 1.0 - busy["learner"] / wall,
               "overlap": both / wall, "weight_swaps": swaps}
      gen_metrics = generation.mean_metrics(pending)
      carry = record_step(run, carry, metrics, gen_metrics, extra, trained=trained)
      clock.set("learner", False)
      bar.set_postfix(reward=f"{gen_metrics.get('reward', float('nan')):.2f}", refresh=False)
  finally:
    bar.close()
    if not gen.stop():
      run.log("actor–learner split: the generator thread did not stop in time (left as a daemon)")
  return carry


def _lost(gen: Generator) -> Ledger:
  """The ledger of what the stopped generator produced but the learner never inserted: the
  queued rounds' cost, and their rollouts plus an abandoned round's as lost."""
  with gen.cond:
    lost = sum(p.ledger.generated_rollouts for _, p in gen.queue) + gen.abandoned_rollouts
    spent = sum((p.ledger for _, p in gen.queue), Ledger())
    gen.queue, gen.abandoned_rollouts = [], 0
  return spent.replace(lost_in_flight_rollouts=lost)
