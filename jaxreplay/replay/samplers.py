"""Pure sampling pieces shared by the buffer's samplers (no buffer state in here).

All functions are jittable with static ``k`` / sizes and take or return int32 / float32
arrays (``random_bits``: uint32). Slot masks are [C] bool, C the buffer capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 random bits of ``shape`` from XLA's native bit generator, seeded by ``key``.

  ``lax.rng_bit_generator`` (Threefry-2x32 algorithm) seeded with the key's data: a 2-word
  key is the Threefry key with a zero counter; a 4-word key (e.g. ``rbg``) is the whole
  generator state. On CPU, ``jax.random.bits`` runs Threefry as a rolled ``while`` loop, and
  control flow costs an XLA:CPU executable more than the draw itself; the native generator
  compiles to straight-line code, which keeps ``sample`` as fast as flashbax's (see
  bench/buffer.py). Deterministic: the same key gives the same bits on a given backend and
  XLA version, also under ``jax.vmap`` (batched keys are mapped one by one, because the
  primitive's own batching rule would seed every row from the first key); XLA does not
  promise the same stream across backends or versions, unlike ``jax.random``, so a run is
  reproducible with its environment.

  Args:
    key: one PRNG key (typed, shape ()) or raw key data of shape [2] or [4] uint32.
    shape: static output shape.

  Returns:
    uint32 array of ``shape``.

  Raises:
    ValueError: key data that is not one key of 2 or 4 words (e.g. a batch of keys).
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.shape not in ((2,), (4,)):
    raise ValueError(f"random_bits needs one key of 2 or 4 uint32 words; got key data of "
                     f"shape {key.shape} (vmap over a batch of keys instead)")
  words = key.astype(jnp.uint32)
  if words.shape[0] == 2:
    words = jnp.concatenate([words, jnp.zeros((2,), jnp.uint32)])
  return _native_bits(tuple(shape))(words)


@functools.lru_cache(maxsize=None)
def _native_bits(shape: tuple[int, ...]):
  """``words [4] uint32 -> bits`` with a vmap rule that maps over batched states."""

  @jax.custom_batching.custom_vmap
  def bits(words):
    return lax.rng_bit_generator(words, shape, jnp.uint32,
                                 algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)[1]

  @bits.def_vmap
  def _batched(axis_size, in_batched, words):
    del axis_size
    if not in_batched[0]:
      return bits(words), False
    return lax.map(bits, words), True

  return bits


def uniform_ints(key: jax.Array, shape: tuple[int, ...], n: jax.Array) -> jax.Array:
  """Integers uniform on [0, n), computed as ``jax.random.randint(key, shape, 0, n)`` does.

  randint combines two 32-bit words per value (``hi · 2^32 + lo`` reduced mod n with 32-bit
  arithmetic, a bias below n / 2^64); the same arithmetic here, on words from
  ``random_bits`` (one native generator call instead of randint's three Threefry loops).

  Args:
    key: PRNG key. shape: static output shape.
    n: int32 scalar or array broadcastable to ``shape``, each >= 1 (values < 1 act as 1).

  Returns:
    int32 array of ``shape``.
  """
  hi, lo = random_bits(key, (2,) + tuple(shape))
  return _reduce_mod(hi, lo, n)


def _reduce_mod(hi: jax.Array, lo: jax.Array, n: jax.Array) -> jax.Array:
  span = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.uint32)
  multiplier = lax.rem(jnp.uint32(2**16), span)
  multiplier = lax.rem(multiplier * multiplier, span)  # 2^32 mod n
  return lax.rem(lax.rem(hi, span) * multiplier + lax.rem(lo, span), span).astype(jnp.int32)


def distinct_ranks(key: jax.Array, n: jax.Array, k: int) -> jax.Array:
  """A uniformly random ordered k-subset of {0, …, n−1}: k steps of Fisher–Yates, in parallel.

  Partial Fisher–Yates shuffle of the virtual array a = [0, 1, …, n−1] (Knuth, TAOCP vol. 2,
  Algorithm 3.4.2 P): step i swaps a[i] with a[r_i], r_i uniform on [i, n), and outputs the
  new a[i]. Every ordered k-tuple of distinct values is equally likely. The k swaps are
  sequential, but their result has a closed form that needs no loop: position r_i holds,
  before step i, either r_i (never touched) or the value that step A_i = max{j < i: r_j = r_i}
  moved there, which is the value position A_i held before its own step; that in turn is
  A_i itself or, if an earlier step L = max{j' < A_i: r_j' = A_i} moved a value into A_i,
  the value position L held before step L, and so on. Those "held before step j" values
  follow pointers j → L_j < j, so ⌈log2 k⌉ rounds of pointer jumping resolve every chain.

  Work: O(k²) fused comparisons for k <= 512 (one elementwise pass; faster than sorting on
  CPU), else one O(k log k) sort; O(k log k) pointer jumping; nothing proportional to the
  buffer's capacity, no loop and no conditional (control flow costs an XLA:CPU executable
  more than the draw), so the uniform draw does no work that grows with C (bench/buffer.py
  times it at C = 1e3 and 1e5).

  Args:
    key: PRNG key. n: int32 scalar, population size. k: static number of draws.

  Returns:
    [k] int32 in [0, max(n, 1)). Distinct when n >= k; when n < k the first n entries are
    a permutation of {0, …, n−1} and entry i >= n is i mod n (callers check ``can_sample``).
  """
  if k == 0:
    return jnp.zeros((0,), jnp.int32)
  n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
  i = jnp.arange(k, dtype=jnp.int32)
  hi, lo = random_bits(key, (2, k))
  r = i + _reduce_mod(hi, lo, n - i)  # r_i uniform on [i, n) (r_i = i once i >= n)
  last_swap, last_fill = _previous_steps(r)
  ptr = jnp.where(last_fill >= 0, last_fill, i)  # value held before step j: that of L_j, or j
  for _ in range(max(1, (k - 1).bit_length())):
    ptr = ptr[ptr]
  out = jnp.where(last_swap >= 0, ptr[jnp.maximum(last_swap, 0)], r)
  return jnp.where(out < n, out, out % n)


def _previous_steps(r: jax.Array) -> tuple[jax.Array, jax.Array]:
  """([k] A, [k] L) int32: A_i = max{j < i: r_j = r_i}, L_i = max{j < i: r_j = i}; −1 if none."""
  k = r.shape[0]
  i = jnp.arange(k, dtype=jnp.int32)
  if k <= 512:
    # One [2, k, k] reduction for both searches (one pass instead of two on XLA:CPU).
    earlier = i[None, None, :] < i[None, :, None]  # [·, row, col]: col < row
    hit = r[None, None, :] == jnp.stack([r, i])[:, :, None]
    found = jnp.where(hit & earlier, i[None, None, :], -1).max(axis=2)
    return found[0], found[1]
  r_s, i_s = lax.sort((r, i), num_keys=2)  # by value, then step
  same = jnp.concatenate([jnp.zeros((1,), bool), r_s[1:] == r_s[:-1]])
  prev = jnp.where(same, jnp.roll(i_s, 1), -1)
  last_swap = jnp.zeros((k,), jnp.int32).at[i_s].set(prev, unique_indices=True)
  # L_i: the last entry of value i's run, or the one before it when that is step i itself
  # (r_j >= j, so an entry (i, j) has j <= i).
  q = jnp.searchsorted(r_s, i, side="right").astype(jnp.int32) - 1
  q = jnp.where((q >= 0) & (i_s[jnp.maximum(q, 0)] == i), q - 1, q)
  q_ok = (q >= 0) & (r_s[jnp.maximum(q, 0)] == i)
  return last_swap, jnp.where(q_ok, i_s[jnp.maximum(q, 0)], -1)


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
