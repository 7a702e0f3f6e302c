"""A FIFO ring buffer over any pytree of arrays with a leading item axis.

State is a ``flax.struct.dataclass``; ``init``/``add``/``sample`` are pure and
jit with the state donated (``add`` writes with ``.at[].set``, which XLA performs in
place on a donated buffer). The buffer knows nothing of models or losses: items are
pytrees, and the only fields it reads are the ``policy_version`` it is given.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

SAMPLERS = ("uniform",)


@flax.struct.dataclass
class BufferState:
  """Ring-buffer state for capacity C.

  Attributes:
    items: pytree, every leaf [C, ...].
    policy_version: [C] int32, version that generated each item.
    insert_step: [C] int32, learner step at insertion.
    times_sampled: [C] int32, number of batches the item appeared in.
    last_sampled_step: [C] int32, step of last use (−1 never).
    valid: [C] bool, slot holds an item.
    write_index: int32 scalar, next slot to write.
    size: int32 scalar, number of valid slots.
    total_inserted: int32 scalar, items ever added.
  """

  items: Any
  policy_version: jax.Array
  insert_step: jax.Array
  times_sampled: jax.Array
  last_sampled_step: jax.Array
  valid: jax.Array
  write_index: jax.Array
  size: jax.Array
  total_inserted: jax.Array

  @property
  def capacity(self) -> int:
    """C (static)."""
    return self.valid.shape[0]


@flax.struct.dataclass
class SampleResult:
  """A sampled batch of B items.

  Attributes:
    items: pytree with leaves [B, ...]. indices: [B] int32 slots.
    probs: [B] float32, probability of drawing each slot under the sampler (uniform: 1/size).
    staleness: [B] int32, current version − generation version (policy versions).
    times_sampled_before: [B] int32, uses before this batch (0 = never used).
    steps_since_last_use: [B] int32, −1 for never-used items.
  """

  items: Any
  indices: jax.Array
  probs: jax.Array
  staleness: jax.Array
  times_sampled_before: jax.Array
  steps_since_last_use: jax.Array


def init(example_items: Any, capacity: int) -> BufferState:
  """An empty buffer shaped like ``example_items`` (leaves [N, ...]; N is ignored).

  Raises:
    ValueError: ``capacity`` < 1.
  """
  if capacity < 1:
    raise ValueError(f"buffer.capacity={capacity} must be >= 1")
  items = jax.tree.map(lambda x: jnp.zeros((capacity,) + x.shape[1:], x.dtype), example_items)
  zeros = jnp.zeros((capacity,), jnp.int32)
  return BufferState(items=items, policy_version=zeros, insert_step=zeros, times_sampled=zeros,
                     last_sampled_step=zeros - 1, valid=jnp.zeros((capacity,), bool),
                     write_index=jnp.int32(0), size=jnp.int32(0), total_inserted=jnp.int32(0))


def add(state: BufferState, items: Any, policy_version: jax.Array, step: jax.Array) -> BufferState:
  """Writes N items at ``write_index`` modulo C, overwriting the oldest (FIFO).

  If N > C only the newest C items are kept (in insertion order).

  Args:
    state: buffer state. items: pytree, leaves [N, ...] (same structure as the buffer's).
    policy_version: [N] int32 generating versions. step: int32 scalar learner step.

  Returns:
    The new state.
  """
  c = state.capacity
  n = policy_version.shape[0]
  if n > c:  # static shapes: keep the newest C
    items = jax.tree.map(lambda x: x[n - c:], items)
    policy_version = policy_version[n - c:]
    start = state.write_index + (n - c)
    n = c
  else:
    start = state.write_index
  idx = (start + jnp.arange(n)) % c
  put = lambda buf, new: buf.at[idx].set(new.astype(buf.dtype))
  return state.replace(
      items=jax.tree.map(put, state.items, items),
      policy_version=state.policy_version.at[idx].set(policy_version.astype(jnp.int32)),
      insert_step=state.insert_step.at[idx].set(jnp.int32(step)),
      times_sampled=state.times_sampled.at[idx].set(0),
      last_sampled_step=state.last_sampled_step.at[idx].set(-1),
      valid=state.valid.at[idx].set(True),
      write_index=((start + n) % c).astype(jnp.int32),
      size=jnp.minimum(state.size + n, c).astype(jnp.int32),
      total_inserted=(state.total_inserted + policy_version.shape[0]).astype(jnp.int32),
  )


def sample(state: BufferState, key: jax.Array, batch_size: int, current_version: jax.Array,
           step: jax.Array) -> tuple[BufferState, SampleResult]:
  """Draws ``batch_size`` distinct valid items uniformly (the paper's sampler, §3.1).

  Without replacement inside one batch; items stay in the buffer. Requires
  ``state.size >= batch_size`` (check with ``can_sample``); otherwise some drawn
  slots may be invalid and carry probability 0.

  Args:
    state: buffer state. key: PRNG key. batch_size: B (static).
    current_version: int32 scalar, the learner's policy version.
    step: int32 scalar learner step (recorded as the items' last use).

  Returns:
    (state with use counts updated, SampleResult).
  """
  c = state.capacity
  p = state.valid.astype(jnp.float32) / jnp.maximum(state.size, 1).astype(jnp.float32)
  idx = jax.random.choice(key, c, (batch_size,), replace=False, p=p).astype(jnp.int32)
  before = state.times_sampled[idx]
  last = state.last_sampled_step[idx]
  result = SampleResult(
      items=jax.tree.map(lambda x: x[idx], state.items),
      indices=idx,
      probs=p[idx],
      staleness=(current_version - state.policy_version[idx]).astype(jnp.int32),
      times_sampled_before=before,
      steps_since_last_use=jnp.where(last < 0, -1, step - last).astype(jnp.int32),
  )
  state = state.replace(times_sampled=state.times_sampled.at[idx].add(1),
                        last_sampled_step=state.last_sampled_step.at[idx].set(jnp.int32(step)))
  return state, result


def can_sample(state: BufferState, batch_size: int) -> jax.Array:
  """bool scalar: at least ``batch_size`` valid items."""
  return state.size >= batch_size
