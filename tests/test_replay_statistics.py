"""Chi-square tests: over 100,000 draws each sampler's empirical frequencies match the
probabilities it states (``replay.probabilities`` and ``SampleResult.probs``). Fixed seeds;
all draws of one test run inside one jitted vmap."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxreplay import replay
from jaxreplay.replay import samplers as S
from jaxreplay.replay.config import SamplerConfig

DRAWS = 100_000
C = 24
VERSION = 12


def _state(holes=False, used=False):
  rng = np.random.default_rng(0)
  items = {"id": jnp.arange(C, dtype=jnp.int32),
           "rewards": jnp.asarray(rng.choice([0.0, 1.0], C).astype(np.float32)),
           "advantages": jnp.asarray(rng.normal(size=C).astype(np.float32))}
  s = replay.init(items, C)
  s = replay.add(s, jax.tree.map(lambda x: x[:10], items), jnp.arange(10) // 2, 0)
  s = replay.add(s, jax.tree.map(lambda x: x[10:], items), 5 + jnp.arange(14) // 2, 1)
  if holes:
    s = replay.set_columns(s, valid=s.valid.at[jnp.array([0, 5, 6, 17])].set(False),
                           size=s.size - 4)
  if used:
    s = replay.set_columns(s, times_sampled=s.times_sampled.at[jnp.arange(0, C, 3)].set(1))
  return s


def _chi_square(counts, probs, batch):
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  assert counts.sum() == DRAWS
  np.testing.assert_array_equal(counts[probs == 0], 0)  # never draws a zero-probability slot
  support = probs > 0
  expected = probs[support] / probs[support].sum() * counts.sum()
  p_value = scipy.stats.chisquare(counts[support], expected).pvalue
  assert p_value > 1e-3, (p_value, counts, expected)
  return p_value


CASES = {
    "uniform": (SamplerConfig(), {}, 8),  # contiguous O(B) path; distinct_ranks is tested
                                          # on whole subsets below
    "uniform_holes": (SamplerConfig(), {"holes": True}, 4),  # masked O(C) path
    "uniform_replace": (SamplerConfig(replace=True), {}, 4),
    "recency_exponential": (SamplerConfig(sampler="recency", recency_temperature=3.0), {}, 4),
    "recency_geometric": (SamplerConfig(sampler="recency", recency="geometric",
                                        recency_p=0.1), {"holes": True}, 4),
    "priority": (SamplerConfig(sampler="priority", priority_alpha=0.8), {}, 4),
    "positive_bias": (SamplerConfig(sampler="positive_bias", positive_bias_size=12,
                                    positive_bias_delta=0.5), {}, 4),
    "fresh_first": (SamplerConfig(sampler="fresh_first"), {"used": True}, 20),
    "groups": (SamplerConfig(group_size=4), {"holes": True}, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampler_frequencies_match_stated_probabilities(name):
  cfg, kw, batch = CASES[name]
  state = _state(**kw)
  probs = np.asarray(replay.probabilities(state, VERSION, batch, cfg))
  assert abs(probs.sum() - 1) < 1e-6
  reps = DRAWS // batch

  @jax.jit
  def draw(keys):
    r = jax.vmap(lambda k: replay.sample(state, k, batch, VERSION, 0, cfg)[1])(keys)
    return r.indices, r.probs

  idx, p_drawn = draw(jax.random.split(jax.random.key(1234), reps))
  idx, p_drawn = np.asarray(idx), np.asarray(p_drawn)
  np.testing.assert_allclose(p_drawn, probs[idx], rtol=1e-6)  # stated with the batch
  if not cfg.replace and cfg.sampler not in ("recency", "priority"):
    assert all(len(set(row)) == batch for row in idx[:2000].tolist())
  _chi_square(np.bincount(idx.ravel(), minlength=C), probs, batch)


@pytest.mark.parametrize("n,k", [(4, 3), (5, 3), (6, 2)])
def test_distinct_ranks_gives_uniform_ordered_tuples(n, k):
  """Every ordered k-tuple of distinct values of {0..n−1} equally likely: the subset is
  uniform and so is its order (the trainer cuts batches into contiguous minibatches)."""
  r = np.asarray(jax.jit(jax.vmap(lambda key: S.distinct_ranks(key, n, k)))(
      jax.random.split(jax.random.key(7), DRAWS)))
  assert ((r >= 0) & (r < n)).all()
  assert all(len(set(row)) == k for row in r[:2000].tolist())
  tuples = {t: i for i, t in enumerate(itertools.permutations(range(n), k))}
  assert len(tuples) == math.perm(n, k)
  counts = np.bincount([tuples[tuple(row)] for row in r.tolist()], minlength=len(tuples))
  p = scipy.stats.chisquare(counts).pvalue
  assert p > 1e-3, p


def _fisher_yates_reference(r, n):
  """Sequential partial Fisher–Yates on [0, max(n, k)) with the given swap targets r_i."""
  a = list(range(max(n, len(r))))
  out = []
  for i, target in enumerate(r):
    a[i], a[target] = a[target], a[i]
    out.append(a[i] if a[i] < n else a[i] % n)
  return out


@pytest.mark.parametrize("k", [1, 7, 64, 600], ids=lambda k: f"k{k}")
def test_distinct_ranks_equals_sequential_fisher_yates(k):
  """The loop-free closed form returns exactly what the sequential shuffle does with the same
  swap targets, for n from below k to far above it (k = 600 takes the sort-based path)."""
  for seed, n in enumerate([max(1, k // 2), k, k + 1, 2 * k, 50 * k]):
    key = jax.random.key(seed)
    got = np.asarray(jax.jit(S.distinct_ranks, static_argnums=2)(key, n, k))
    i = np.arange(k)
    hi, lo = np.asarray(S.random_bits(key, (2, k)))
    span = np.maximum(n - i, 1).astype(np.uint32)
    mult = (np.uint32(2**16) % span) ** 2 % span  # uint32 arithmetic, wrapping as randint's
    r = i + (((hi % span) * mult + lo % span) % span).astype(np.int64)  # uniform on [i, n)
    assert list(got) == _fisher_yates_reference(r.tolist(), n), (k, n)
    if n >= k:
      assert len(set(got.tolist())) == k and got.max() < n
    else:
      assert sorted(got[:n].tolist()) == list(range(n))


def test_distinct_ranks_of_nothing_is_empty():
  assert S.distinct_ranks(jax.random.key(0), 5, 0).shape == (0,)


def test_previous_steps_paths_agree():
  """The pairwise (k <= 512) and sort-based (k > 512) searches for earlier swaps agree."""
  rng = np.random.default_rng(0)
  for k, n in [(600, 600), (600, 700), (600, 5000), (1000, 1200)]:
    i = np.arange(k)
    r = (i + rng.integers(0, n - i)).tolist()
    got = S._previous_steps(jnp.asarray(r, jnp.int32))
    swap = [max([j for j in range(t) if r[j] == r[t]], default=-1) for t in range(k)]
    fill = [max([j for j in range(t) if r[j] == t], default=-1) for t in range(k)]
    np.testing.assert_array_equal(got[0], swap)
    np.testing.assert_array_equal(got[1], fill)


def test_chi_square_detects_a_wrong_distribution():
  """The harness can fail: draws from one law judged against a slightly different one."""
  rng = np.random.default_rng(0)
  probs = np.full(C, 1 / C)
  counts = rng.multinomial(DRAWS, probs)
  _chi_square(counts, probs, 4)
  skewed = probs.copy()
  skewed[0], skewed[1] = 1.1 / C, 0.9 / C
  with pytest.raises(AssertionError):
    _chi_square(counts, skewed, 4)
