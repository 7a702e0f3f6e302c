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
"""

from __future__ import annotations

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


def process_logits(logits: jax.Array, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> jax.Array:
  """Logits of the sampling distribution: scaled, with dropped tokens at -inf.

  Args:
    logits: [..., V] float logits.
    temperature: > 0 (static).
    top_k: keep the k largest (0 or >= V: all), static.
    top_p: nucleus mass in [0, 1] (1: all), static.

  Returns:
    [..., V] float32; ``softmax`` of it is the distribution sampled from.

  Raises:
    ValueError: temperature <= 0, top_k < 0, or top_p outside [0, 1].
  """
  if temperature <= 0:
    raise ValueError(f"temperature={temperature} must be > 0 here (0 means greedy in generate)")
  if top_k < 0:
    raise ValueError(f"top_k={top_k} must be >= 0 (0 disables it)")
  if not 0.0 <= top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in [0, 1]")
  scaled = logits.astype(jnp.float32) / temperature
  v = scaled.shape[-1]
  k = v if top_k == 0 else min(top_k, v)
  if k == v and top_p >= 1.0:
    return scaled
  vals = jax.lax.top_k(scaled, k)[0]  # [..., k] descending
  if top_p < 1.0:
    n_keep = nucleus_keep(jax.nn.softmax(vals, axis=-1), top_p).sum(-1, keepdims=True)
  else:
    n_keep = jnp.full(vals.shape[:-1] + (1,), k)
  threshold = jnp.take_along_axis(vals, n_keep - 1, axis=-1)
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
