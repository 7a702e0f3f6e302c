"""Property tests: random add / sample / evict sequences against the plain-numpy reference.

Contents, pointers, sizes, counters, drawn statistics and sampling probabilities are
compared exactly (floats to 1e-5) after every operation, across wrap-around (capacity 7,
adds of 1, 3 and 9 > C items) and eviction holes; ``can_sample`` against the reference's
count of drawable items, and the use counters also after draws that ``can_sample`` refuses.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxreplay import replay
from jaxreplay.replay.config import SamplerConfig
from jaxreplay.replay.reference import NumpyBuffer

C, B = 7, 3
CONFIGS = [
    SamplerConfig(),
    SamplerConfig(replace=True),
    SamplerConfig(sampler="recency", recency_temperature=1.5, recency_beta=0.5),
    SamplerConfig(sampler="recency", recency="geometric", recency_p=0.4),
    SamplerConfig(sampler="priority", priority_alpha=0.7, priority_beta=0.6),
    SamplerConfig(sampler="positive_bias", positive_bias_size=5, positive_bias_delta=0.6),
    SamplerConfig(sampler="fresh_first"),
    SamplerConfig(max_times_sampled=2),
    SamplerConfig(max_staleness=2),
]

_add = jax.jit(replay.add)
_evict = jax.jit(replay.evict, static_argnames="spec")


@functools.cache
def _sampler(cfg):
  return jax.jit(lambda s, k, v, t: replay.sample(s, k, B, v, t, cfg))


def _items(rng, n, start):
  ids = np.arange(start, start + n, dtype=np.int32)
  return {"id": ids, "tok": np.stack([ids, ids * 3], 1).astype(np.int32),
          "rewards": rng.choice([0.0, 0.5, 1.0], n).astype(np.float32),
          "advantages": rng.normal(size=n).astype(np.float32)}


def _assert_same_state(s, ref):
  for k in ref.items:
    np.testing.assert_array_equal(s.items[k], ref.items[k], err_msg=k)
  for f in ("policy_version", "insert_step", "times_sampled", "last_sampled_step", "reward",
            "advantage", "valid"):
    np.testing.assert_array_equal(getattr(s, f), getattr(ref, f), err_msg=f)
  assert int(s.write_index) == ref.write_index
  assert int(s.size) == ref.size
  assert int(s.total_inserted) == ref.total_inserted


def _can_sample(ref, cfg, version):
  probs = ref.probabilities(version, B, cfg) if cfg.max_staleness is None else None
  if cfg.max_staleness is not None:  # do not mutate the reference here
    alive = ref.valid & (version - ref.policy_version <= cfg.max_staleness)
    return alive.sum() >= B
  if cfg.replace or cfg.sampler in ("recency", "priority"):
    return ref.size >= 1
  return (probs > 0).sum() >= B if cfg.sampler != "fresh_first" else ref.size >= B


# (kind, a, b): kind 0-2 add a∈{1,3,9} items with lag b; 3-7 sample with CONFIGS[a];
# 8 evict with max_staleness a; 9 advance version and step. Weighted toward add / sample.
OPS = st.tuples(st.integers(0, 9), st.integers(0, len(CONFIGS) - 1), st.integers(0, 2))


def _decode(kind, a, b):
  if kind <= 2:
    return "add", (1, 3, 9)[a % 3], b
  if kind <= 7:
    return "sample", a, 0
  if kind == 8:
    return "evict", 1 + 2 * (a % 2), 0
  return "tick", 0, 0


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=6, max_size=24), seed=st.integers(0, 2**16))
def test_matches_numpy_reference(ops, seed):
  rng = np.random.default_rng(seed)
  s = replay.init({k: jnp.asarray(v) for k, v in _items(rng, 1, 0).items()}, C)
  ref = NumpyBuffer(_items(rng, 1, 0), C)
  version, step, next_id = 5, 0, 0
  for j, raw in enumerate(ops):
    op, a, b = _decode(*raw)
    if op == "add":
      items = _items(rng, a, next_id)
      next_id += a
      v = np.full(a, version - b, np.int32)
      s = _add(s, {k: jnp.asarray(x) for k, x in items.items()}, jnp.asarray(v),
               jnp.int32(step))
      ref.add(items, v, step)
    elif op == "tick":
      version, step = version + 1, step + 1
    elif op == "evict":
      cfg = SamplerConfig(max_staleness=a)
      s = _evict(s, jnp.int32(version), spec=cfg)
      ref.evict(version, max_staleness=a)
    else:
      cfg = CONFIGS[a]
      ok = _can_sample(ref, cfg, version)
      assert bool(replay.can_sample(s, B, cfg, jnp.int32(version))) == ok, cfg
      s, r = _sampler(cfg)(s, jax.random.key(seed * 100 + j), jnp.int32(version),
                           jnp.int32(step))
      probs = ref.probabilities(version, B, cfg)  # applies age eviction to ref
      idx = np.asarray(r.indices)
      if not ok:  # outside the contract: no law to check, but the bookkeeping stays exact
        ref.apply_sample(idx, version, step, cfg)
        _assert_same_state(s, ref)
        continue
      assert (probs[idx] > 0).all(), (cfg, idx, probs)
      assert ref.valid[idx].all()
      if not cfg.replace and cfg.sampler not in ("recency", "priority"):
        assert len(set(idx.tolist())) == B
      np.testing.assert_allclose(r.probs, probs[idx], rtol=1e-5)
      if cfg.sampler in ("recency", "priority"):
        beta = cfg.priority_beta if cfg.sampler == "priority" else cfg.recency_beta
        np.testing.assert_allclose(r.weights, ref.importance_weights(probs, idx, beta),
                                   rtol=1e-5)
      else:
        np.testing.assert_array_equal(r.weights, 1.0)
      if cfg.sampler == "fresh_first":
        n_fresh = int((ref.valid & (ref.times_sampled == 0)).sum())
        assert int((ref.times_sampled[idx] == 0).sum()) == min(B, n_fresh)
      expect = ref.apply_sample(idx, version, step, cfg)
      for f in ("staleness", "times_sampled_before", "steps_since_last_use"):
        np.testing.assert_array_equal(getattr(r, f), expect[f], err_msg=f)
      for k in expect["items"]:
        np.testing.assert_array_equal(r.items[k], expect["items"][k])
    _assert_same_state(s, ref)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(adds=st.lists(st.sampled_from([2, 4, 6]), min_size=1, max_size=6))
def test_group_mode_matches_reference(adds):
  cfg = SamplerConfig(group_size=2)
  rng = np.random.default_rng(len(adds))
  s = replay.init({k: jnp.asarray(v) for k, v in _items(rng, 1, 0).items()}, 8)
  ref = NumpyBuffer(_items(rng, 1, 0), 8)
  next_id = 0
  for j, n in enumerate(adds):
    items = _items(rng, n, next_id)
    next_id += n
    s = _add(s, {k: jnp.asarray(x) for k, x in items.items()}, jnp.zeros(n, jnp.int32),
             jnp.int32(j))
    ref.add(items, np.zeros(n, np.int32), j)
    s, r = _group_sampler(s, jax.random.key(j), jnp.int32(0), jnp.int32(j))
    probs = ref.probabilities(0, 2, cfg)
    idx = np.asarray(r.indices)
    assert idx[0] % 2 == 0 and idx[1] == idx[0] + 1 and (probs[idx] > 0).all()
    np.testing.assert_allclose(r.probs, probs[idx], rtol=1e-6)
    ref.apply_sample(idx, 0, j, cfg)
    _assert_same_state(s, ref)


_group_sampler = jax.jit(lambda s, k, v, t: replay.sample(s, k, 2, v, t,
                                                          SamplerConfig(group_size=2)))
