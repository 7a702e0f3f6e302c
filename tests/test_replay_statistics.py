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
    s = s.replace(valid=s.valid.at[jnp.array([0, 5, 6, 17])].set(False), size=s.size - 4)
  if used:
    s = s.replace(times_sampled=s.times_sampled.at[jnp.arange(0, C, 3)].set(1))
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


@pytest.mark.parametrize("n_max", [None, 24], ids=["pairwise_dedup", "sorted_dedup"])
@pytest.mark.parametrize("n,k", [(4, 3), (10, 3), (14, 3)],
                         ids=["n_near_k_several_blocks", "n_le_4k", "n_gt_4k"])
def test_distinct_ranks_gives_uniform_subsets(n, k, n_max):
  """Every k-subset of {0..n−1} equally likely (a stronger test than slot frequencies)."""
  reps = DRAWS
  r = np.asarray(jax.jit(jax.vmap(lambda key: S.distinct_ranks(key, n, k, n_max)))(
      jax.random.split(jax.random.key(7), reps)))
  assert ((r >= 0) & (r < n)).all()
  r = np.sort(r, axis=1)
  assert (np.diff(r, axis=1) > 0).all()
  subsets = {c: i for i, c in enumerate(itertools.combinations(range(n), k))}
  counts = np.bincount([subsets[tuple(row)] for row in r.tolist()], minlength=len(subsets))
  assert len(subsets) == math.comb(n, k)
  p = scipy.stats.chisquare(counts).pvalue
  assert p > 1e-3, p


def test_distinct_ranks_dedup_paths_agree():
  """The sorted first-block dedup (static bound n_max) returns exactly the pairwise one."""
  keys = jax.random.split(jax.random.key(3), 200)
  for n, k in [(5, 4), (40, 16), (1000, 128), (100_000, 128)]:
    draw = jax.jit(jax.vmap(lambda key, m: S.distinct_ranks(key, n, k, m), (0, None)),
                   static_argnums=1)
    np.testing.assert_array_equal(draw(keys, None), draw(keys, 100_000))


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
