"""Per-sample weights and the staleness-adaptive trust region.

One pipeline composes two corrections multiplicatively, per sampled item i:

  w_i = w_sampling(i) · w_staleness(s_i)

* ``sampling_weights`` corrects for the buffer's non-uniform sampling distribution P(i)
  (prioritised or recency sampling) with the PER exponent β (Schaul et al. 2016,
  arXiv 1511.05952 §3.4): w = (N·P(i))^−β / max_j w_j. Uniform sampling gives exactly 1.
* The behaviour-policy correction (π/μ per token) lives in the loss (``losses``); the
  staleness s_i = (learner version − generating version) can additionally shrink the
  clip range, the truncation cap or the sample weight through ``staleness_factor``.

The loop computes ``sampling_weights`` from the buffer's ``SampleResult.probs`` and
passes them to ``train_step``; the train step multiplies in the staleness weight.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxreplay.rl.spec import STALENESS_FNS, STALENESS_TARGETS  # noqa: F401  (re-exported)


def sampling_weights(probs_b, buffer_size, beta: float, min_prob=None,
                     normalize: bool = True) -> jax.Array:
  """Importance weights for non-uniform replay (PER, Schaul et al. 2016 §3.4; CASES.md case 13).

  w_i = (N · P(i))^−β, divided by max_j w_j. The maximum is over the batch, or — when
  ``min_prob`` (the smallest probability of any valid slot) is given — over the whole
  buffer, w_max = (N · min_prob)^−β, which makes the weights batch-independent.

  Args:
    probs_b: [B] float32 sampling probabilities of the drawn items (> 0).
    buffer_size: N, int or int32 scalar, number of valid items.
    beta: exponent in [0, 1] (1 = full correction; 0 = all weights 1).
    min_prob: optional float32 scalar, see above.
    normalize: divide by the maximum (False gives the raw, exactly unbiased weights).

  Returns:
    [B] float32 weights in (0, 1] when normalised.

  Raises:
    ValueError: ``beta`` outside [0, 1].
  """
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta={beta} must be in [0, 1]")
  chex.assert_rank(probs_b, 1)
  n = jnp.asarray(buffer_size, jnp.float32)
  w = (n * probs_b.astype(jnp.float32)) ** (-beta)
  if not normalize:
    return w
  if min_prob is None:
    w_max = jnp.max(w)
  else:
    w_max = (n * jnp.asarray(min_prob, jnp.float32)) ** (-beta)
  return w / w_max


def staleness_factor(staleness_b, fn: str, rate: float) -> jax.Array:
  """f(s) ∈ [0, 1], f(0) = 1, non-increasing in the staleness s (policy versions).

  inverse: 1 / (1 + rate·s);  exp: exp(−rate·s);  linear: max(0, 1 − rate·s).
  Negative staleness (impossible in the loop) is treated as 0.

  Args:
    staleness_b: [B] int or float. fn: one of ``STALENESS_FNS``. rate: ≥ 0.

  Returns:
    [B] float32.

  Raises:
    ValueError: unknown ``fn`` or negative ``rate``.
  """
  if rate < 0:
    raise ValueError(f"rate={rate} must be >= 0")
  chex.assert_rank(staleness_b, 1)
  s = jnp.maximum(staleness_b.astype(jnp.float32), 0.0)
  if fn == "inverse":
    return 1.0 / (1.0 + rate * s)
  if fn == "exp":
    return jnp.exp(-rate * s)
  if fn == "linear":
    return jnp.maximum(1.0 - rate * s, 0.0)
  raise ValueError(f"fn={fn!r} is not one of {STALENESS_FNS}")


class TrustRegion(NamedTuple):
  """Per-sample trust-region parameters after staleness adaptation, each [B] float32.

  Attributes:
    eps_low, eps_high: clip range (``ppo_clip``, ``decoupled``, ``gspo``).
    cap: importance-weight truncation (``tis``, ``decoupled``); inf = none.
    weight: per-sample loss weight from staleness (1 unless target == "weight").
  """

  eps_low: jax.Array
  eps_high: jax.Array
  cap: jax.Array
  weight: jax.Array


def adaptive_trust_region(staleness_b, eps_low: float, eps_high: float, cap: float,
                          target: str = "none", fn: str = "inverse",
                          rate: float = 0.5) -> TrustRegion:
  """Staleness-adaptive trust region: the clip ε, the cap, or a weight as f(staleness).

  With f = ``staleness_factor``(s):
    target "clip":   ε_low(s) = ε_low·f(s), ε_high(s) = ε_high·f(s)
    target "cap":    cap(s) = 1 + (cap − 1)·f(s)  (stale items are truncated harder)
    target "weight": weight(s) = f(s)
    target "none":   all constant.
  Fresh data (s = 0) always gets the configured values.

  Args:
    staleness_b: [B] int. eps_low, eps_high: base clip range. cap: base truncation
      (≤ 0 or inf = none). target: one of ``STALENESS_TARGETS``. fn, rate: see
      ``staleness_factor``.

  Returns:
    TrustRegion of [B] float32 arrays.

  Raises:
    ValueError: unknown ``target`` / ``fn``.
  """
  if target not in STALENESS_TARGETS:
    raise ValueError(f"target={target!r} is not one of {STALENESS_TARGETS}")
  chex.assert_rank(staleness_b, 1)
  b = staleness_b.shape[0]
  f = staleness_factor(staleness_b, fn, rate) if target != "none" else jnp.ones((b,), jnp.float32)
  cap = jnp.inf if (cap is None or cap <= 0) else float(cap)
  full = lambda x: jnp.full((b,), x, jnp.float32)
  one = full(1.0)
  return TrustRegion(
      eps_low=eps_low * f if target == "clip" else full(eps_low),
      eps_high=eps_high * f if target == "clip" else full(eps_high),
      cap=(1.0 + (cap - 1.0) * f) if (target == "cap" and cap != jnp.inf) else full(cap),
      weight=f if target == "weight" else one)
