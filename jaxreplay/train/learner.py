"""INSERT and SAMPLE + UPDATE: the buffer's pure functions fused with the learner into jits.

``make_inserter`` wraps ``replay.add`` with the ledger's count of items overwritten before
any use; ``make_learner_step`` fuses ``replay.sample`` with ``rl.train_step`` so a learner
step is one compiled call with the train state and the buffer donated (PureJaxRL's shape:
the hot path is one jitted function assembled from pure pieces of ``replay`` and ``rl``).
With sequence packing (``algo.pack_sequences``) the number of packed rows is a static shape
chosen on the host from the drawn batch, so the step is two jitted calls around that choice.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay import replay
from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.replay import stats as replay_stats
from jaxreplay.rl import packing
from jaxreplay.rl.train_step import TrainState
from jaxreplay.train import accounting
from jaxreplay.train import shape_reuse


class LearnerFns(NamedTuple):
  """The jitted learner-side functions of a run, built once by ``build``.

  Attributes:
    insert: ``(buffer: BufferState, rollout: Rollout [R rows], step: int32 scalar) ->
      (buffer, lost: int32 [2])``: the R rollouts added FIFO; ``lost`` counts the
      overwritten items never trained on (rollouts, tokens). ``buffer`` is donated
      (``make_inserter``).
    learner_step: ``(state: TrainState, buffer: BufferState, key: PRNG key) -> (state,
      buffer, metrics: dict of scalars)``: SAMPLE B items at version ``state.step`` and
      UPDATE; ``state`` and ``buffer`` are donated (``make_learner_step``).
    ready: ``(buffer: BufferState, version: int) -> bool``: the buffer holds B items the
      sampler can draw at ``version`` — the learner may draw (``make_ready``; a host bool).
    drift: ``(params, buffer, key, version: int32 scalar) -> dict of scalars``: the drift
      monitor's pass (``drift.make_drift_fn``), or None when ``drift.every = 0``.
    noise: ``(params, buffer, key, version: int32 scalar) -> rl.noise.NoiseEstimate``: the
      self-tuning controller's noise estimate on a buffer sample
      (``rl.noise.make_buffer_noise_fn``), or None when ``auto_replay.enabled`` is False.
    trained: ``(params, buffer, key, version: int32 scalar) -> dict``: the first rows of the
      batch ``learner_step`` draws with the same key and version, scored
      (``samples.make_trained_fn``); None when ``log.record_every`` resolves to 0.
  """

  insert: Callable
  learner_step: Callable
  ready: Callable[..., bool]
  drift: Callable | None
  noise: Callable | None = None
  trained: Callable | None = None


def make_learner_step(train_step, rb: replay.ReplayBuffer,
                      cost: accounting.ModelCost | None = None, epochs: int = 1,
                      forwards: int = 0, mesh=None, state_sharding=None,
                      buffer_sharding=None, compile_cost_steps: float = 0.0):
  """Buffer sampling and the update as one learner step (state and buffer donated).

  The sampler's importance weights (uniform: all 1) and each item's staleness go to
  the train step; the batch statistics the paper plots come back in the metrics. The
  caller must ensure ``make_ready`` holds before each call: the draw then
  holds B distinct eligible items (or, with replacement, counts repeats exactly).

  Args:
    train_step: from ``rl.train_step.make_train_step``. rb: the buffer's function bundle
      (``replay.make_replay_buffer``: B, the sampler's spec, its ``sample``).
    cost: the model's FLOP parameters; with it the metrics carry ``training_flops``
      (``accounting.training_flops`` of each drawn item's real prompt and completion
      tokens, summed). epochs: ``algo.update_epochs``. forwards: the train step's
      gradient-free passes per item (``accounting.learner_forwards``).
    mesh: optional mesh: the sampled batch is constrained to split over ``data × fsdp``.
    state_sharding, buffer_sharding: optional sharding pytrees the returned state and
      buffer keep (the layout they were placed with).
    compile_cost_steps: ≥ 0 (``train.compile_cost_steps``): with packing, a batch whose
      own packed shape is not compiled runs in the cheapest compiled larger shape it fits
      while the work wasted on empty slots since the last compilation stays under this
      many steps; the batch that would reach it compiles its own
      (``shape_reuse.ShapeReuse``). 0 compiles every batch's own shape.

  Returns:
    ``learner_step(state, buffer, key) -> (state, buffer, metrics)``; metrics are
    scalars except ``staleness_hist`` / ``steps_since_last_use_hist`` ([16] int32).
    ``trained_tokens`` counts completion tokens with reuse; ``first_use_tokens`` those
    of items drawn for the first time (the "trained on at least once" ledger);
    ``batch_bad_slots`` the drawn slots that held no item, plus repeats in a draw without
    replacement (0 whenever ``make_ready`` held before the draw). When ``train_step`` packs
    sequences (it has ``plan_batch``), the step is a jitted draw (buffer donated), the
    packing plan of the drawn attention mask on the host, then a jitted update (state
    donated), and the metrics add ``learner_padding`` (empty ÷ all slots of the packed
    arrays), ``learner_slots`` (their slots, n_mb · S · R · W) and ``learner_shapes`` (the
    packed shapes compiled so far); ``learner_step.lower`` then lowers the fused full-width
    step, the packed step's upper bound in memory, and
    ``learner_step.lower_update(state, sample, plan)`` the packed update alone (what a
    packed step runs after the draw). Otherwise ``learner_step`` is the fused jitted step.
  """

  batch_size, sampler_cfg = rb.batch_size, rb.spec

  def draw(step, buffer: replay.BufferState, key):
    valid = buffer.valid
    never_used = valid & (buffer.times_sampled == 0)
    buffer, s = rb.sample(buffer, key, step, step)
    if mesh is not None:  # the batch splits over the batch axes (data × fsdp)
      s = s.replace(items=jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x, sharding_lib.batch_sharding(mesh, x.ndim, batch_size)), s.items))
    first_use = never_used & (buffer.times_sampled > 0)  # per slot: a duplicate counts once
    metrics = replay_stats.batch_stats(s)
    lengths = s.items.completion_mask.sum(-1, dtype=jnp.int32)
    metrics.update(batch_bad_slots=_bad_slots(valid, s, sampler_cfg),
                   trained_tokens=lengths.sum(),
                   batch_reward=s.items.rewards.mean(),
                   first_use_tokens=jnp.where(
                       first_use, buffer.items.completion_mask.sum(-1, dtype=jnp.int32), 0).sum())
    if cost is not None:
      prompt_lens = s.items.attention_mask.sum(-1, dtype=jnp.int32) - lengths
      metrics["training_flops"] = accounting.training_flops(cost, prompt_lens, lengths,
                                                            epochs, forwards).sum()
    if buffer_sharding is not None:
      buffer = jax.lax.with_sharding_constraint(buffer, buffer_sharding)
    return buffer, s, metrics

  def update(state: TrainState, s: replay.SampleResult, plan=None):
    kwargs = {} if plan is None else {"plan": plan}
    state, metrics = train_step(state, s.items, s.weights, s.staleness, **kwargs)
    if state_sharding is not None:
      state = jax.lax.with_sharding_constraint(state, state_sharding)
    return state, metrics

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused_step(state: TrainState, buffer: replay.BufferState, key):
    buffer, s, batch_metrics = draw(state.step, buffer, key)
    state, metrics = update(state, s)
    metrics.update(batch_metrics)
    return state, buffer, metrics

  fused_step = under_mesh(fused_step, mesh)
  plan_batch = getattr(train_step, "plan_batch", None)
  if plan_batch is None:
    return fused_step
  draw_jit = under_mesh(jax.jit(draw, donate_argnums=(1,)), mesh)
  update_jit = under_mesh(jax.jit(update, donate_argnums=(0,)), mesh)

  # With a mesh the packed rows split over the batch axes like the batch (R a multiple of
  # data × fsdp): each device runs the forward of its packed rows, and only the int32
  # token gather and the per-token outputs cross devices.
  shards = sharding_lib.batch_shards(mesh)
  reuse = shape_reuse.ShapeReuse(compile_cost_steps)

  def learner_step(state: TrainState, buffer: replay.BufferState, key):
    buffer, s, batch_metrics = draw_jit(state.step, buffer, key)
    mask = multihost.to_host(s.items.attention_mask)
    plan_args = dict(
        multiple=shards, completion=multihost.to_host(s.items.completion_mask),
        # host copies only where the plan needs them
        advantages=(multihost.to_host(s.items.advantages) if plan_batch.drops_zero_advantage
                    else None),
        tokens=multihost.to_host(s.items.tokens) if plan_batch.shares_prompts else None)

    def fit(shape):
      try:
        return plan_batch(mask, shape=shape, **plan_args)
      except ValueError:
        return None

    plan = plan_batch(mask, **plan_args)
    _, plan = reuse.choose(packing.plan_shape(plan), plan, lambda x: x.cost, fit)
    state, metrics = update_jit(state, s, sharding_lib.place_rows(plan, mesh))
    metrics.update(batch_metrics)
    metrics["learner_padding"] = np.float32(np.mean(plan.segment_ids == 0))
    metrics["learner_slots"] = np.int32(plan.segment_ids.size)
    metrics["learner_shapes"] = np.int32(len(reuse.compiled))
    return state, buffer, metrics

  learner_step.lower = fused_step.lower
  learner_step.lower_update = update_jit.lower
  return learner_step


def under_mesh(jitted, mesh):
  """``jitted`` (and its ``lower``) traced and run with ``mesh`` as the context mesh.

  The model's activation constraints and per-layer parameter gathers
  (``sharding.constrain_batch``, ``sharding.gather_params``) apply only under a context
  mesh; the learner's jits set it, so the update runs as FSDP on a mesh and exactly as
  before without one.

  Args:
    jitted: a ``jax.jit`` function. mesh: a ``Mesh``, or None (``jitted`` returned as is).

  Returns:
    A function with the signature of ``jitted`` and a ``lower`` attribute.
  """
  if mesh is None:
    return jitted

  @functools.wraps(jitted)
  def run(*args, **kwargs):
    with jax.set_mesh(mesh):
      return jitted(*args, **kwargs)

  def lower(*args, **kwargs):
    with jax.set_mesh(mesh):
      return jitted.lower(*args, **kwargs)

  run.lower = lower
  return run


def _bad_slots(valid_c, s: replay.SampleResult, cfg: replay.SamplerConfig) -> jax.Array:
  """int32 scalar: drawn slots that held no item or an item past ``cfg.max_staleness``,
  plus, for a draw without replacement, repeated slots."""
  bad = (~valid_c[s.indices]).sum(dtype=jnp.int32)
  if cfg.max_staleness is not None:
    bad += (s.staleness > cfg.max_staleness).sum(dtype=jnp.int32)
  if cfg.with_replacement:
    return bad
  idx = jnp.sort(s.indices)
  return bad + (idx[1:] == idx[:-1]).sum(dtype=jnp.int32)


def make_ready(rb: replay.ReplayBuffer):
  """Builds ``ready(buffer, version) -> bool scalar`` (jitted): the learner may draw.

  Reverb's minimum size, the same for every sampler: the buffer holds at least B items
  within ``max_staleness`` of ``version``, and the sampler can draw its batch as configured
  (``replay.can_sample``: B eligible items for a draw without replacement; one for
  samplers with replacement).

  Args:
    rb: the buffer's function bundle (B, the sampler's spec, its ``can_sample``).

  Returns:
    The function; ``buffer`` a ``replay.BufferState``, ``version`` an int32 scalar policy
    version; the result a bool scalar.
  """
  batch_size, sampler_cfg = rb.batch_size, rb.spec
  age_rule = (None if sampler_cfg.max_staleness is None
              else replay.SamplerConfig(max_staleness=sampler_cfg.max_staleness))

  @jax.jit
  def ready(buffer, version):
    drawable = buffer if age_rule is None else replay.evict(buffer, version, age_rule)
    return (rb.can_sample(buffer, current_version=version)
            & (drawable.size >= batch_size))

  return ready


def make_inserter(rb: replay.ReplayBuffer, n: int, buffer_sharding=None):
  """Builds ``insert(buffer, rollout, step) -> (buffer, lost)`` (jitted, buffer donated).

  Args:
    rb: the buffer's function bundle (its ``add``). n: R, rollouts per insert (static).
    buffer_sharding: optional sharding pytree the returned buffer keeps.

  Returns:
    The function. ``lost`` is ``(rollouts, tokens)``, int32 scalars, of the slots the add
    overwrites before they were ever sampled (``accounting.unused_overwritten``),
    counted before the add.
  """

  @functools.partial(jax.jit, donate_argnums=(0,),
                     out_shardings=None if buffer_sharding is None else (buffer_sharding, None))
  def insert(buffer, rollout, step):
    lost = accounting.unused_overwritten(buffer, n)
    return rb.add(buffer, rollout, rollout.policy_version, step), lost

  return insert
