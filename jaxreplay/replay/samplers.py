"""Pure sampling pieces shared by the buffer's samplers (no buffer state in here).

All functions are jittable with static ``k`` / sizes and take or return int32 / float32
arrays. Slot masks are [C] bool, C the buffer capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def later_duplicates(r_k: jax.Array) -> jax.Array:
  """[k] bool: True where ``r_k[j]`` equals some ``r_k[i]`` with i < j.

  Args:
    r_k: [k] int32.
  """
  order = jnp.argsort(r_k, stable=True)
  s = r_k[order]
  dup_sorted = jnp.concatenate([jnp.zeros((1,), bool), s[1:] == s[:-1]])
  return jnp.zeros(r_k.shape, bool).at[order].set(dup_sorted)


def distinct_ranks(key: jax.Array, n: jax.Array, k: int) -> jax.Array:
  """A uniformly random k-subset of {0, …, n−1}, in random order, in O(k) expected work.

  Two exact paths, chosen by the traced ``n``:
    * n <= 4k: Gumbel top-k over a static window of 4k keys masked to [0, n).
    * n > 4k: k i.i.d. uniform draws; later duplicates are redrawn until none is left
      (each redraw collides with probability < 1/4, so ~1–2 rounds). The procedure commutes
      with every relabelling of {0, …, n−1}, so the subset it returns is uniform.
  Neither path costs anything proportional to the buffer's capacity: this is what keeps
  uniform sampling flat in C (issue 2 performance target).

  Args:
    key: PRNG key. n: int32 scalar, population size. k: static number of draws.

  Returns:
    [k] int32 in [0, max(n, 1)). Distinct when n >= k; when n < k the first n entries are
    a permutation of {0, …, n−1} and the rest repeat values (callers check ``can_sample``).
  """
  n = jnp.asarray(n, jnp.int32)
  window = 4 * k

  def small(key):
    g = jax.random.gumbel(key, (window,), jnp.float32)
    g = jnp.where(jnp.arange(window) < n, g, -jnp.inf)
    return lax.top_k(g, k)[1].astype(jnp.int32)

  def large(key):
    def body(carry):  # (re)draw the positions still marked; one RNG call site (fast compile)
      i, r, redo = carry
      new = jax.random.randint(jax.random.fold_in(key, i), (k,), 0, n, jnp.int32)
      r = jnp.where(redo, new, r)
      return i + 1, r, later_duplicates(r)

    init = (jnp.int32(0), jnp.zeros((k,), jnp.int32), jnp.ones((k,), bool))
    return lax.while_loop(lambda c: c[2].any(), body, init)[1]

  r = lax.cond(n <= window, small, large, key)
  return jnp.clip(r, 0, jnp.maximum(n, 1) - 1)


def prefix_search(cumsum_c: jax.Array, u_k: jax.Array) -> jax.Array:
  """Index i with cumsum[i−1] <= u < cumsum[i] (cumsum[−1] = 0): inverse-CDF lookup.

  A boundary value u == cumsum[i] goes to the right-hand item i+1 (CASES.md case 8), and
  the lookup covers every index 0..C−1 for any C (no power-of-two layout, so the newest
  item is never cut off). Items of zero mass are never returned for u in [0, total).

  Args:
    cumsum_c: [C] non-decreasing float32 or int32 inclusive prefix sums of the masses.
    u_k: [k] query values, same dtype, in [0, cumsum[-1]).

  Returns:
    [k] int32 indices, clipped to [0, C−1].
  """
  i = jnp.searchsorted(cumsum_c, u_k, side="right")
  return jnp.clip(i, 0, cumsum_c.shape[0] - 1).astype(jnp.int32)


def select_ranked(mask_c: jax.Array, ranks_k: jax.Array) -> jax.Array:
  """Slot of the r-th True entry of ``mask_c`` (slot order), for every r in ``ranks_k``.

  Args:
    mask_c: [C] bool. ranks_k: [k] int32 in [0, mask.sum()).

  Returns:
    [k] int32 slots. O(C) for the prefix sum, O(k log C) for the lookups.
  """
  return prefix_search(jnp.cumsum(mask_c.astype(jnp.int32)), ranks_k.astype(jnp.int32))


def age_order(write_index: jax.Array, capacity: int) -> jax.Array:
  """[C] int32 slots from newest to oldest: slot (write_index − 1 − a) mod C at age a."""
  return ((write_index - 1 - jnp.arange(capacity, dtype=jnp.int32)) % capacity).astype(jnp.int32)


def rank_by_freshness(mask_c: jax.Array, write_index: jax.Array) -> jax.Array:
  """[C] int32: among the True slots, 0 for the most recently written, 1 the next, …

  Slots where ``mask_c`` is False get C (larger than any rank). FIFO writes are
  consecutive modulo C, so age order is the ring order backwards from ``write_index``.

  Args:
    mask_c: [C] bool. write_index: int32 scalar, next slot to be written.
  """
  c = mask_c.shape[0]
  order = age_order(write_index, c)
  m_age = mask_c[order]
  rank_age = jnp.cumsum(m_age.astype(jnp.int32)) - 1
  rank = jnp.zeros((c,), jnp.int32).at[order].set(rank_age)
  return jnp.where(mask_c, rank, c)


def positive_bias_eligible(valid_c: jax.Array, correct_c: jax.Array, write_index: jax.Array,
                           num_any: int, num_correct: int) -> jax.Array:
  """[C] bool eligible set of positive-bias sampling (Arnal et al. 2026, App. 10.4).

  The freshest ``num_any`` = (1−δ)N valid items of any kind, plus the freshest
  ``num_correct`` = δN correct valid items not already among them.

  Args:
    valid_c, correct_c: [C] bool. write_index: int32 scalar. num_any, num_correct: static ints.
  """
  fresh_any = rank_by_freshness(valid_c, write_index) < num_any
  rest = valid_c & correct_c & ~fresh_any
  return fresh_any | (rank_by_freshness(rest, write_index) < num_correct)


def raw_importance_weights(probs_k: jax.Array, n: jax.Array, beta: float) -> jax.Array:
  """Unnormalised prioritised-replay weights (N·P(i))^−β (Schaul et al. 2016, §3.4).

  Args:
    probs_k: [k] float32 sampling probabilities. n: number of items that can be drawn.
    beta: exponent in [0, 1].

  Returns:
    [k] float32 (CASES.md case 13: P = [.1, .2, .3, .4], N = 4, β = 1 → [2.5, 1.25, .833, .625]).
  """
  return (jnp.asarray(n, jnp.float32) * probs_k.astype(jnp.float32)) ** (-beta)


def importance_weights(probs_k: jax.Array, beta: float,
                       min_prob: jax.Array | None = None) -> jax.Array:
  """Normalised correction w_i = (N·P(i))^−β / max_j (N·P(j))^−β (Schaul et al. 2016, §3.4).

  The max runs over every item that can be drawn, i.e. it is attained by the least likely
  item ``min_prob`` (CASES.md case 13); when ``min_prob`` is None the batch's own minimum is
  used. Computed as (P(i)/P_min)^−β, which is the same quantity with N cancelled: it cannot
  overflow and gives exactly 1.0 when every probability is equal (uniform sampling), where
  the unnormalised form would give N^β·P^β ≠ 1 in float32 rounding.

  Args:
    probs_k: [k] float32 sampling probabilities of the drawn items (> 0).
    beta: exponent in [0, 1] (static).
    min_prob: float32 scalar (> 0) or None.

  Returns:
    [k] float32 weights in (0, 1].
  """
  probs_k = probs_k.astype(jnp.float32)
  if min_prob is None:
    min_prob = probs_k.min()
  return (probs_k / jnp.asarray(min_prob, jnp.float32)) ** (-beta)
