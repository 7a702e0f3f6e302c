"""A device-resident FIFO ring buffer over any pytree of arrays with a leading item axis.

State is a ``flax.struct.dataclass``; ``init`` / ``add`` / ``sample`` / ``evict`` are pure
functions that compose with ``jit`` and ``donate_argnums`` (writes use ``.at[].set``, which
XLA performs in place on a donated buffer, so no capacity-sized copy is made per call).
``make_replay_buffer`` bundles them, jitted with the state donated. The buffer knows nothing
of models or losses: items are pytrees; besides the ``policy_version`` it is given, it reads
only per-item rewards and advantages (taken from ``items.rewards`` / ``items.advantages`` when
the items have them, or passed explicitly) for the positive-bias and priority samplers.

Samplers (``SamplerConfig.sampler``; Arnal et al. 2026 §3.1, App. 8.5, 10.4):
  uniform (default, no duplicates in a batch; work independent of C on a buffer made with
  ``init(..., evicts=False)``, and O(C) once eviction may have left holes), recency,
  priority, positive_bias, fresh_first, and a group-preserving mode. Each returns with the
  batch the probabilities it used.

Sharding: every [C, ...] leaf may be sharded along C over a mesh axis (``shard``); the
functions are written with global indices, so GSPMD partitions them and the results are
identical to one device (tested).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jaxreplay.replay import samplers as S
from jaxreplay.replay.config import SAMPLERS, SamplerConfig

__all__ = ["SAMPLERS", "BufferState", "SampleResult", "init", "add", "sample", "evict",
           "probabilities", "can_sample", "size", "set_columns", "shard", "state_sharding",
           "ReplayBuffer", "make_replay_buffer"]

DEFAULT_CONFIG = SamplerConfig()


# Columns of ``BufferState.meta`` ([C, 5] int32) and ``BufferState.scores`` ([C, 2] float32).
# Per-slot bookkeeping is packed into these two arrays rather than seven [C] vectors: an
# ``add`` or ``sample`` then touches 2 bookkeeping buffers, not 7, and every array a jitted
# call donates or returns costs host time on XLA:CPU (see bench/buffer.py).
POLICY_VERSION, INSERT_STEP, TIMES_SAMPLED, LAST_SAMPLED_STEP, VALID = range(5)
REWARD, ADVANTAGE = range(2)
WRITE_INDEX, SIZE, TOTAL_INSERTED = range(3)  # columns of ``BufferState.counters`` ([3] int32)
_META_COLUMNS = {"policy_version": POLICY_VERSION, "insert_step": INSERT_STEP,
                 "times_sampled": TIMES_SAMPLED, "last_sampled_step": LAST_SAMPLED_STEP,
                 "valid": VALID}
_SCORE_COLUMNS = {"reward": REWARD, "advantage": ADVANTAGE}
_COUNTER_COLUMNS = {"write_index": WRITE_INDEX, "size": SIZE, "total_inserted": TOTAL_INSERTED}


@flax.struct.dataclass
class BufferState:
  """Ring-buffer state for capacity C.

  Attributes:
    items: pytree, every leaf [C, ...].
    meta: [C, 5] int32 per-slot bookkeeping, columns ``POLICY_VERSION``, ``INSERT_STEP``,
      ``TIMES_SAMPLED``, ``LAST_SAMPLED_STEP``, ``VALID`` (0 / 1); read them through the
      properties below.
    scores: [C, 2] float32, columns ``REWARD``, ``ADVANTAGE``.
    counters: [3] int32, columns ``WRITE_INDEX``, ``SIZE``, ``TOTAL_INSERTED`` (one array,
      not three scalars, because every array a jitted ``add`` returns costs host time).
    may_have_holes: static bool (part of the tree structure, not a leaf). When False, no
      item has been evicted, so the valid slots are exactly the ``size`` written last and
      the uniform sampler maps ranks to slots with no check (no conditional in the compiled
      code, which costs XLA:CPU time); when True it checks, O(C) if there are holes.
      ``init`` sets it unless told ``evicts=False``; ``evict`` with a rule and
      ``set_columns(state, valid=...)`` / ``set_columns(state, meta=...)`` set it.

  Properties (views of ``meta`` / ``scores`` / ``counters``, with a leading batch axis if the
  state is stacked; ``set_columns`` takes them as keywords). ``size`` equals the number of
  valid slots: ``add`` and ``evict`` keep it so, and a caller that sets ``valid`` sets it
  too. ``replace`` is the plain dataclass replace (field names only).
    policy_version: [C] int32, version that generated each item.
    insert_step: [C] int32, learner step at insertion.
    times_sampled: [C] int32, number of draws of the item so far.
    last_sampled_step: [C] int32, learner step of the last draw (−1 never).
    valid: [C] bool, slot holds a live item.
    reward: [C] float32, the item's reward (correct ⇔ reward >= ``correct_threshold``).
    advantage: [C] float32, the item's advantage (priority sampler).
    write_index: int32 scalar, next slot to write (the oldest written slot once full).
    size: int32 scalar, number of valid slots.
    total_inserted: int32 scalar, items ever added.
  """

  items: Any
  meta: jax.Array
  scores: jax.Array
  counters: jax.Array
  may_have_holes: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def capacity(self) -> int:
    """C (static)."""
    return self.meta.shape[0]

  policy_version = property(lambda self: self.meta[..., POLICY_VERSION])
  insert_step = property(lambda self: self.meta[..., INSERT_STEP])
  times_sampled = property(lambda self: self.meta[..., TIMES_SAMPLED])
  last_sampled_step = property(lambda self: self.meta[..., LAST_SAMPLED_STEP])
  valid = property(lambda self: self.meta[..., VALID] != 0)
  reward = property(lambda self: self.scores[..., REWARD])
  advantage = property(lambda self: self.scores[..., ADVANTAGE])
  write_index = property(lambda self: self.counters[..., WRITE_INDEX])
  size = property(lambda self: self.counters[..., SIZE])
  total_inserted = property(lambda self: self.counters[..., TOTAL_INSERTED])


# Columns of ``SampleResult.per_item`` ([B, 4] int32) and ``SampleResult.sampling``
# ([B, 2] float32): packed like ``BufferState.meta`` because every array a jitted ``sample``
# returns costs host time on XLA:CPU (see bench/buffer.py).
INDEX, STALENESS, TIMES_SAMPLED_BEFORE, STEPS_SINCE_LAST_USE = range(4)
PROB, WEIGHT = range(2)


@flax.struct.dataclass
class SampleResult:
  """A sampled batch of B items.

  Attributes:
    items: pytree with leaves [B, ...].
    per_item: [B, 4] int32, columns ``INDEX``, ``STALENESS``, ``TIMES_SAMPLED_BEFORE``,
      ``STEPS_SINCE_LAST_USE``; read them through the properties below.
    sampling: [B, 2] float32, columns ``PROB``, ``WEIGHT``.

  Properties (views of ``per_item`` / ``sampling``; ``set_columns`` takes them as keywords):
    indices: [B] int32 slots.
    probs: [B] float32, marginal probability that one batch position holds this slot, so it
      sums to 1 over the valid slots (with replacement: the per-draw probability P(i);
      uniform without replacement over n items: 1/n).
    weights: [B] float32 importance weights (N·P(i))^−β / max_j (CASES.md case 13); exactly
      1.0 for the uniform-family samplers (uniform, positive_bias, fresh_first).
    staleness: [B] int32, current version − generation version (policy versions).
    times_sampled_before: [B] int32, draws before this batch (0 = never used).
    steps_since_last_use: [B] int32, learner steps since the previous draw; −1 if never used.
  """

  items: Any
  per_item: jax.Array
  sampling: jax.Array

  indices = property(lambda self: self.per_item[..., INDEX])
  staleness = property(lambda self: self.per_item[..., STALENESS])
  times_sampled_before = property(lambda self: self.per_item[..., TIMES_SAMPLED_BEFORE])
  steps_since_last_use = property(lambda self: self.per_item[..., STEPS_SINCE_LAST_USE])
  probs = property(lambda self: self.sampling[..., PROB])
  weights = property(lambda self: self.sampling[..., WEIGHT])


_PER_ITEM_COLUMNS = {"indices": INDEX, "staleness": STALENESS,
                     "times_sampled_before": TIMES_SAMPLED_BEFORE,
                     "steps_since_last_use": STEPS_SINCE_LAST_USE}
_SAMPLING_COLUMNS = {"probs": PROB, "weights": WEIGHT}


_PACKED = {  # per class: packed field -> (column name -> index on the last axis, dtype)
    BufferState: {"meta": (_META_COLUMNS, jnp.int32), "scores": (_SCORE_COLUMNS, jnp.float32),
                  "counters": (_COUNTER_COLUMNS, jnp.int32)},
    SampleResult: {"per_item": (_PER_ITEM_COLUMNS, jnp.int32),
                   "sampling": (_SAMPLING_COLUMNS, jnp.float32)},
}


def _set(obj, **updates):
  """``set_columns`` without the ``may_have_holes`` rule (the buffer's own writes)."""
  packed = _PACKED[type(obj)]
  arrays = {field: updates.pop(field, getattr(obj, field)) for field in packed}
  for field, (columns, dtype) in packed.items():
    for name in [k for k in updates if k in columns]:
      arrays[field] = arrays[field].at[..., columns[name]].set(
          jnp.asarray(updates.pop(name), dtype))
  return dataclasses.replace(obj, **arrays, **updates)


def set_columns(obj: BufferState | SampleResult, **updates) -> BufferState | SampleResult:
  """A copy of a ``BufferState`` or ``SampleResult`` with whole arrays and named columns set.

  Keywords are the dataclass fields (``items=``, ``meta=``, ``counters=``, ``per_item=`` ...)
  and the column names, i.e. the properties (``valid=``, ``times_sampled=``, ``size=``,
  ``write_index=``, ``weights=``, ``staleness=`` ...). Whole-array updates apply first, then
  column updates, so ``set_columns(s, counters=c, size=2)`` is ``c`` with its ``SIZE``
  column set to 2. Columns are on the last axis, so stacked states (a leading batch axis)
  work too; each value is cast to its array's dtype and broadcast into the column.

  On a ``BufferState``, setting ``valid`` or ``meta`` (which holds the valid column) marks
  the result ``may_have_holes`` unless ``may_have_holes`` is given: a hole made this way
  is then seen by ``sample``. Set ``size`` with ``valid``. ``.replace``, the plain
  dataclass replace, takes fields only and never marks; do not evict with it.

  Args:
    obj: a ``BufferState`` or ``SampleResult``.
    **updates: field or column name -> array (or, for ``may_have_holes``, a bool).

  Returns:
    A new object of ``obj``'s type; ``obj`` is unchanged.

  Raises:
    TypeError: ``obj`` of another type, or a keyword that is neither a field nor a column.
  """
  packed = _PACKED.get(type(obj))
  if packed is None:
    raise TypeError(f"set_columns takes a BufferState or SampleResult, not {type(obj).__name__}")
  names = {f.name for f in dataclasses.fields(obj)}
  names |= {c for columns, _ in packed.values() for c in columns}
  unknown = sorted(set(updates) - names)
  if unknown:
    raise TypeError(f"set_columns({type(obj).__name__}) got unknown keywords {unknown}; "
                    f"valid ones are {sorted(names)}")
  if (isinstance(obj, BufferState) and ("valid" in updates or "meta" in updates)
      and "may_have_holes" not in updates):
    updates["may_have_holes"] = True
  return _set(obj, **updates)


def init(example_items: Any, capacity: int, *, evicts: bool = True) -> BufferState:
  """An empty buffer shaped like ``example_items``.

  Args:
    example_items: pytree with leaves [N, ...] (N is ignored; dtypes and trailing shapes kept).
    capacity: C >= 1.
    evicts: whether items may leave other than by being overwritten (a ``SamplerConfig``
      with ``max_staleness`` or ``max_times_sampled``, i.e. ``spec.evicts``, or direct
      ``evict`` calls); sets ``may_have_holes``. The default True is always correct. Pass
      False (as ``make_replay_buffer`` and the trainer do for configs without eviction) for
      the fast uniform draw; if an eviction happens anyway, the state is marked then — its
      static structure changes, so a jitted function retraces once, and a ``lax.scan`` /
      ``lax.cond`` carrying it, or fixed ``out_shardings``, reject the changed structure.

  Raises:
    ValueError: ``capacity`` < 1.
  """
  if not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"buffer.capacity={capacity!r} is invalid: must be an int >= 1")
  items = jax.tree.map(lambda x: jnp.zeros((capacity,) + tuple(x.shape[1:]), x.dtype),
                       example_items)
  meta = jnp.zeros((capacity, len(_META_COLUMNS)), jnp.int32).at[:, LAST_SAMPLED_STEP].set(-1)
  return BufferState(items=items, meta=meta,
                     scores=jnp.zeros((capacity, len(_SCORE_COLUMNS)), jnp.float32),
                     counters=jnp.zeros((3,), jnp.int32), may_have_holes=bool(evicts))


def _per_item(values, items, field: str, n: int) -> jax.Array:
  if values is None:
    values = items.get(field) if isinstance(items, dict) else getattr(items, field, None)
  if values is None:
    return jnp.zeros((n,), jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  if values.shape != (n,):
    raise ValueError(f"{field} has shape {values.shape}; expected ({n},)")
  return values


def add(state: BufferState, items: Any, policy_version: jax.Array, step: jax.Array, *,
        rewards: jax.Array | None = None, advantages: jax.Array | None = None) -> BufferState:
  """Writes N items at ``write_index`` modulo C, overwriting the oldest slots (FIFO).

  If N > C only the newest C items are kept (in insertion order). Overwriting a slot
  resets its use counters. Cost O(N) (plus the item bytes); no capacity-sized copy when the
  state is donated.

  Args:
    state: buffer state.
    items: pytree, leaves [N, ...] (same structure, dtypes cast to the buffer's).
    policy_version: [N] int32 generating versions.
    step: int32 scalar learner step.
    rewards: [N] float32 or None (then ``items.rewards`` if present, else 0).
    advantages: [N] float32 or None (then ``items.advantages`` if present, else 0).

  Returns:
    The new state.

  Raises:
    ValueError: ``policy_version`` / rewards / advantages not of shape [N], or leaves whose
      leading axis differs from N.
  """
  c = state.capacity
  policy_version = jnp.asarray(policy_version)
  if policy_version.ndim != 1:
    raise ValueError(f"policy_version has shape {policy_version.shape}; expected [N]")
  n_in = policy_version.shape[0]
  for leaf in jax.tree.leaves(items):
    if leaf.shape[:1] != (n_in,):
      raise ValueError(f"item leaf of shape {leaf.shape} does not lead with N={n_in}")
  rewards = _per_item(rewards, items, "rewards", n_in)
  advantages = _per_item(advantages, items, "advantages", n_in)
  n = min(n_in, c)
  keep = lambda x: x[n_in - n:]  # static: keep the newest C
  items, policy_version, rewards, advantages = jax.tree.map(
      keep, (items, policy_version, rewards, advantages))
  start = (state.write_index + (n_in - n)) % c
  # Both terms are >= 0, so lax.rem is the modulo (jnp's `%` adds sign fix-ups per item).
  idx = lax.rem(start + jnp.arange(n, dtype=jnp.int32), jnp.int32(c))
  # Live items among the n slots about to be overwritten (they leave `size`), read from two
  # n-slot windows of the VALID column instead of gathered at `idx`: XLA:CPU splits a gather
  # from a large array over threads, which costs more than the 64 reads. Window 1 ends at or
  # starts with `start`; window 2 holds the slots written after the ring wraps to 0.
  t = jnp.arange(n, dtype=jnp.int32)
  p1 = jnp.minimum(start, c - n)
  window1 = lax.dynamic_slice(state.meta, (p1, VALID), (n, 1))[:, 0]
  window2 = state.meta[:n, VALID]
  overwritten = jnp.concatenate([jnp.where(t >= start - p1, window1, 0),
                                 jnp.where(t < start + n - c, window2, 0)]).sum(dtype=jnp.int32)
  # New rows are computed from that read (1 + min(count, 0) is 1) so that XLA orders it
  # before the in-place write of `meta`; without the data dependence it copies all of `meta`.
  meta_new = jnp.stack([policy_version.astype(jnp.int32), jnp.full((n,), step, jnp.int32),
                        jnp.zeros((n,), jnp.int32), jnp.full((n,), -1, jnp.int32),
                        jnp.full((n,), 1 + jnp.minimum(overwritten, 0))],
                       axis=1)  # column order of `meta`
  # idx: N <= C distinct in-range slots, so XLA may scatter without collision handling.
  put = lambda buf, new: buf.at[idx].set(new.astype(buf.dtype), unique_indices=True,
                                         mode="promise_in_bounds")
  return _set(
      state,
      items=jax.tree.map(put, state.items, items),
      meta=put(state.meta, meta_new),
      scores=put(state.scores, jnp.stack([rewards, advantages], axis=1)),
      counters=jnp.stack([(start + n) % c, state.size + n - overwritten,  # one fusion
                          state.total_inserted + n_in]).astype(jnp.int32),
  )


def evict(state: BufferState, current_version: jax.Array,
          spec: SamplerConfig = DEFAULT_CONFIG) -> BufferState:
  """Drops items beyond ``spec.max_staleness`` versions or with ``spec.max_times_sampled`` uses.

  ``sample`` applies it (age before drawing, use count after), so calling it directly is
  only needed to inspect or checkpoint an evicted state. O(C) when a rule is on; a no-op
  (traces to nothing) when neither is.

  Args:
    state: buffer state. current_version: int32 scalar policy version. spec: static config.

  Returns:
    The state with evicted slots invalid, ``size`` reduced and, when a rule is on,
    ``may_have_holes`` set.
  """
  if not spec.evicts:
    return state
  drop = jnp.zeros_like(state.valid)
  if spec.max_staleness is not None:
    drop = drop | (current_version - state.policy_version > spec.max_staleness)
  if spec.max_times_sampled is not None:
    drop = drop | (state.times_sampled >= spec.max_times_sampled)
  drop = drop & state.valid
  n_drop = drop.sum(dtype=jnp.int32)
  # `n_drop >= 0` is always true; it makes the in-place write of `meta` wait for the count
  # (which reads `meta`), so XLA needs no copy of `meta` to keep that read safe.
  return _set(state, may_have_holes=True, valid=state.valid & ~drop & (n_drop >= 0),
              size=(state.size - n_drop).astype(jnp.int32))


def _is_contiguous(state: BufferState) -> jax.Array:
  """bool scalar: the valid slots are exactly the ``size`` slots written last (no holes)."""
  return state.size == jnp.minimum(state.total_inserted, state.capacity)


def _correct(state: BufferState, spec: SamplerConfig) -> jax.Array:
  return state.reward >= spec.correct_threshold


def _weights(state: BufferState, current_version: jax.Array, batch_size: int,
             spec: SamplerConfig) -> jax.Array:
  """[C] float32 probabilities of the samplers that are not of the uniform family."""
  valid = state.valid
  if spec.sampler == "recency":
    if spec.recency == "exponential":
      s = (current_version - state.policy_version).astype(jnp.float32)
      s_min = jnp.min(jnp.where(valid, s, jnp.inf))
      w = jnp.exp(-(s - s_min) / spec.recency_temperature)
    else:
      rank = S.rank_by_freshness(valid, state.write_index).astype(jnp.float32)
      w = jnp.exp(rank * jnp.log1p(-spec.recency_p))
  elif spec.sampler == "priority":
    w = (jnp.abs(state.advantage) + spec.priority_eps) ** spec.priority_alpha
  else:
    raise AssertionError(spec.sampler)
  w = jnp.where(valid, w, 0.0)
  total = w.sum()
  uniform = valid.astype(jnp.float32) / jnp.maximum(state.size, 1).astype(jnp.float32)
  return jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), uniform)


def _eligible(state: BufferState, spec: SamplerConfig) -> jax.Array:
  """[C] bool slots a uniform-family sampler may draw (group mode: slots of whole groups)."""
  if spec.sampler == "positive_bias":
    return S.positive_bias_eligible(state.valid, _correct(state, spec), state.write_index,
                                    spec.num_fresh_any, spec.num_fresh_correct)
  g = spec.group_size
  if g > 1:
    whole = state.valid.reshape(-1, g).all(axis=1)
    return jnp.repeat(whole, g)
  return state.valid


def probabilities(state: BufferState, current_version: jax.Array, batch_size: int,
                  spec: SamplerConfig = DEFAULT_CONFIG) -> jax.Array:
  """[C] float32: the probability that one position of a batch holds each slot.

  These are the probabilities ``sample`` draws with (after age eviction): per-draw P(i) for
  samplers with replacement, inclusion probability / B for those without. They sum to 1 over
  valid slots (within float32 rounding) and are 0 on empty or evicted slots (CASES.md
  case 8). O(C); ``sample`` itself does not compute this vector on its fast uniform path.

  Args:
    state: buffer state. current_version: int32 scalar. batch_size: B (static).
    spec: static sampler config.
  """
  if spec.max_staleness is not None:
    state = evict(state, current_version, SamplerConfig(max_staleness=spec.max_staleness))
  if spec.sampler in ("recency", "priority"):
    return _weights(state, current_version, batch_size, spec)
  if spec.sampler == "fresh_first":
    fresh = state.valid & (state.times_sampled == 0)
    used = state.valid & ~fresh
    n_f = fresh.sum(dtype=jnp.int32).astype(jnp.float32)
    n_u = used.sum(dtype=jnp.int32).astype(jnp.float32)
    b = jnp.float32(batch_size)
    p_f = jnp.minimum(b, n_f) / jnp.maximum(n_f, 1.0) / b
    p_u = jnp.maximum(b - n_f, 0.0) / jnp.maximum(n_u, 1.0) / b
    return jnp.where(fresh, p_f, jnp.where(used, p_u, 0.0))
  eligible = _eligible(state, spec)
  n = eligible.sum(dtype=jnp.int32)
  return eligible.astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)


def _draw_uniform_family(state: BufferState, key: jax.Array, batch_size: int,
                         spec: SamplerConfig) -> tuple[jax.Array, jax.Array]:
  """([B] int32 slots, [B] float32 probs) for uniform, positive_bias, fresh_first, groups."""
  c = state.capacity
  if spec.sampler == "fresh_first":
    fresh = state.valid & (state.times_sampled == 0)
    used = state.valid & ~fresh
    n_f = fresh.sum(dtype=jnp.int32)
    n_u = used.sum(dtype=jnp.int32)
    k_f, k_u = jax.random.split(key)
    slot_f = S.select_ranked(fresh, S.distinct_ranks(k_f, n_f, batch_size))
    slot_u = S.select_ranked(used, S.distinct_ranks(k_u, n_u, batch_size))
    b = jnp.arange(batch_size, dtype=jnp.int32)
    idx = jnp.where(b < n_f, slot_f, slot_u[jnp.clip(b - n_f, 0, batch_size - 1)])
    bf = jnp.float32(batch_size)
    nf, nu = n_f.astype(jnp.float32), n_u.astype(jnp.float32)
    p_f = jnp.minimum(bf, nf) / jnp.maximum(nf, 1.0) / bf
    p_u = jnp.maximum(bf - nf, 0.0) / jnp.maximum(nu, 1.0) / bf
    return idx, jnp.where(b < n_f, p_f, p_u)  # positions b < n_f hold the fresh slots

  g = spec.group_size
  k = batch_size // g
  draw = ((lambda key, n: S.uniform_ints(key, (k,), n))
          if spec.replace else (lambda key, n: S.distinct_ranks(key, n, k)))

  if spec.sampler == "uniform" and g == 1:
    n = state.size
    rank = draw(key, n)

    def contiguous(rank):  # O(B): the valid slots are the last `size` written, no holes
      # write_index - n >= -C, so adding C makes lax.rem a modulo (no sign fix-ups).
      return lax.rem(state.write_index - n + rank + c, jnp.int32(c))

    if state.may_have_holes:  # static: an eviction happened (or may have)
      idx = lax.cond(_is_contiguous(state), contiguous,
                     lambda rank: S.select_ranked(state.valid, rank), rank)
    else:
      idx = contiguous(rank)
  else:
    eligible = _eligible(state, spec)
    if g > 1:
      eligible_blocks = eligible.reshape(-1, g)[:, 0]
      n_blocks = eligible_blocks.sum(dtype=jnp.int32)
      blocks = S.select_ranked(eligible_blocks, draw(key, n_blocks))
      idx = (blocks[:, None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(-1)
      n = n_blocks * g
    else:
      n = eligible.sum(dtype=jnp.int32)
      idx = S.select_ranked(eligible, draw(key, n))
  probs = jnp.full((batch_size,), 1.0, jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)
  return idx, probs


def sample(state: BufferState, key: jax.Array, batch_size: int, current_version: jax.Array,
           step: jax.Array, spec: SamplerConfig = DEFAULT_CONFIG
           ) -> tuple[BufferState, SampleResult]:
  """Draws a batch of B items with the configured sampler; items stay in the buffer.

  Order of operations: evict by age (``spec.max_staleness``), draw, update use counters
  (``times_sampled`` += 1 per batch position, so a slot in k positions counts k uses;
  ``last_sampled_step`` = ``step``), evict by use count (``spec.max_times_sampled``).

  Contract: when ``can_sample`` is True (the trainer generates until it is, like Reverb's
  minimum size), a sampler without replacement returns B distinct slots and every sampler
  draws by the ``probs`` it returns. When it is False, ``sample`` still returns B positions:
  a sampler without replacement repeats items, with no eligible item at all the positions
  hold slots outside the eligible set (e.g. empty ones), and ``probs`` no longer describe
  the draw. The use counters stay exact either way (one use per position), so a call
  without the check never corrupts the bookkeeping.

  Cost: uniform on a state without ``may_have_holes`` is O(B²) fused comparisons (B <= 512;
  O(B log B) above) and O(B log B) pointer jumping, independent of C (``distinct_ranks``);
  the other samplers, group mode, holes and any eviction rule add O(C) elementwise work.

  Args:
    state: buffer state.
    key: PRNG key.
    batch_size: B (static).
    current_version: int32 scalar, the learner's policy version (staleness = this − item's).
    step: int32 scalar learner step (recorded as the items' last use).
    spec: static ``SamplerConfig`` (default: the paper's uniform sampler, no duplicates).

  Returns:
    (new state, ``SampleResult``).
  """
  current_version = jnp.asarray(current_version, jnp.int32)
  step = jnp.asarray(step, jnp.int32)
  if spec.max_staleness is not None:
    state = evict(state, current_version, SamplerConfig(max_staleness=spec.max_staleness))
  if spec.sampler in ("recency", "priority"):
    p_c = _weights(state, current_version, batch_size, spec)
    cums = jnp.cumsum(p_c)
    u = jax.random.uniform(key, (batch_size,), jnp.float32) * cums[-1]
    idx = S.prefix_search(cums, u)
    probs = p_c[idx]
    beta = spec.priority_beta if spec.sampler == "priority" else spec.recency_beta
    min_p = jnp.min(jnp.where(p_c > 0, p_c, jnp.inf))  # least likely drawable (0 if invalid)
    weights = S.importance_weights(probs, beta, min_p)
  else:
    idx, probs = _draw_uniform_family(state, key, batch_size, spec)
    weights = jnp.ones((batch_size,), jnp.float32)
  get = lambda x: x.at[idx].get(mode="promise_in_bounds")  # idx in [0, C) by construction
  rows = get(state.meta)  # [B, 5]: one gather for all the bookkeeping the batch reports
  before, last = rows[:, TIMES_SAMPLED], rows[:, LAST_SAMPLED_STEP]
  result = SampleResult(
      items=jax.tree.map(get, state.items),
      per_item=jnp.stack([  # column order INDEX, STALENESS, TIMES_SAMPLED_BEFORE, STEPS_...
          idx, (current_version - rows[:, POLICY_VERSION]).astype(jnp.int32), before,
          jnp.where(last < 0, -1, step - last).astype(jnp.int32)], axis=1),
      sampling=jnp.stack([probs, weights.astype(jnp.float32)], axis=1),  # PROB, WEIGHT
  )
  # One write-back for every sampler: a scatter-add of one use per position, exact when a
  # slot repeats (a draw with replacement, or without ``can_sample``); a row write declared
  # ``unique_indices`` is undefined on repeated slots, and costs the same on XLA:CPU
  # (bench/buffer.py). The increment is computed from `rows` (min(before, 0) is 0: counts
  # are >= 0), which makes XLA read them before it writes `meta` in place (no copy).
  meta = state.meta.at[idx, TIMES_SAMPLED].add(jnp.minimum(before, 0) + 1,
                                               mode="promise_in_bounds")
  meta = meta.at[idx, LAST_SAMPLED_STEP].set(jnp.full((batch_size,), step),
                                             mode="promise_in_bounds")
  state = _set(state, meta=meta)
  if spec.max_times_sampled is not None:
    state = evict(state, current_version, SamplerConfig(max_times_sampled=spec.max_times_sampled))
  return state, result


def can_sample(state: BufferState, batch_size: int, spec: SamplerConfig = DEFAULT_CONFIG,
               current_version: jax.Array | None = None) -> jax.Array:
  """bool scalar: ``sample`` can draw B items by its stated law (the contract of ``sample``).

  Exactly the condition for a draw without duplicates: with N the number of items the
  sampler may draw after age eviction at ``current_version`` (``spec.max_staleness``; items
  over ``spec.max_times_sampled`` uses are already invalid, ``sample`` evicts them after each
  draw), it is N >= B for

    uniform without replacement and fresh_first: N = ``size`` (fresh_first tops up the
      never-used items with used ones, so every valid item counts);
    group mode: N = G × the number of aligned groups whose G slots are all valid;
    positive_bias: N = the size of its eligible set, at most ``positive_bias_size``;

  and N >= 1 (any valid item) for i.i.d. draws: uniform with replacement, recency, priority.
  O(1) for uniform and fresh_first on top of the age eviction (O(C)); O(C) for group mode
  and positive_bias.

  Args:
    state: buffer state. batch_size: B (static). spec: static config.
    current_version: int32 scalar, required when ``spec.max_staleness`` is set.

  Raises:
    ValueError: ``spec.max_staleness`` set and ``current_version`` is None.
  """
  if spec.max_staleness is not None:
    if current_version is None:
      raise ValueError("can_sample needs current_version when buffer.max_staleness is set")
    state = evict(state, current_version, SamplerConfig(max_staleness=spec.max_staleness))
  if spec.with_replacement:  # i.i.d. draws
    return state.size >= 1
  if spec.sampler == "positive_bias" or spec.group_size > 1:
    n = _eligible(state, spec).sum(dtype=jnp.int32)
  else:
    n = state.size
  return n >= batch_size


def size(state: BufferState) -> jax.Array:
  """int32 scalar: number of valid items."""
  return state.size


def state_sharding(state: BufferState, mesh: jax.sharding.Mesh, axis: str = "data") -> Any:
  """A pytree of ``NamedSharding`` for ``state``: [C, ...] leaves split on C, counters replicated.

  Use for ``jax.device_put``, ``jit(out_shardings=...)`` or an Orbax restore target.

  Raises:
    ValueError: C not divisible by the size of mesh axis ``axis``.
  """
  c, n_shards = state.capacity, mesh.shape[axis]
  if c % n_shards:
    raise ValueError(f"buffer.capacity={c} is invalid: must be divisible by mesh axis "
                     f"{axis!r} of size {n_shards}")
  P = jax.sharding.PartitionSpec
  split = jax.sharding.NamedSharding(mesh, P(axis))
  rep = jax.sharding.NamedSharding(mesh, P())
  return dataclasses.replace(state, items=jax.tree.map(lambda _: split, state.items),
                             meta=split, scores=split, counters=rep)


def shard(state: BufferState, mesh: jax.sharding.Mesh, axis: str = "data") -> BufferState:
  """``state`` placed with ``state_sharding`` (capacity axis split over ``axis``)."""
  return jax.device_put(state, state_sharding(state, mesh, axis))


class ReplayBuffer(NamedTuple):
  """Jitted, state-donating buffer functions for one capacity, batch size and config.

  Attributes:
    init: ``(example_items) -> BufferState`` (``evicts`` set from the config).
    add: ``(state, items, policy_version, step, rewards=None, advantages=None) -> state``,
      jitted, state donated.
    sample: ``(state, key, current_version, step) -> (state, SampleResult)``: a jitted core
      (``sample.jitted``) that takes and returns only what sampling changes (``meta``,
      donated, and ``counters``); the other leaves of the returned state are the input's.
    can_sample: ``(state, current_version=None) -> bool scalar``.
    probabilities: ``(state, current_version) -> [C] float32``, jitted.
    spec: the ``SamplerConfig``. capacity: C. batch_size: B.

  The trainer adds, samples and checks readiness through these (``train.learner``), inside
  its own jitted steps (a jitted function called under ``jit`` is inlined there): one way to
  add and sample, whoever calls it.
  """

  init: Callable[..., BufferState]
  add: Callable[..., BufferState]
  sample: Callable[..., tuple[BufferState, SampleResult]]
  can_sample: Callable[..., jax.Array]
  probabilities: Callable[..., jax.Array]
  spec: SamplerConfig
  capacity: int
  batch_size: int


def make_replay_buffer(capacity: int, batch_size: int,
                       spec: SamplerConfig = DEFAULT_CONFIG) -> ReplayBuffer:
  """Validates the sizes against ``spec`` and returns the jitted bundle (flashbax style).

  Args:
    capacity: C >= 1. batch_size: B >= 1. spec: ``SamplerConfig``.

  Raises:
    ValueError: a size or config field out of range (message names field and value).
  """
  if not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"buffer.capacity={capacity!r} is invalid: must be an int >= 1")
  spec.validate_for(capacity, batch_size)

  # `sample` changes only `meta` (use counters, eviction) and `counters` (size, on
  # eviction): the jitted core takes those two apart from the read-only leaves and returns
  # only them with the batch. Only `meta` is donated, and the unchanged leaves are not
  # outputs at all: every output of a jitted call costs time on the host (a new buffer or
  # an alias to hand back), which on XLA:CPU rivals the draw itself (see bench/buffer.py,
  # whose whole-state column times the other convention).
  def sample_core(meta, counters, items, scores, key, current_version, step, may_have_holes):
    state = BufferState(items=items, meta=meta, scores=scores, counters=counters,
                        may_have_holes=may_have_holes)
    state, result = sample(state, key, batch_size, current_version, step, spec)
    return state.meta, state.counters, result

  core = jax.jit(sample_core, donate_argnums=0, static_argnames="may_have_holes")

  def sample_fn(state, key, current_version, step):
    meta, counters, result = core(state.meta, state.counters, state.items, state.scores, key,
                                  current_version, step, may_have_holes=state.may_have_holes)
    # `sample` evicts (and so marks the state) exactly when the config has a rule.
    return dataclasses.replace(state, meta=meta, counters=counters,
                               may_have_holes=state.may_have_holes or spec.evicts), result

  sample_fn.jitted = core  # the compiled function (e.g. for ``_cache_size()``)
  return ReplayBuffer(
      init=functools.partial(init, capacity=capacity, evicts=spec.evicts),
      add=jax.jit(add, donate_argnums=0),
      sample=sample_fn,
      can_sample=functools.partial(can_sample, batch_size=batch_size, spec=spec),
      probabilities=jax.jit(functools.partial(probabilities, batch_size=batch_size, spec=spec)),
      spec=spec, capacity=capacity, batch_size=batch_size,
  )
