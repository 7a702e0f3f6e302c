"""The sampling distribution: temperature, top-k and top-p (nucleus) applied to logits.

It lives in ``models`` so that both the sampler and the trainer (``rl``) can use the
same function (imports point ``sampling -> models`` and ``rl -> models``).

Order (as Hugging Face ``generate``): divide by the temperature, keep the ``top_k``
largest, then keep the nucleus of the renormalised top-k distribution.

Nucleus rule (Holtzman et al. 2020; CASES.md case 7): sort the probabilities in
descending order; token i is kept iff the mass strictly before it is below ``top_p``
(``exclusive_cumsum_i < top_p``), so the token that crosses the threshold is kept and a
token reached at exactly ``top_p`` is not; the most likely token is always kept (so
``top_p = 0`` is greedy). Tokens whose logit equals the smallest kept logit are kept
too (ties at the boundary are kept together rather than split by sort order).

Behaviour log-probs: ``masked_log_softmax`` gives log(p_t / S) for a kept token, S the
surviving mass — the distribution the sampler actually draws from. A trainer that
recomputes log-probs from the full softmax gets log p_t, so its importance ratio at
identical parameters is S, not 1; recomputing through ``process_logits`` with the
sampler's settings makes it exactly 1.

Cost (no full-vocabulary sort). With top-k the k largest are found from the blocks of
the row with the largest maxima (``_top_values``). For a nucleus without top-k the
threshold is found on candidates: the 64 largest logits, then the 1024 largest, read
through their blocks' maxima, with the softmax normaliser taken over the whole row; a
row whose nucleus reaches past its candidates (a flat distribution) gets its threshold
by bisection on the logit's bit pattern (32 masked sums over V). Each stage runs under
``lax.cond`` only when some row of the batch needs it, and a row keeps the first
stage's answer that is decisive for it, so a row's kept set does not depend on the
other rows. Exactness holds up to float32 summation order: the nucleus masses are the
sort-based rule's, summed in another order, so a row whose cumulative mass lies within
rounding (about 1e-7) of ``top_p`` may keep or drop its boundary token differently from
a sort-based implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def nucleus_keep(sorted_probs: jax.Array, top_p: float) -> jax.Array:
  """Which tokens of a descending-sorted distribution the nucleus keeps.

  Args:
    sorted_probs: [..., N] float probabilities sorted in descending order.
    top_p: nucleus mass in [0, 1].

  Returns:
    [..., N] bool: ``exclusive_cumsum < top_p``, with index 0 always True.
  """
  csum = jnp.cumsum(sorted_probs, axis=-1)
  before = jnp.concatenate([jnp.zeros_like(csum[..., :1]), csum[..., :-1]], axis=-1)
  keep = before < top_p
  return keep.at[..., 0].set(True)


# Candidate counts of the nucleus stages and the block widths they read maxima over: a
# block width w needs V / w well above the count so that the gathered blocks stay small.
_STAGES = ((64, 128), (1024, 16))
# Below this vocabulary size a full top_k is as cheap as the candidate stages.
_SMALL_VOCAB = 4096


def _top_values(x_nv: jax.Array, k: int, width: int) -> jax.Array:
  """The k largest entries of each row, descending, without sorting the row.

  The k largest lie in the k blocks (of ``width`` entries) with the largest maxima: a
  block holding an entry above the k-th largest value t has a maximum above t, and each
  chosen block with maximum t holds a copy of t, so the multiset is exact under ties.

  Args:
    x_nv: [N, V] float32. k: 1 <= k <= V (static). width: block width (static).

  Returns:
    [N, k] float32, each row descending (as ``lax.top_k``).
  """
  n, v = x_nv.shape
  nb = v // width
  if nb < 4 * k:  # the gathered blocks would be most of the row
    return jax.lax.top_k(x_nv, k)[0]
  blocks = x_nv[:, :nb * width].reshape(n, nb, width)
  chosen = jax.lax.top_k(blocks.max(-1), k)[1]  # [N, k] block ids
  cand = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(n, k * width)
  if nb * width < v:  # the last partial block joins the candidates whole
    cand = jnp.concatenate([cand, x_nv[:, nb * width:]], axis=-1)
  return jax.lax.top_k(cand, k)[0]


def _candidate_threshold(vals_nk, m_n, z_n, top_p):
  """Nucleus threshold from the K largest logits of each row, and whether it is decided.

  Args:
    vals_nk: [N, K] the K largest logits, descending. m_n: [N] row max. z_n: [N]
      ``sum(exp(x - m))`` over the row (the normaliser). top_p: nucleus mass.

  Returns:
    (threshold [N] float32, decided [N] bool): decided where the first dropped position
    is among the candidates, or the candidates run into -inf (every finite entry seen).
  """
  k = vals_nk.shape[-1]
  probs = jnp.exp(vals_nk - m_n[:, None]) / z_n[:, None]
  n_keep = nucleus_keep(probs, top_p).sum(-1)
  threshold = jnp.take_along_axis(vals_nk, n_keep[:, None] - 1, axis=-1)[:, 0]
  return threshold, (n_keep < k) | (vals_nk[:, -1] == -jnp.inf)


def _flip(i):
  # Negative floats order by descending magnitude bits: flipping those bits makes the
  # int32 order the float order (-inf lowest); the map is its own inverse.
  return jnp.where(i >= 0, i, i ^ jnp.int32(0x7FFFFFFF))


def _order_key(x):
  """float32 -> int32 key with the same order (NaN excluded)."""
  return _flip(jax.lax.bitcast_convert_type(x, jnp.int32))


def _from_key(key):
  """Inverse of ``_order_key``."""
  return jax.lax.bitcast_convert_type(_flip(key), jnp.float32)


def _bisect_threshold(x_nv, m_n, z_n, top_p):
  """Smallest logit u with mass(x > u) < top_p, by bisection on ``_order_key``.

  The mass above t only changes at present values, so the smallest key where it falls
  below ``top_p`` is a present logit: the nucleus threshold. 32 halvings cover int32.

  Args:
    x_nv: [N, V] float32. m_n, z_n: [N] row max and normaliser. top_p: in (0, 1).

  Returns:
    [N] float32 threshold.
  """
  e_nv = jnp.exp(x_nv - m_n[:, None])
  below = lambda key_n: jnp.where(x_nv > _from_key(key_n)[:, None], e_nv, 0.0).sum(-1) \
      / z_n < top_p

  def halve(_, bounds):
    lo, hi = bounds  # below(lo) False (or lo under every value), below(hi) True
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor midpoint without overflow
    ok = below(mid)
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  lo = jnp.full_like(m_n, _order_key(jnp.float32(-jnp.inf)) - 1, dtype=jnp.int32)
  _, hi = jax.lax.fori_loop(0, 32, halve, (lo, _order_key(m_n)))
  return _from_key(hi)


def _nucleus_threshold(x_nv: jax.Array, top_p: float, stages=_STAGES) -> jax.Array:
  """The smallest kept logit of each row under the nucleus rule (no top-k).

  Args:
    x_nv: [N, V] float32 scaled logits. top_p: in [0, 1). stages: ((K, block width),
      ...) candidate stages tried in order before the bisection (static).

  Returns:
    [N] float32 threshold; ``x >= threshold`` is the kept set.
  """
  m_n = x_nv.max(-1)
  z_n = jnp.exp(x_nv - m_n[:, None]).sum(-1)
  def on_candidates(k, w):
    # The barrier keeps XLA (CPU) from fusing the small candidate arithmetic back into
    # the selection over V, which made the first stage ~7x slower.
    vals_nk = jax.lax.optimization_barrier(_top_values(x_nv, k, w))
    return _candidate_threshold(vals_nk, m_n, z_n, top_p)
  threshold, decided = on_candidates(*stages[0])
  later = [functools.partial(on_candidates, k, w) for k, w in stages[1:]]
  later.append(lambda: (_bisect_threshold(x_nv, m_n, z_n, top_p), jnp.ones_like(decided)))
  for stage in later:
    # A row keeps the first decisive stage's answer; a stage runs only if a row needs it.
    def run(t, d, stage=stage):
      t_new, d_new = stage()
      return jnp.where(d, t, t_new), d | d_new
    threshold, decided = jax.lax.cond(decided.all(), lambda t, d: (t, d), run,
                                      threshold, decided)
  return threshold


def process_logits(logits: jax.Array, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> jax.Array:
  """Logits of the sampling distribution: scaled, with dropped tokens at -inf.

  Top-k then the nucleus (Holtzman et al. 2020, "The Curious Case of Neural Text
  Degeneration", arXiv:1904.09751) of the renormalised top-k distribution, as the
  module docstring states; found without sorting the vocabulary.

  Args:
    logits: [..., V] float logits.
    temperature: > 0 (static).
    top_k: keep the k largest (0 or >= V: all), static.
    top_p: nucleus mass in [0, 1] (1: all), static.

  Returns:
    [..., V] float32; ``softmax`` of it is the distribution sampled from. Entries kept
    are ``logits / temperature`` bit for bit.

  Raises:
    ValueError: temperature <= 0, top_k < 0, or top_p outside [0, 1].
  """
  if temperature <= 0:
    raise ValueError(f"temperature={temperature} must be > 0 here (0 means greedy in generate)")
  if top_k < 0:
    raise ValueError(f"top_k={top_k} must be >= 0 (0 disables it)")
  if not 0.0 <= top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in [0, 1]")
  scaled = jnp.asarray(logits).astype(jnp.float32) / temperature
  v = scaled.shape[-1]
  k = v if top_k == 0 else min(top_k, v)
  if k == v and top_p >= 1.0:
    return scaled
  x_nv = scaled.reshape(-1, v)
  if k == v and v > _SMALL_VOCAB:
    threshold = _nucleus_threshold(x_nv, top_p)
  else:
    vals = _top_values(x_nv, k, _STAGES[0][1])  # [N, k] descending
    if top_p < 1.0:
      n_keep = nucleus_keep(jax.nn.softmax(vals, axis=-1), top_p).sum(-1, keepdims=True)
    else:
      n_keep = jnp.full(vals.shape[:-1] + (1,), k)
    threshold = jnp.take_along_axis(vals, n_keep - 1, axis=-1)[:, 0]
  threshold = threshold.reshape(scaled.shape[:-1] + (1,))
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def token_logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                               top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """log-prob of ``tokens`` under the sampling distribution of ``logits``.

  Args:
    logits: [..., V]. tokens: [...] int ids. temperature, top_k, top_p: as ``process_logits``.

  Returns:
    [...] float32; -inf for a token outside the kept set.
  """
  logp = jax.nn.log_softmax(process_logits(logits, temperature, top_k, top_p), axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
