"""process_logits against a NumPy sort-based reference of the top-k / nucleus rule.

The reference sorts each row in float64 and applies the rule of the module docstring.
Rows whose cumulative mass lies within float32 rounding of top_p are ill-posed for any
float32 implementation; ``_assert_kept_equal`` checks that none of the cases is one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import logit_processing as lp

V = 8192  # above the small-vocabulary cut, so the candidate stages and bisection run
jitted = jax.jit(lp.process_logits, static_argnums=(1, 2, 3))


def reference_kept(x, top_k=0, top_p=1.0):
  """[N, V] bool kept set (finite entries) of the sort-based rule, and the smallest
  |before - top_p| at a row's cut (how far the case is from float32 rounding)."""
  kept, margin = [], np.inf
  for row in np.asarray(x, np.float64):
    vals = np.sort(row)[::-1][:top_k or row.size]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    keep = before < top_p
    keep[0] = True
    n = keep.sum()
    if 0.0 < top_p < 1.0:  # the last kept and first dropped positions decide the cut
      margin = min(margin, np.abs(before[max(n - 1, 1):n + 1] - top_p).min(initial=np.inf))
    kept.append((row >= vals[n - 1]) & (row > -np.inf))
  return np.stack(kept), margin


def _assert_kept_equal(out, x, top_k, top_p):
  want, margin = reference_kept(x, top_k, top_p)
  assert margin > 1e-7, "case too close to float32 rounding to be exact"
  np.testing.assert_array_equal(np.asarray(out) > -np.inf, want)
  np.testing.assert_array_equal(np.where(want, x, -np.inf), np.asarray(out))


def logits(kind, n=6, v=V, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, v))
  if kind == "peaked":
    x = 2 * x
    x[:, :8] += x.max(-1, keepdims=True) + rng.uniform(6, 14, (n, 1)) - 1.5 * np.arange(8)
  elif kind == "spread":
    x = 3 * x
  elif kind == "flat":
    x = 0.3 * x
  elif kind == "ties":
    x = np.round(2 * x)  # ~20 distinct values: every boundary is a tie
  elif kind == "neginf":
    x = 3 * x
    x[:, rng.random(v) < 0.5] = -np.inf
    x[0, 1:] = -np.inf  # a single finite token
  return x.astype(np.float32)


KINDS = ["peaked", "spread", "flat", "ties", "neginf"]
MIXED = np.concatenate([logits(kind, n=2, seed=i) for i, kind in enumerate(KINDS)])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.3), (0, 0.0), (0, 1.0), (40, 0.8),
                                         (3000, 0.9), (25, 1.0)])
def test_matches_sort_reference(top_k, top_p):
  out = jitted(MIXED, 1.0, top_k, top_p)
  _assert_kept_equal(out, MIXED, top_k, top_p)


def test_unjitted_and_leading_dims():
  out = lp.process_logits(MIXED.reshape(2, 5, V), 1.0, 0, 0.9)
  assert out.shape == (2, 5, V) and out.dtype == jnp.float32
  _assert_kept_equal(out.reshape(10, V), MIXED, 0, 0.9)


@pytest.mark.parametrize("kinds,stages", [
    (["spread"], ((2, 8), (512, 4))),  # nuclei of 2..512 tokens: the second stage decides
    (["peaked", "ties", "neginf", "flat"], ((4, 8), (16, 8))),  # flat rows need the bisection
])
def test_fallback_stages_are_exact(kinds, stages):
  x = np.concatenate([logits(kind, n=2, seed=1) for kind in kinds])
  want, margin = reference_kept(x, 0, 0.9)
  assert margin > 1e-7
  assert want.sum(-1).max() > stages[0][0]  # the first stage cannot decide every row
  threshold = jax.jit(lp._nucleus_threshold, static_argnums=(1, 2))(x, 0.9, stages)
  np.testing.assert_array_equal((x >= np.asarray(threshold)[:, None]) & (x > -np.inf), want)


def test_bisection_alone_is_exact():
  x = logits("spread", seed=2)
  m = x.max(-1)
  z = np.exp(x - m[:, None]).sum(-1, dtype=np.float32)
  t = lp._bisect_threshold(jnp.asarray(x), jnp.asarray(m), jnp.asarray(z), 0.75)
  np.testing.assert_array_equal(x >= np.asarray(t)[:, None], reference_kept(x, 0, 0.75)[0])


def test_a_row_does_not_depend_on_the_batch():
  peaked, flat = logits("peaked", n=3), logits("flat", n=3)
  alone = jitted(peaked, 1.0, 0, 0.9)  # decided by the first stage
  mixed = jitted(np.concatenate([peaked, flat]), 1.0, 0, 0.9)  # the bisection runs
  np.testing.assert_array_equal(np.asarray(alone), np.asarray(mixed)[:3])


def test_order_key_is_monotone_and_invertible():
  x = np.array([-np.inf, -3e38, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38, np.inf], np.float32)
  k = np.asarray(lp._order_key(jnp.asarray(x)))
  assert (np.diff(k) > 0).all()
  np.testing.assert_array_equal(np.asarray(lp._from_key(jnp.asarray(k))), x)


def test_all_neg_inf_row_stays_neg_inf():
  x = np.full((2, V), -np.inf, np.float32)
  x[1, 5] = 0.0
  out = np.asarray(jitted(x, 1.0, 0, 0.9))
  assert np.isneginf(out[0]).all() and out[1, 5] == 0.0 and np.isneginf(np.delete(out[1], 5)).all()


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (7, 0.6), (0, 0.0), (50, 1.0)])
def test_top_values_is_the_exact_top_k(top_k, top_p):
  x = logits("ties", n=3, v=V + 5)  # a partial last block
  got = np.asarray(lp._top_values(jnp.asarray(x), 64, 8))
  np.testing.assert_array_equal(got, -np.sort(-x, axis=-1)[:, :64])
  _assert_kept_equal(jitted(x, 1.0, top_k, top_p), x, top_k, top_p)
