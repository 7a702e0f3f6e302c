"""The lagged strategy: one process, generation from the policy ``lag`` versions back.

Each learner step t (Arnal et al. 2026, §4):
  GENERATE  R = P·G rollouts with the parameters of version max(t − lag, 0), scored, with
            group advantages;
  INSERT    them into the FIFO buffer (capacity N), oldest overwritten — and, while the
            buffer holds fewer than B items or the sampler cannot draw its batch
            (``learner.make_ready``: at the start when B > R, or after evictions), generate
            and insert another R from the same policy (Reverb's minimum size before
            sampling; every round is counted in the ledger);
  SAMPLE + UPDATE  B items from the buffer and one off-policy update (importance ratio
            against the stored behaviour log-probs), fused in one jitted call;
  RECORD    ledger, metrics, evaluation, checkpoint.

With ``auto_replay.enabled`` the self-tuning controller (``self_tuning``) estimates the
buffer's noise between INSERT and UPDATE every ``auto_replay.every`` steps, decides in
RECORD, and the next step runs with its R and age cut-off.

``sync`` is lag 0 (the paper's theory model: generate with the current policy, then
train); ``simulated_async`` with ``train.lag = L`` gives the staleness of an
asynchronous system bit-reproducibly. The ring of the last ``lag`` parameter snapshots is
part of the carry (and of the checkpoint), so resuming continues the same trajectory.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxreplay.parallel import multihost
from jaxreplay.train import generation, progress, samples
from jaxreplay.train import self_tuning
from jaxreplay.train.carry import Carry
from jaxreplay.train.ledger import Ledger
from jaxreplay.train.record import record_step


def behaviour_params(ring: tuple, params):
  """The parameters that generate this step's rollouts: the oldest snapshot of the ring
  (``lag`` steps old; the starting parameters while fewer than ``lag`` steps have been
  taken), or ``params`` (the current ones) when the ring is empty (lag 0)."""
  return ring[0] if ring else params


def behaviour_version(step: int, lag: int) -> int:
  """Policy version stamped on the rollouts generated at learner step ``step``:
  max(step − lag, 0)."""
  return max(step - lag, 0)


def advance_ring(ring: tuple, params) -> tuple:
  """The ring for the next step: drops the oldest snapshot, appends a copy of ``params``
  (a fresh device copy: the learner step donates ``params``' buffers)."""
  return ring[1:] + (jax.tree.map(jnp.copy, params),) if ring else ring


def generate_and_insert(run, carry: Carry, step: int, key) -> tuple[Carry, dict]:
  """GENERATE + INSERT of learner step ``step``: R rollouts from the behaviour policy
  (``behaviour_params``, ``behaviour_version``) added to the buffer, then further rounds of
  R while ``run.ready`` says the learner may not draw yet (``learner.make_ready``).

  Args:
    run: the ``build.Run``. carry: the carry before the step. step: t.
    key: PRNG key of the first round (round k > 0 uses ``fold_in(key, k)``).

  Returns:
    (the carry with buffer, ledger and data position advanced; generation metrics, the
     mean over rounds plus ``generation_rounds``).

  Raises:
    RuntimeError: the sampler still cannot draw a batch once a whole buffer of this
      step's rollouts has been generated (an eviction rule that keeps fewer than B items).
  """
  params = behaviour_params(carry.ring, carry.state.params)
  version = behaviour_version(step, run.lag)
  # After this many rounds the whole buffer holds rollouts of this step: if the sampler
  # still cannot draw a batch, no amount of generation will let it.
  max_rounds = -(-run.buffer.capacity // run.rollout.per_step) + 1
  rounds = []
  while True:
    rollout, produced = generation.generate_rollouts(
        run.source, params, carry.position,
        key if not rounds else jax.random.fold_in(key, len(rounds)), version,
        carry.state.ref_params)
    buffer, lost = run.fns.insert(carry.buffer, rollout, jnp.int32(step))
    lost = multihost.to_host(lost)
    carry = carry.replace(buffer=buffer, position=produced.position,
                          ledger=carry.ledger + produced.ledger
                          + Ledger(evicted_unused_rollouts=int(lost[0]),
                                   evicted_unused_tokens=int(lost[1])))
    rounds.append(produced.metrics)
    if run.fns.ready(carry.buffer, step):
      return carry, {**generation.mean_metrics(rounds), "generation_rounds": len(rounds)}
    if len(rounds) >= max_rounds:
      raise RuntimeError(
          f"step {step}: the buffer holds fewer than train.batch_size={run.train.batch_size} "
          f"items the sampler may draw after {len(rounds)} rounds of generation; check "
          "buffer.max_staleness, buffer.max_times_sampled and buffer.sampler (positive_bias "
          "needs enough correct rollouts when (1 - delta) * positive_bias_size < B)")


def train_lagged(run, carry: Carry) -> Carry:
  """Learner steps ``carry.step .. train.steps − 1`` of the lagged strategy, or until the
  step at which the generation budget ``train.max_generated_rollouts`` is spent.

  Args:
    run: the ``build.Run`` (``run.lag`` is the version lag). carry: the starting carry.

  Returns:
    The carry after the last step.

  Raises:
    RuntimeError: ``algo.max_consecutive_skips`` non-finite updates in a row; a batch the
      sampler cannot fill (``generate_and_insert``).
  """
  bar = progress.steps_bar(carry.step, run.train.steps, enabled=run.progress)
  run = self_tuning.apply(run, carry.auto)  # a resumed run: the controller's R and cut-off
  self_tuning.log_state(run, carry.auto)
  for step in bar:
    if run.train.budget_reached(carry.ledger.generated_rollouts):
      break  # the generation budget is spent (train.max_generated_rollouts)
    key_gen, key_sample = jax.random.split(jax.random.fold_in(carry.key, step))
    t0 = time.time()

    # --- GENERATE with the policy of version t − lag, then INSERT --------------------------
    carry, gen_metrics = generate_and_insert(run, carry, step, key_gen)
    t1 = time.time()
    # self-tuning: the noise of the buffer the learner is about to draw from (timed apart)
    noise = self_tuning.estimate(run, carry, step) if self_tuning.due(run, step) else None
    t1n = time.time()
    ring = advance_ring(carry.ring, carry.state.params)  # versions t − lag + 1 .. t

    # --- SAMPLE + UPDATE (the rows it trains on read first, at the steps that record them) --
    trained = samples.peek_trained(run, carry.state.params, carry.buffer, key_sample,
                                   carry.state.step, step + 1)
    state, buffer, metrics = run.fns.learner_step(carry.state, carry.buffer, key_sample)
    metrics = multihost.to_host(metrics)  # gathered across processes when sharded
    t2 = time.time()

    # --- RECORD (and the controller's decision) --------------------------------------------
    timers = carry.timers.replace(generate_s=carry.timers.generate_s + t1 - t0,
                                  train_s=carry.timers.train_s + t2 - t1n)
    carry = carry.replace(state=state, buffer=buffer, ring=ring, timers=timers, step=step + 1)
    carry = record_step(run, carry, metrics, gen_metrics, self_tuning.step_metrics(run), noise,
                        trained)
    run = self_tuning.apply(run, carry.auto)  # the next step's R and age cut-off
    bar.set_postfix(reward=f"{gen_metrics['reward']:.2f}",
                    acc=f"{carry.last_eval['acc_sampled']:.2f}", refresh=False)
  bar.close()
  return carry
