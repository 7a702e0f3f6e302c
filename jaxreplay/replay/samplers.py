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

  Up to k = 512 it compares all pairs (one fused elementwise pass); on CPU that is several
  times faster than the stable argsort used for larger k.

  Args:
    r_k: [k] int32.
  """
  k = r_k.shape[0]
  if k <= 512:
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # [j, i]: i < j
    return ((r_k[:, None] == r_k[None, :]) & earlier).any(axis=1)
  order = jnp.argsort(r_k, stable=True)
  s = r_k[order]
  dup_sorted = jnp.concatenate([jnp.zeros((1,), bool), s[1:] == s[:-1]])
  return jnp.zeros(r_k.shape, bool).at[order].set(dup_sorted)


def uniform_ints(key: jax.Array, shape: tuple[int, ...], n: jax.Array) -> jax.Array:
  """Integers uniform on [0, n), computed as ``jax.random.randint(key, shape, 0, n)`` does.

  randint combines two 32-bit words per value (``hi · 2^32 + lo`` reduced mod n with 32-bit
  arithmetic) and draws them with three PRNG calls (a key split, then one call per word);
  here one call draws both words. On CPU every PRNG call is a loop of its own, so this
  saves two of them per batch. Same arithmetic, so the same (tested) distribution.

  Args:
    key: PRNG key. shape: static output shape. n: int32 scalar >= 1.

  Returns:
    int32 array of ``shape``.
  """
  hi, lo = jax.random.bits(key, (2,) + tuple(shape), jnp.uint32)
  span = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.uint32)
  multiplier = lax.rem(jnp.uint32(2**16), span)
  multiplier = lax.rem(multiplier * multiplier, span)  # 2^32 mod n
  offset = lax.rem(lax.rem(hi, span) * multiplier + lax.rem(lo, span), span)
  return offset.astype(jnp.int32)


def distinct_ranks(key: jax.Array, n: jax.Array, k: int, n_max: int | None = None) -> jax.Array:
  """A uniformly random k-subset of {0, …, n−1}, in random order, in O(k log k) expected work.

  The subset is the first k distinct values of a stream of i.i.d. uniform draws on
  [0, n), read in blocks of 2k. Keeping the first k distinct values of an i.i.d. stream is
  sequential sampling without replacement, so the subset is uniform and its order random.
  When n > 4k the first block holds k distinct values with overwhelming probability (about
  1.57k are expected), so the loop that reads further blocks almost never runs; smaller n
  (a nearly empty buffer) takes a few blocks (coupon collecting, at most ~H_k / 2 expected).
  Nothing here is proportional to the buffer's capacity: this is what keeps uniform sampling
  flat in C (issue 2 performance target). No ``lax.cond`` either: on CPU a conditional runs
  its branch through a nested executor, which cost more than the draw itself.

  With a static bound ``n_max`` on n such that 4k · n_max <= 2^32, the first block is
  deduplicated with two single-key sorts of packed (value, position) words (cheapest on
  CPU); the result is the same.

  Args:
    key: PRNG key. n: int32 scalar, population size. k: static number of draws.
    n_max: optional static upper bound on n (e.g. the buffer's capacity).

  Returns:
    [k] int32 in [0, max(n, 1)). Distinct when n >= k; when n < k the first n entries are
    a permutation of {0, …, n−1} and the rest repeat values (callers check ``can_sample``).
  """
  n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
  wanted = jnp.minimum(n, k)
  m = 2 * k

  def read_block(block_key, r, count):  # append the 2k draws not seen before, in order
    block = uniform_ints(block_key, (2 * k,), n)
    if r is None:  # first block: nothing seen yet
      r, new = jnp.zeros((k,), jnp.int32), ~later_duplicates(block)
    else:  # unfilled picks hold distinct negative placeholders, which match no draw
      seen = jnp.where(jnp.arange(k) < count, r, -1 - jnp.arange(k, dtype=jnp.int32))
      new = ~later_duplicates(jnp.concatenate([seen, block]))[k:]
    pos = count + jnp.cumsum(new, dtype=jnp.int32) - 1
    r = r.at[jnp.where(new, pos, k)].set(block, mode="drop")  # slots >= k are dropped
    return r, jnp.minimum(count + new.sum(dtype=jnp.int32), k)

  def next_block(carry):
    i, r, count = carry
    return (i + 1, *read_block(jax.random.fold_in(key, i), r, count))

  if n_max is not None and 2 * m * max(n_max, 1) <= 2**32:
    r, count = _first_distinct_sorted(uniform_ints(key, (m,), n), k, max(n_max, 1))
  else:
    r, count = read_block(key, None, jnp.int32(0))
  return lax.while_loop(lambda c: c[2] < wanted, next_block, (jnp.int32(1), r, count))[1]


def _first_distinct_sorted(block_m: jax.Array, k: int, n_max: int) -> tuple[jax.Array, jax.Array]:
  """(first min(k, D) distinct values of ``block_m`` in stream order, padded; min(D, k)).

  Sort 1 orders (value, position) words, so each value's first occurrence leads its run;
  sort 2 orders (is-repeat, position, value) words, so first occurrences come first, by
  position. Needs 2m · n_max <= 2^32 (m = len(block_m), values < n_max).
  """
  m = block_m.shape[0]
  pos = jnp.arange(m, dtype=jnp.uint32)
  by_value = jnp.sort(block_m.astype(jnp.uint32) * jnp.uint32(m) + pos)
  value, position = by_value // jnp.uint32(m), by_value % jnp.uint32(m)
  repeat = jnp.concatenate([jnp.zeros((1,), bool), value[1:] == value[:-1]])
  by_position = jnp.sort((repeat.astype(jnp.uint32) * jnp.uint32(m) + position)
                         * jnp.uint32(n_max) + value)[:k]
  distinct = m - repeat.sum(dtype=jnp.int32)
  return (by_position % jnp.uint32(n_max)).astype(jnp.int32), jnp.minimum(distinct, k)


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
