"""The loop's carry: everything a learner step changes, and its checkpoint round trip.

A ``Carry`` is a frozen value; each step returns a new one (``dataclasses.replace``).
``save`` writes it with Orbax (arrays: train state, buffer, RNG, parameter ring, limiter;
JSON: ledger, timers, data position, evaluations, the self-tuning controller's state), and
``resume`` restores the newest readable checkpoint into the fresh carry's layout — or, on a
fresh run, evaluates the starting policy (the "before" of every comparison).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import numpy as np

from jaxreplay.parallel import multihost
from jaxreplay.replay.auto import AutoReplayState
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train.ledger import Ledger, Timers


@dataclasses.dataclass(frozen=True)
class Carry:
  """State threaded through the learner steps.

  Attributes:
    state: ``rl.train_step.TrainState`` (device, sharded; ``state.step`` = policy version).
    buffer: ``replay.BufferState`` of ``Rollout`` items (device, capacity axis sharded).
    ring: tuple of ``lag`` parameter states, oldest first: the policies of learner steps
      t − lag .. t − 1 that the lagged strategy generates with (empty for ``sync``).
    limiter_state: ``replay.rate_limiter.RateLimiterState`` (used by ``async``).
    key: the root PRNG key; step t uses ``fold_in(key, t)``.
    ledger: ``Ledger`` totals. timers: ``Timers`` totals (seconds).
    position: int, data position (prompts consumed from the train stream).
    step: int, learner steps completed.
    eval_before: held-out evaluation of the starting policy (dict), or None until made.
    last_eval: the latest held-out evaluation (dict), or None.
    best: (step, eval/acc_sampled) of the best checkpoint kept, or None.
    skips: consecutive learner steps skipped for non-finite values.
    wall_before: seconds this run spent in earlier processes (before a resume).
    auto: the self-tuning controller's ``replay.auto.AutoReplayState`` (R and the age
      cut-off in force, its running estimates and change log), or None when
      ``auto_replay.enabled`` is False.
  """

  state: Any
  buffer: Any
  ring: tuple
  limiter_state: Any
  key: jax.Array
  ledger: Ledger
  timers: Timers
  position: int
  step: int
  eval_before: dict | None = None
  last_eval: dict | None = None
  best: tuple | None = None
  skips: int = 0
  wall_before: float = 0.0
  auto: Any = None

  def replace(self, **changes) -> "Carry":
    """A copy with ``changes`` applied (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


def eval_key(carry: Carry) -> jax.Array:
  """Key of the held-out evaluations, disjoint from the per-step keys ``fold_in(key, t)``."""
  return jax.random.fold_in(carry.key, 2**31 - 1)


def drift_key(carry: Carry) -> jax.Array:
  """Key of the drift monitor's buffer samples."""
  return jax.random.fold_in(carry.key, 2**31 - 2)


def generator_key(carry: Carry) -> jax.Array:
  """Key of the ``async`` generator thread's stream."""
  return jax.random.fold_in(carry.key, 2**31 - 3)


def noise_key(carry: Carry) -> jax.Array:
  """Key of the self-tuning controller's noise estimates (``train.self_tuning``)."""
  return jax.random.fold_in(carry.key, 2**31 - 4)


def checkpoint_tree(run, carry: Carry) -> dict:
  """The arrays a checkpoint holds: train state, buffer, RNG key data (replicated), the
  parameter ring when the lagged strategy has one, the limiter's counters in ``async``."""
  tree = {"train": carry.state, "buffer": carry.buffer,
          "rng": multihost.to_global(jax.random.key_data(carry.key), run.replicated)}
  if carry.ring:
    tree["snapshots"] = list(carry.ring)
  if run.is_async:  # host counters, saved as replicated arrays (every process holds them)
    tree["limiter"] = jax.tree.map(
        lambda x: multihost.to_global(np.asarray(multihost.to_host(x)), run.replicated),
        carry.limiter_state)
  return tree


def save(run, carry: Carry) -> None:
  """Starts an asynchronous Orbax save of ``carry`` at step ``carry.step``; ``finish`` (or
  the next save) waits for it.

  Raises:
    RuntimeError: Orbax declined the save (``checkpoint.save``: the step is not after the
      latest checkpoint).
  """
  meta = {"step": carry.step, "counts": carry.ledger.as_dict(), "data_position": carry.position,
          "eval_before": carry.eval_before, "last_eval": carry.last_eval,
          "timers": carry.timers.as_dict(),
          "wall_seconds": carry.wall_before + time.time() - run.t_start,
          "config": json.loads(run.config_json)}
  if carry.auto is not None:  # the controller's state, exactly (``AutoReplayState.to_dict``)
    meta["auto_replay"] = carry.auto.to_dict()
  ckpt_lib.save(run.manager, carry.step, checkpoint_tree(run, carry), meta)


def resume(run, fresh: Carry) -> Carry:
  """The carry to start from: the newest readable checkpoint restored into ``fresh``'s
  layout (any saved mesh restores), or ``fresh`` with the starting policy evaluated.

  Args:
    run: the ``build.Run``. fresh: the carry ``build`` returned.

  Returns:
    The carry at the restored step (or step 0 with ``eval_before`` set and written to the
    metrics as step 0).

  Raises:
    RuntimeError: checkpoints exist but none could be read (``checkpoint.restore``).
    jaxreplay.train.checkpoint.CheckpointReadError: a checkpoint failed to read for a
      reason other than corruption (out of memory, I/O, permissions, missing storage):
      the run stops and every checkpoint stays in place.
  """
  restored = ckpt_lib.restore(run.manager, checkpoint_tree(run, fresh), log=run.log)
  if restored is None:
    from jaxreplay.train.record import evaluate_and_record
    before = evaluate_and_record(run, fresh.state.params, jax.random.fold_in(eval_key(fresh), 0),
                                 0)
    run.writer.write(0, {f"eval/{k}": v for k, v in before.items()})
    grades = "".join(f"; {g}: greedy {before[f'acc_greedy_{g}']:.3f}, sampled "
                     f"{before[f'acc_sampled_{g}']:.3f}" for g in ("strict", "lenient")
                     if f"acc_sampled_{g}" in before)
    run.log(f"held-out before RL: greedy {before['acc_greedy']:.3f}, "
            f"sampled {before['acc_sampled']:.3f}{grades}")
    return fresh.replace(eval_before=before, last_eval=dict(before))
  tree, meta = restored
  carry = fresh.replace(
      state=tree["train"], buffer=tree["buffer"],
      ring=tuple(tree.get("snapshots", fresh.ring)),
      limiter_state=tree.get("limiter", fresh.limiter_state),
      key=jax.random.wrap_key_data(tree["rng"]), step=int(meta["step"]),
      ledger=Ledger.from_dict(meta["counts"]),
      timers=Timers.from_dict({**fresh.timers.as_dict(), **meta.get("timers", {})}),
      position=meta["data_position"], eval_before=meta["eval_before"],
      last_eval=dict(meta.get("last_eval", meta["eval_before"])),
      wall_before=meta.get("wall_seconds", 0.0),
      auto=(AutoReplayState.from_dict(meta["auto_replay"]) if "auto_replay" in meta
            else fresh.auto))
  run.log(f"resumed from {run.manager.directory} at step {carry.step}")
  return carry
