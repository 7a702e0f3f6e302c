"""Replay statistics the paper plots (Arnal et al. 2026 §3.1), computed on device.

All functions are pure and jittable; they return dicts of scalars / small fixed-size arrays
that a metrics writer can log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxreplay.replay.buffer import BufferState, SampleResult


def histogram(values_k: jax.Array, num_bins: int) -> jax.Array:
  """[num_bins] int32 counts of integers 0..num_bins−2; the last bin counts >= num_bins−1.

  Negative values are counted in bin 0.

  Args:
    values_k: [k] int32. num_bins: static, >= 1.
  """
  b = jnp.clip(values_k, 0, num_bins - 1)
  return jnp.zeros((num_bins,), jnp.int32).at[b].add(1)


def batch_stats(result: SampleResult, num_bins: int = 16) -> dict[str, jax.Array]:
  """Statistics of one sampled batch of B items.

  Returns:
    staleness_hist: [num_bins] int32 histogram of staleness (policy versions; last bin = tail).
    staleness_mean, staleness_max: float32 / int32 scalars.
    replay_count_mean: float32, mean uses of the batch's items including this one.
    frac_never_used: float32, fraction drawn for the first time ("new", paper Fig. 5).
    steps_since_last_use_mean: float32, over items used before (0 when none was).
    steps_since_last_use_hist: [num_bins] int32 over items used before.
    weight_mean: float32 mean importance weight.
  """
  st = result.staleness
  used = result.times_sampled_before > 0
  ssl = result.steps_since_last_use
  n_used = used.sum()
  return {
      "staleness_hist": histogram(st, num_bins),
      "staleness_mean": st.astype(jnp.float32).mean(),
      "staleness_max": st.max(),
      "replay_count_mean": (result.times_sampled_before + 1).astype(jnp.float32).mean(),
      "frac_never_used": (~used).astype(jnp.float32).mean(),
      "steps_since_last_use_mean": jnp.where(used, ssl, 0).sum() / jnp.maximum(n_used, 1),
      "steps_since_last_use_hist": histogram(jnp.where(used, ssl, -1), num_bins)
                                   - jnp.zeros((num_bins,), jnp.int32).at[0].set(
                                       (~used).sum(dtype=jnp.int32)),
      "weight_mean": result.weights.mean(),
  }


def buffer_stats(state: BufferState, num_bins: int = 16) -> dict[str, jax.Array]:
  """Per-rollout replay counts over the items now in the buffer (O(C)).

  Returns:
    times_sampled_hist: [num_bins] int32 histogram of uses over valid items (last bin = tail).
    times_sampled_mean: float32 mean uses per valid item.
    frac_valid_never_used: float32.
    size: int32.
  """
  v = state.valid
  n = jnp.maximum(state.size, 1).astype(jnp.float32)
  ts = jnp.where(v, state.times_sampled, 0)
  hist = jnp.zeros((num_bins,), jnp.int32).at[jnp.clip(ts, 0, num_bins - 1)].add(
      v.astype(jnp.int32))
  return {"times_sampled_hist": hist,
          "times_sampled_mean": ts.sum() / n,
          "frac_valid_never_used": (v & (state.times_sampled == 0)).sum() / n,
          "size": state.size}
