"""The sampling contract: ``can_sample`` is True exactly when a draw of B without duplicates
exists, and ``sample`` keeps the use counters exact when called without it.

Counts are checked slot by slot (uses added == appearances in ``indices``); ``can_sample``
against the plain-numpy reference's count of drawable items and against the draws
themselves, on states with wrap-around, age eviction and use-count eviction holes.
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay
from jaxreplay.replay.config import SamplerConfig
from jaxreplay.replay.reference import NumpyBuffer

C = 8


def _items(n, start=0, rewards=None):
  ids = np.arange(start, start + n, dtype=np.int32)
  return {"id": ids, "rewards": (np.zeros(n, np.float32) if rewards is None
                                 else np.asarray(rewards, np.float32))}


def _jnp(items):
  return {k: jnp.asarray(v) for k, v in items.items()}


def _four_valid(evicts):
  """C = 8 slots, 4 valid: slots 0-3, slot 1 used once; or, with ``evicts``, slots 2, 3, 6,
  7 (slots 0, 1, 4, 5 evicted by age, leaving holes), slots 2 and 6 used once."""
  s = replay.init(_jnp(_items(1)), C, evicts=evicts)
  if not evicts:
    s = replay.add(s, _jnp(_items(4, rewards=[1, 0, 1, 1])), jnp.full(4, 5, jnp.int32), 0)
  else:
    s = replay.add(s, _jnp(_items(8, rewards=[1, 0, 1, 1, 0, 1, 1, 0])),
                   jnp.array([0, 0, 5, 5, 0, 0, 5, 5], jnp.int32), 0)
    s = replay.evict(s, jnp.int32(5), SamplerConfig(max_staleness=2))
  used = np.zeros(C, np.int32)
  used[[2, 6] if evicts else [1]] = 1
  return replay.set_columns(s, times_sampled=jnp.asarray(used))


DRAW_CASES = {  # (config, batch size B > the 4 valid items, state with holes?)
    "uniform": (SamplerConfig(), 8, False),
    "uniform_holes": (SamplerConfig(), 8, True),
    "uniform_b6": (SamplerConfig(), 6, False),
    "groups": (SamplerConfig(group_size=2), 8, True),
    "positive_bias": (SamplerConfig(sampler="positive_bias", positive_bias_size=8), 8, True),
    "fresh_first": (SamplerConfig(sampler="fresh_first"), 8, True),
    "uniform_replace": (SamplerConfig(replace=True), 8, False),
    "priority": (SamplerConfig(sampler="priority"), 8, True),
    "max_times_sampled": (SamplerConfig(max_times_sampled=1), 8, False),
}


@pytest.mark.parametrize("name", list(DRAW_CASES))
@pytest.mark.parametrize("bundle", [False, True], ids=["sample", "bundle"])
def test_use_counts_stay_exact_when_fewer_items_than_the_batch(name, bundle):
  """4 valid items, a batch of 6 or 8: the batch repeats items (``can_sample`` is False for
  the samplers without replacement) and every position counts one use of its slot."""
  cfg, b, evicts = DRAW_CASES[name]
  s = _four_valid(evicts)
  before = np.asarray(s.times_sampled)
  valid = np.asarray(s.valid)
  iid = cfg.replace or cfg.sampler in ("recency", "priority")
  assert bool(replay.can_sample(s, b, cfg)) == iid
  if bundle:
    s, r = replay.make_replay_buffer(C, b, cfg).sample(s, jax.random.key(1), jnp.int32(5),
                                                       jnp.int32(9))
  else:
    s, r = jax.jit(replay.sample, static_argnums=(2, 5))(s, jax.random.key(1), b, 5, 9, cfg)
  idx = np.asarray(r.indices)
  assert valid[idx].all(), idx  # repeats live items, never an empty slot
  if not iid:
    assert len(set(idx.tolist())) < b
  drawn = np.bincount(idx, minlength=C)
  np.testing.assert_array_equal(np.asarray(s.times_sampled) - before, drawn)
  assert int(np.asarray(s.times_sampled).sum() - before.sum()) == b
  if cfg.max_times_sampled is not None:  # every drawn item reached its use limit and left
    np.testing.assert_array_equal(np.asarray(s.valid), valid & (drawn == 0))
    assert int(s.size) == int((valid & (drawn == 0)).sum())
  np.testing.assert_array_equal(np.asarray(s.last_sampled_step)[drawn > 0], 9)
  np.testing.assert_array_equal(r.times_sampled_before, before[idx])


def test_use_counts_stay_exact_on_an_empty_buffer():
  """No valid item at all: the batch holds empty slots, whose counts still match the draw
  (``add`` resets them when it fills the slot)."""
  for cfg in (SamplerConfig(), SamplerConfig(sampler="fresh_first"),
              SamplerConfig(sampler="recency")):
    s = replay.init(_jnp(_items(1)), C, evicts=False)
    assert not bool(replay.can_sample(s, 1, cfg))
    s, r = replay.sample(s, jax.random.key(0), 4, 0, 3, cfg)
    np.testing.assert_array_equal(s.times_sampled, np.bincount(r.indices, minlength=C))
    s = replay.add(s, _jnp(_items(C)), jnp.zeros(C, jnp.int32), 4)
    np.testing.assert_array_equal(s.times_sampled, 0)


_PB = dict(sampler="positive_bias", positive_bias_size=6, positive_bias_delta=0.5)
CONFIGS = [  # each sampler without eviction rules, then with both (evicting by use count
    # after the draw: the checked states come from draws with these configs)
    SamplerConfig(),
    SamplerConfig(group_size=2),
    SamplerConfig(**_PB),
    SamplerConfig(sampler="fresh_first"),
    SamplerConfig(max_staleness=1, max_times_sampled=1),
    SamplerConfig(group_size=2, max_staleness=2, max_times_sampled=1),
    SamplerConfig(**_PB, max_staleness=1, max_times_sampled=2),
    SamplerConfig(sampler="fresh_first", max_staleness=1, max_times_sampled=2),
    SamplerConfig(replace=True),
    SamplerConfig(sampler="recency"),
    SamplerConfig(sampler="priority", max_staleness=1),
]


def _batch_sizes(cfg):
  out = []
  for b in range(1, C + 1):
    try:
      cfg.validate_for(C, b)
    except ValueError:
      continue
    out.append(b)
  return out


@functools.cache
def _check(cfg):
  """Jitted ``(state, key, version, step) -> ([k] can_sample, [k] draws)`` over every valid
  batch size of ``cfg`` (one compilation; no draws for the i.i.d. samplers)."""
  sizes = _batch_sizes(cfg)
  iid = cfg.replace or cfg.sampler in ("recency", "priority")

  def check(s, key, v, t):
    can = jnp.stack([replay.can_sample(s, b, cfg, v) for b in sizes])
    draws = [] if iid else [replay.sample(s, key, b, v, t, cfg)[1].indices for b in sizes]
    return can, draws

  return jax.jit(check)


@functools.cache
def _sampler(cfg, b):
  return jax.jit(lambda s, key, v, t: replay.sample(s, key, b, v, t, cfg))


_add = jax.jit(replay.add)


def _drawable(ref, cfg, version):
  """The reference's count of items the sampler may draw (after age eviction)."""
  ref = copy.deepcopy(ref)
  if cfg.max_staleness is not None:
    ref.evict(version, max_staleness=cfg.max_staleness)
  if cfg.sampler == "fresh_first":
    return ref.valid, int(ref.valid.sum())
  eligible = ref.eligible(cfg)
  return eligible, int(eligible.sum())


@pytest.mark.slow
def test_can_sample_is_false_exactly_when_a_draw_needs_duplicates():
  """For every sampler, eviction rule and valid B, on states from a fixed sequence of adds
  (with version lags), draws (evicting by use count) and version ticks: ``can_sample``
  equals "the reference counts >= B drawable items" (>= 1 for i.i.d. draws), a draw under
  it is B distinct drawable slots, and a draw without it cannot be."""
  rng = np.random.default_rng(0)
  s = replay.init(_jnp(_items(1)), C)
  ref = NumpyBuffer(_items(1), C)
  version, step, next_id, checked = 3, 0, 0, {True: 0, False: 0}
  ops = ["add", "add", "draw", "add", "tick", "draw", "add", "draw", "draw", "add", "tick",
         "draw", "add", "draw", "tick", "add", "draw", "add", "draw", "draw"]
  for j, op in enumerate(ops):
    if op == "add":
      n = int(rng.integers(2, 7))
      items = _items(n, next_id, rewards=rng.choice([0.0, 1.0], n))
      v = (version - rng.integers(0, 3, n)).astype(np.int32)
      s = _add(s, _jnp(items), jnp.asarray(v), jnp.int32(step))
      ref.add(items, v, step)
      next_id += n
    elif op == "tick":
      version, step = version + 1, step + 1
    else:  # a draw under the contract, with a config that evicts by age and use count
      cfg = CONFIGS[4 + j % 4]
      if _drawable(ref, cfg, version)[1] >= 2:
        s, r = _sampler(cfg, 2)(s, jax.random.key(j), jnp.int32(version), jnp.int32(step))
        ref.evict(version, max_staleness=cfg.max_staleness)
        ref.apply_sample(np.asarray(r.indices), version, step, cfg)
    np.testing.assert_array_equal(s.valid, ref.valid)
    assert int(s.size) == ref.size
    for cfg in CONFIGS:
      eligible, n = _drawable(ref, cfg, version)
      iid = cfg.replace or cfg.sampler in ("recency", "priority")
      can, draws = _check(cfg)(s, jax.random.key(100 + j), jnp.int32(version), jnp.int32(step))
      for i, (b, got) in enumerate(zip(_batch_sizes(cfg), np.asarray(can).tolist())):
        assert got == (n >= (1 if iid else b)), (j, cfg, b, n)
        if not iid:
          idx = np.asarray(draws[i])
          assert (len(set(idx.tolist())) == b and eligible[idx].all()) == got, (j, cfg, b, idx)
          checked[got] += 1
  assert checked[True] > 20 and checked[False] > 20, checked
