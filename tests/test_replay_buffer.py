"""Unit tests of jaxreplay.replay with hand-computed values (CASES.md 8, 9, 13; issue 2)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay
from jaxreplay.replay import rate_limiter as rl
from jaxreplay.replay import samplers as S
from jaxreplay.replay import stats
from jaxreplay.replay.config import SamplerConfig, from_config

CORRECT_12 = np.array([1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1], np.float32)


def _items(n, start=0, rewards=None, advantages=None):
  ids = np.arange(start, start + n, dtype=np.int32)
  return {"id": jnp.asarray(ids), "tok": jnp.asarray(np.stack([ids, -ids], 1)),
          "rewards": jnp.asarray(np.zeros(n, np.float32) if rewards is None else rewards),
          "advantages": jnp.asarray(np.zeros(n, np.float32) if advantages is None
                                    else advantages)}


_sample = jax.jit(replay.sample, static_argnames=("batch_size", "spec"))
_add = jax.jit(replay.add)
_probs = jax.jit(replay.probabilities, static_argnames=("batch_size", "spec"))
_batch_stats = jax.jit(stats.batch_stats, static_argnames="num_bins")
_buffer_stats = jax.jit(stats.buffer_stats, static_argnames="num_bins")


# --- insertion and wrap-around ------------------------------------------------------------


def test_add_wraps_and_keeps_newest():
  s = replay.init(_items(1), 5)
  s = _add(s, _items(3), jnp.full(3, 0), 0)
  np.testing.assert_array_equal(s.items["id"], [0, 1, 2, 0, 0])
  assert (int(s.write_index), int(s.size), int(s.total_inserted)) == (3, 3, 3)
  s = _add(s, _items(4, start=3), jnp.full(4, 1), 1)  # wraps: slots 3,4,0,1
  np.testing.assert_array_equal(s.items["id"], [5, 6, 2, 3, 4])
  np.testing.assert_array_equal(s.policy_version, [1, 1, 0, 1, 1])
  np.testing.assert_array_equal(s.insert_step, [1, 1, 0, 1, 1])
  assert (int(s.write_index), int(s.size), int(s.total_inserted)) == (2, 5, 7)
  s = _add(s, _items(12, start=7), jnp.arange(12), 2)  # N > C: newest 5 (14..18) kept
  # start = 2 + (12 - 5) = 9 ≡ 4 mod 5: 14→4, 15→0, 16→1, 17→2, 18→3
  np.testing.assert_array_equal(s.items["id"], [15, 16, 17, 18, 14])
  np.testing.assert_array_equal(s.policy_version, [8, 9, 10, 11, 7])
  assert (int(s.write_index), int(s.size), int(s.total_inserted)) == (4, 5, 19)


def test_add_reads_rewards_from_items_or_kwargs_and_validates_shapes():
  s = replay.init(_items(1), 4)
  s = replay.add(s, _items(2, rewards=np.array([1.0, 0.5], np.float32)), jnp.zeros(2), 0)
  np.testing.assert_array_equal(s.reward, [1.0, 0.5, 0, 0])
  s = replay.add(s, {"x": jnp.zeros((2, 3))} if False else _items(2), jnp.zeros(2), 0,
                 rewards=jnp.array([3.0, 4.0]), advantages=jnp.array([-1.0, 2.0]))
  np.testing.assert_array_equal(s.reward, [1.0, 0.5, 3.0, 4.0])
  np.testing.assert_array_equal(s.advantage, [0, 0, -1.0, 2.0])
  with pytest.raises(ValueError, match="rewards"):
    replay.add(s, _items(2), jnp.zeros(2), 0, rewards=jnp.zeros(3))
  with pytest.raises(ValueError, match="leading|lead"):
    replay.add(s, _items(3), jnp.zeros(2), 0)
  with pytest.raises(ValueError, match="buffer.capacity=0"):
    replay.init(_items(1), 0)


def test_sample_updates_use_counters_and_statistics():
  s = replay.init(_items(1), 4)
  s = replay.add(s, _items(4), jnp.array([3, 4, 5, 6]), 0)
  s, r = _sample(s, jax.random.key(0), batch_size=4, current_version=7, step=10)
  assert sorted(np.asarray(r.indices).tolist()) == [0, 1, 2, 3]
  np.testing.assert_array_equal(r.items["id"], r.indices)
  np.testing.assert_array_equal(r.staleness, 7 - np.array([3, 4, 5, 6])[r.indices])
  np.testing.assert_array_equal(r.times_sampled_before, 0)
  np.testing.assert_array_equal(r.steps_since_last_use, -1)
  np.testing.assert_allclose(r.probs, 0.25)
  np.testing.assert_array_equal(r.weights, 1.0)
  s, r = _sample(s, jax.random.key(1), batch_size=2, current_version=7, step=13)
  np.testing.assert_array_equal(r.times_sampled_before, 1)
  np.testing.assert_array_equal(r.steps_since_last_use, 3)
  ts = np.ones(4, np.int32)
  ts[np.asarray(r.indices)] = 2
  np.testing.assert_array_equal(s.times_sampled, ts)
  b = _batch_stats(r, num_bins=4)
  assert float(b["frac_never_used"]) == 0.0 and float(b["replay_count_mean"]) == 2.0
  assert float(b["steps_since_last_use_mean"]) == 3.0
  np.testing.assert_array_equal(b["steps_since_last_use_hist"], [0, 0, 0, 2])
  np.testing.assert_array_equal(b["staleness_hist"], np.bincount(
      np.minimum(np.asarray(r.staleness), 3), minlength=4))
  bs = _buffer_stats(s, num_bins=4)
  np.testing.assert_array_equal(bs["times_sampled_hist"], [0, 2, 2, 0])
  assert float(bs["times_sampled_mean"]) == 1.5


# --- positive bias (issue 2 example, paper App. 10.4) -------------------------------------


def test_positive_bias_example_exact():
  cfg = SamplerConfig(sampler="positive_bias", positive_bias_size=8, positive_bias_delta=0.75)
  assert (cfg.num_fresh_any, cfg.num_fresh_correct) == (2, 6)
  for capacity in (12, 13):  # rollouts r1..r12 inserted in order, one at a time
    s = replay.init(_items(1), capacity)
    if capacity == 13:  # make the ring wrap: 5 older items first, then r1..r12
      s = replay.add(s, _items(5, start=100, rewards=np.ones(5, np.float32)), jnp.zeros(5), 0)
    for j in range(12):
      s = _add(s, _items(1, start=j + 1, rewards=CORRECT_12[j:j + 1]), jnp.array([j]), j)
    if capacity == 12:
      p = np.asarray(_probs(s, 12, batch_size=8, spec=cfg))
      eligible = sorted(np.asarray(s.items["id"])[p > 0].tolist())
      assert eligible == [2, 4, 6, 7, 9, 10, 11, 12]
      np.testing.assert_allclose(p[p > 0], 1 / 8)
    # B = N = 8 without replacement: the batch is the eligible set itself
    _, r = _sample(s, jax.random.key(3), batch_size=8, current_version=12, step=12, spec=cfg)
    assert sorted(np.asarray(r.items["id"]).tolist()) == [2, 4, 6, 7, 9, 10, 11, 12]


# --- CASES.md case 8: prefix-sum lookup and total mass ------------------------------------


def test_case8_prefix_search_boundaries_and_mass():
  cums = jnp.cumsum(jnp.array([1.0, 1.0, 1.0]))
  np.testing.assert_array_equal(S.prefix_search(cums, jnp.array([0.5, 1.5, 2.5])), [0, 1, 2])
  assert float(cums[-1]) == 3.0
  cums = jnp.cumsum(jnp.array([1.0, 2.0, 3.0]))
  assert float(cums[-1]) == 6.0
  u = jnp.array([0.5, 0.999, 1.0, 2.9, 3.0, 5.99], jnp.float32)
  np.testing.assert_array_equal(S.prefix_search(cums, u), [0, 0, 1, 1, 2, 2])
  cums = jnp.cumsum(jnp.ones(5))
  np.testing.assert_array_equal(S.prefix_search(cums, jnp.arange(5) + 0.5), [0, 1, 2, 3, 4])


def test_case8_priority_probabilities_and_draws():
  cfg = SamplerConfig(sampler="priority", priority_alpha=1.0, priority_eps=0.0)
  s = replay.init(_items(1), 3)
  s = replay.add(s, _items(3, advantages=np.array([1.0, -2.0, 3.0], np.float32)),
                 jnp.zeros(3), 0)
  p = np.asarray(_probs(s, 0, batch_size=1, spec=cfg))
  np.testing.assert_allclose(p, [1 / 6, 1 / 3, 1 / 2], atol=1e-6)
  assert abs(p.sum() - 1) < 1e-6
  draws = jax.jit(jax.vmap(lambda k: replay.sample(s, k, 1000, 0, 0, cfg)[1].indices))(
      jax.random.split(jax.random.key(8), 60))
  freq = np.bincount(np.asarray(draws).ravel(), minlength=3) / 60_000
  np.testing.assert_allclose(freq, [1 / 6, 1 / 3, 1 / 2], atol=0.01)
  # capacity 5, all priorities 1: the newest item (slot 4) has probability 0.2, not 0
  s5 = replay.init(_items(1), 5)
  s5 = replay.add(s5, _items(5, advantages=np.ones(5, np.float32)), jnp.zeros(5), 0)
  np.testing.assert_allclose(_probs(s5, 0, batch_size=1, spec=cfg), 0.2, atol=1e-7)


@pytest.mark.parametrize("cfg", [
    SamplerConfig(),
    SamplerConfig(sampler="recency", recency_temperature=2.0),
    SamplerConfig(sampler="recency", recency="geometric", recency_p=0.3),
    SamplerConfig(sampler="priority"),
    SamplerConfig(sampler="positive_bias", positive_bias_size=4, positive_bias_delta=0.5),
    SamplerConfig(sampler="fresh_first"),
    SamplerConfig(group_size=2),
], ids=lambda c: f"{c.sampler}-{c.recency}-g{c.group_size}")
def test_case8_probabilities_sum_to_one_and_zero_on_empty(cfg):
  s = replay.init(_items(1), 10)
  s = replay.add(s, _items(7, rewards=CORRECT_12[:7], advantages=np.linspace(-1, 2, 7)),
                 jnp.arange(7), 0)
  s, _ = replay.sample(s, jax.random.key(0), 2, 7, 1)  # some used items for fresh_first
  p = np.asarray(_probs(s, 7, batch_size=2, spec=cfg))
  assert abs(p.sum() - 1) < 1e-6
  np.testing.assert_array_equal(p[7:], 0.0)


# --- CASES.md case 13: importance weights ---------------------------------------------------


def test_case13_importance_weights():
  p = jnp.array([0.1, 0.2, 0.3, 0.4], jnp.float32)
  np.testing.assert_allclose(S.raw_importance_weights(p, 4, 1.0),
                             [2.5, 1.25, 0.8333333, 0.625], atol=1e-5)
  np.testing.assert_allclose(S.importance_weights(p, 1.0), [1.0, 0.5, 0.3333333, 0.25],
                             atol=1e-5)
  np.testing.assert_allclose(S.importance_weights(p, 0.4),
                             [1.0, 0.7578583, 0.6443940, 0.5743492], atol=1e-5)
  u = jnp.full((4,), 0.25, jnp.float32)
  np.testing.assert_array_equal(S.importance_weights(u, 0.4), 1.0)
  np.testing.assert_allclose(S.raw_importance_weights(u[:1], 1, 0.4), 1.7411011, atol=1e-5)


def test_case13_through_the_priority_sampler():
  cfg = SamplerConfig(sampler="priority", priority_alpha=1.0, priority_eps=0.0,
                      priority_beta=0.4)
  s = replay.init(_items(1), 4)
  s = replay.add(s, _items(4, advantages=np.array([1.0, -2.0, 3.0, 4.0], np.float32)),
                 jnp.zeros(4), 0)
  np.testing.assert_allclose(_probs(s, 0, batch_size=1, spec=cfg), [0.1, 0.2, 0.3, 0.4],
                             atol=1e-6)
  _, r = _sample(s, jax.random.key(0), batch_size=64, current_version=0, step=0, spec=cfg)
  expect = np.array([1.0, 0.7578583, 0.6443940, 0.5743492])[np.asarray(r.indices)]
  np.testing.assert_allclose(r.weights, expect, atol=1e-5)
  # uniform priorities: every weight exactly 1.0
  s = replay.init(_items(1), 4)
  s = replay.add(s, _items(4, advantages=np.full(4, 0.7, np.float32)), jnp.zeros(4), 0)
  _, r = _sample(s, jax.random.key(0), batch_size=16, current_version=0, step=0, spec=cfg)
  np.testing.assert_array_equal(r.weights, 1.0)


# --- eviction (CASES.md case 9 staleness filter; Reverb max_times_sampled) ------------------


def test_max_staleness_evicts_before_drawing():
  cfg = SamplerConfig(max_staleness=1)
  s = replay.init(_items(1), 4)
  s = replay.add(s, _items(4), jnp.array([5, 6, 7, 7]), 0)
  s = replay.add(s, _items(2, start=4), jnp.array([7, 7]), 1)  # pointer 2, full
  s = replay.add(s, _items(4, start=6), jnp.array([5, 6, 7, 7]), 2)  # write 2,3,0,1
  assert (int(s.write_index), int(s.size)) == (2, 4)
  np.testing.assert_array_equal(s.policy_version, [7, 7, 5, 6])
  assert not bool(replay.can_sample(s, 4, cfg, current_version=7))
  assert bool(replay.can_sample(s, 3, cfg, current_version=7))
  s2, r = _sample(s, jax.random.key(0), batch_size=3, current_version=7, step=3, spec=cfg)
  assert sorted(np.asarray(r.indices).tolist()) == [0, 1, 3]  # version 5 (slot 2) dropped
  np.testing.assert_array_equal(np.asarray(s.policy_version)[np.asarray(r.indices)] >= 6, True)
  np.testing.assert_array_equal(s2.valid, [True, True, False, True])
  assert int(s2.size) == 3
  np.testing.assert_allclose(r.probs, 1 / 3)
  with pytest.raises(ValueError, match="current_version"):
    replay.can_sample(s, 3, cfg)


def test_max_times_sampled_evicts_after_use_and_add_refills():
  cfg = SamplerConfig(max_times_sampled=1)
  s = replay.init(_items(1), 6)
  s = replay.add(s, _items(6), jnp.zeros(6), 0)
  s, r1 = _sample(s, jax.random.key(0), batch_size=4, current_version=0, step=0, spec=cfg)
  assert int(s.size) == 2
  s, r2 = _sample(s, jax.random.key(1), batch_size=2, current_version=0, step=1, spec=cfg)
  assert set(np.asarray(r2.indices).tolist()) == set(range(6)) - set(
      np.asarray(r1.indices).tolist())
  assert int(s.size) == 0 and not bool(s.valid.any())
  s = replay.add(s, _items(3, start=6), jnp.ones(3), 2)  # into the holes at slots 0,1,2
  assert int(s.size) == 3 and int(s.write_index) == 3
  np.testing.assert_array_equal(s.valid, [1, 1, 1, 0, 0, 0])
  _, r = _sample(s, jax.random.key(2), batch_size=3, current_version=0, step=2, spec=cfg)
  assert sorted(np.asarray(r.items["id"]).tolist()) == [6, 7, 8]


# --- fresh_first and groups -------------------------------------------------------------------


def test_fresh_first_takes_never_used_first():
  cfg = SamplerConfig(sampler="fresh_first")
  s = replay.init(_items(1), 8)
  s = replay.add(s, _items(8), jnp.zeros(8), 0)
  seen = set()
  for t in range(3):  # 8 items, batches of 3: 3 fresh, 3 fresh, 2 fresh + 1 used
    s, r = _sample(s, jax.random.key(t), batch_size=3, current_version=0, step=t, spec=cfg)
    idx = np.asarray(r.indices).tolist()
    assert len(set(idx)) == 3
    fresh = [i for i in idx if i not in seen]
    assert len(fresh) == min(3, 8 - len(seen))
    seen.update(idx)
  assert seen == set(range(8))
  np.testing.assert_array_equal(np.asarray(r.times_sampled_before)[:2], 0)
  assert int(r.times_sampled_before[2]) == 1
  np.testing.assert_allclose(r.probs, [1 / 3, 1 / 3, (1 / 6) / 3], rtol=1e-6)


def test_group_mode_samples_whole_aligned_groups():
  cfg = SamplerConfig(group_size=4)
  s = replay.init(_items(1), 12)
  s = replay.add(s, _items(8), jnp.zeros(8), 0)
  for t in range(5):
    s, r = _sample(s, jax.random.key(t), batch_size=8, current_version=0, step=t, spec=cfg)
    ids = np.asarray(r.items["id"]).reshape(2, 4)
    assert sorted(ids[:, 0].tolist()) == [0, 4]
    np.testing.assert_array_equal(ids - ids[:, :1], [[0, 1, 2, 3]] * 2)
  s = replay.add(s, _items(6, start=8), jnp.zeros(6), 1)  # 2 of block 0 overwritten (12, 13)
  # blocks: [12,13,2,3] (mixed groups, but all valid), [4..7], [8..11]
  p = np.asarray(_probs(s, 0, batch_size=4, spec=cfg))
  np.testing.assert_allclose(p, 1 / 12)
  with pytest.raises(ValueError, match="group_size"):
    SamplerConfig(group_size=2, sampler="recency")
  with pytest.raises(ValueError, match="group_size"):
    SamplerConfig(group_size=4).validate_for(10, 8)


# --- configuration errors -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field", [
    (dict(sampler="unifrom"), "buffer.sampler='unifrom'"),
    (dict(recency="linear"), "buffer.recency='linear'"),
    (dict(recency_temperature=0.0), "buffer.recency_temperature=0.0"),
    (dict(recency_p=1.0), "buffer.recency_p=1.0"),
    (dict(priority_beta=1.5), "buffer.priority_beta=1.5"),
    (dict(priority_alpha=-1.0), "buffer.priority_alpha=-1.0"),
    (dict(sampler="positive_bias"), "buffer.positive_bias_size=None"),
    (dict(sampler="positive_bias", positive_bias_size=8, positive_bias_delta=2.0),
     "buffer.positive_bias_delta=2.0"),
    (dict(sampler="fresh_first", replace=True), "buffer.replace=True"),
    (dict(max_staleness=-1), "buffer.max_staleness=-1"),
    (dict(max_times_sampled=0), "buffer.max_times_sampled=0"),
])
def test_config_errors_name_field_value_and_choices(kwargs, field):
  with pytest.raises(ValueError, match=field.replace("(", r"\(")) as e:
    SamplerConfig(**kwargs)
  if "sampler" in kwargs and kwargs["sampler"] == "unifrom":
    assert "positive_bias" in str(e.value)  # lists the valid choices


def test_from_config_and_validate_for():
  import ml_collections
  c = from_config(ml_collections.ConfigDict(dict(capacity=64, sampler="recency",
                                                 recency_temperature=3.0)))
  assert c == SamplerConfig(capacity=64, sampler="recency", recency_temperature=3.0)
  with pytest.raises(ValueError, match="buffer.temperature"):
    from_config({"capacity": 4, "temperature": 1.0})
  with pytest.raises(ValueError, match="buffer.batch_size=9"):
    SamplerConfig().validate_for(8, 9)
  SamplerConfig(replace=True).validate_for(8, 9)
  with pytest.raises(ValueError, match="positive_bias_size=10"):
    SamplerConfig(sampler="positive_bias", positive_bias_size=10).validate_for(8, 4)
  with pytest.raises(ValueError, match="capacity=4"):
    replay.make_replay_buffer(4, 8)


# --- no recompilation across learner steps ---------------------------------------------------


def test_no_recompilation_across_steps():
  traces = {"add": 0, "sample": 0}
  cfg = SamplerConfig(sampler="recency", max_staleness=3)

  @jax.jit
  def add(s, items, v, step):
    traces["add"] += 1
    return replay.add(s, items, v, step)

  @jax.jit
  def learner(s, key, step):
    traces["sample"] += 1
    s, r = replay.sample(s, key, 4, step, step, cfg)
    return s, r.items["id"].sum()

  rb = replay.make_replay_buffer(10, 4)
  s, s2 = replay.init(_items(1), 10, evicts=cfg.evicts), rb.init(_items(1))
  for step in range(7):  # wraps around at step 3
    items = _items(3, start=3 * step)
    s = add(s, items, jnp.full(3, step, jnp.int32), jnp.int32(step))
    s, _ = learner(s, jax.random.key(step), jnp.int32(step))
    s2 = rb.add(s2, items, jnp.full(3, step, jnp.int32), jnp.int32(step))
    s2, _ = rb.sample(s2, jax.random.key(step), jnp.int32(step), jnp.int32(step))
  assert traces == {"add": 1, "sample": 1}
  assert rb.add._cache_size() == 1 and rb.sample.jitted._cache_size() == 1


def test_eviction_marks_the_state_and_uniform_sampling_skips_the_holes():
  """A state evicted outside ``sample`` (rule in another config, or ``set_columns(s,
  valid=)``) is marked ``may_have_holes``; the default uniform sampler then draws only live
  items. The mark is static, so it changes a jitted caller's compiled version exactly once."""
  traces = []

  @jax.jit
  def draw(s, key):
    traces.append(1)
    return replay.sample(s, key, 4, 5, 5)

  versions = jnp.array([5, 5, 0, 0, 5, 5, 5, 5], jnp.int32)  # stale items mid-ring
  s = replay.add(replay.init(_items(1), 8, evicts=False), _items(8), versions, 0)
  assert not s.may_have_holes
  s, _ = draw(s, jax.random.key(0))
  s = replay.evict(s, jnp.int32(5), SamplerConfig(max_staleness=1))  # drops slots 2 and 3
  assert s.may_have_holes and int(s.size) == 6
  seen = set()
  for i in range(1, 30):
    s, r = draw(s, jax.random.key(i))
    seen.update(np.asarray(r.indices).tolist())
  # Ranks mapped as if the 6 live items were the 6 written last would give slots 2..7.
  assert seen == {0, 1, 4, 5, 6, 7} and len(traces) == 2
  assert replay.init(_items(1), 8).may_have_holes  # the safe default
  fresh = replay.add(replay.init(_items(1), 8, evicts=False), _items(8),
                     jnp.zeros(8, jnp.int32), 0)
  assert replay.set_columns(fresh, valid=fresh.valid.at[0].set(False)).may_have_holes
  # a hole poked into `meta` directly is seen too
  poked = replay.set_columns(fresh, meta=fresh.meta.at[2:4, 4].set(0), size=6)  # 4 = VALID
  assert poked.may_have_holes
  r = jax.jit(jax.vmap(lambda k: replay.sample(poked, k, 4, 0, 0)[1]))(
      jax.random.split(jax.random.key(1), 50))
  assert not np.isin(np.asarray(r.indices), [2, 3]).any()


def test_default_state_keeps_its_structure_through_evicting_samples_in_scan():
  """With the default ``init`` an evicting config does not change the state's structure, so
  the state can be a ``lax.scan`` carry."""
  cfg = SamplerConfig(max_staleness=3, max_times_sampled=2)
  s = replay.add(replay.init(_items(1), 8), _items(8), jnp.arange(8, dtype=jnp.int32), 0)

  def body(s, key):
    s, r = replay.sample(s, key, 2, 8, 8, cfg)
    return s, r.indices

  s, idx = jax.lax.scan(body, s, jax.random.split(jax.random.key(0), 2))
  idx = np.asarray(idx)
  assert np.isin(idx, [5, 6, 7]).all()  # versions >= 8 - 3
  assert all(len(set(row)) == 2 for row in idx.tolist())
  used_twice = [slot for slot in (5, 6, 7) if (idx == slot).sum() == 2]  # evicted at 2 uses
  assert int(s.size) == 3 - len(used_twice) and s.may_have_holes
  np.testing.assert_array_equal(np.flatnonzero(s.valid), sorted({5, 6, 7} - set(used_twice)))


@pytest.mark.slow
def test_vmapped_sampling_uses_each_key():
  """Under vmap every row is drawn from its own key, exactly as unbatched (XLA's batching
  of its bit generator alone would seed every row from the first key)."""
  s = replay.add(replay.init(_items(1), 64, evicts=False), _items(64),
                 jnp.zeros(64, jnp.int32), 0)
  keys = jax.random.split(jax.random.key(3), 4)
  batched = jax.vmap(lambda k: replay.sample(s, k, 8, 0, 0)[1].indices)(keys)
  for row, key in zip(np.asarray(batched), keys):
    np.testing.assert_array_equal(row, replay.sample(s, key, 8, 0, 0)[1].indices)
  swapped = jax.vmap(lambda k: replay.sample(s, k, 8, 0, 0)[1].indices)(keys[::-1])
  np.testing.assert_array_equal(np.asarray(swapped), np.asarray(batched)[::-1])


def test_set_columns_takes_column_names_on_single_and_stacked_states():
  s = replay.add(replay.init(_items(1), 4), _items(2), jnp.zeros(2, jnp.int32), 0)
  t = replay.set_columns(s, counters=jnp.array([7, 7, 7], jnp.int32), size=2)
  np.testing.assert_array_equal(t.counters, [7, 2, 7])
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), s, s)
  u = replay.set_columns(stacked, size=jnp.array([1, 2]), valid=jnp.zeros((2, 4), bool))
  np.testing.assert_array_equal(u.size, [1, 2])
  assert not np.asarray(u.valid).any() and u.may_have_holes
  _, r = replay.sample(s, jax.random.key(0), 2, 0, 0)
  r2 = replay.set_columns(r, weights=jnp.array([0.5, 2.0]), staleness=jnp.array([3, 4]))
  np.testing.assert_array_equal(r2.weights, [0.5, 2.0])
  np.testing.assert_array_equal(r2.staleness, [3, 4])
  np.testing.assert_array_equal(r2.indices, r.indices)
  # `.replace` is the plain dataclass replace: fields only, no hole mark
  fresh = replay.add(replay.init(_items(1), 4, evicts=False), _items(2),
                     jnp.zeros(2, jnp.int32), 0)
  assert not fresh.replace(meta=fresh.meta).may_have_holes
  with pytest.raises(TypeError):
    fresh.replace(valid=fresh.valid)
  with pytest.raises(TypeError, match="unknown keywords \\['vaild'\\]"):
    replay.set_columns(fresh, vaild=fresh.valid)
  with pytest.raises(TypeError, match="BufferState or SampleResult"):
    replay.set_columns(rl.init(), sampled=1)
  assert not replay.set_columns(fresh, valid=fresh.valid, may_have_holes=False).may_have_holes


def test_bundle_donates_state():
  rb = replay.make_replay_buffer(8, 2)
  s = rb.init(_items(1))
  old = s.items["tok"]
  s = rb.add(s, _items(2), jnp.zeros(2, jnp.int32), jnp.int32(0))
  assert old.is_deleted()
  old = s.meta
  s, _ = rb.sample(s, jax.random.key(0), jnp.int32(0), jnp.int32(0))
  assert old.is_deleted()


@pytest.mark.parametrize("cfg", [
    SamplerConfig(), SamplerConfig(replace=True), SamplerConfig(sampler="priority"),
    SamplerConfig(sampler="recency", recency="geometric"),
    SamplerConfig(sampler="positive_bias", positive_bias_size=8),
    SamplerConfig(sampler="fresh_first"), SamplerConfig(group_size=2),
    SamplerConfig(max_staleness=2, max_times_sampled=3)],
    ids=lambda c: f"{c.sampler}-{c.recency}-r{c.replace}-g{c.group_size}-{c.evicts}")
def test_compiled_add_and_sample_make_no_capacity_sized_copy(cfg):
  """Donated state is updated in place: the compiled HLO holds no copy of a [C, ...] buffer."""
  c = 1000
  items = {"tok": jnp.zeros((4, 8), jnp.int32), "rewards": jnp.zeros((4,), jnp.float32)}
  s = replay.init(items, c)
  add = jax.jit(replay.add, donate_argnums=0).lower(
      s, items, jnp.zeros(4, jnp.int32), jnp.int32(0)).compile().as_text()
  sample = jax.jit(lambda s, k: replay.sample(s, k, 2, 0, 0, cfg), donate_argnums=0).lower(
      s, jax.random.key(0)).compile().as_text()
  hlo_type = {"int32": "s32", "float32": "f32", "bool": "pred"}
  state_shapes = {hlo_type[x.dtype.name] + str(list(x.shape)).replace(" ", "")
                  for x in jax.tree.leaves(s) if x.ndim and x.shape[0] == c}  # "s32[1000,5]"
  for text in (add, sample):
    copies = [l for l in text.splitlines()
              if " copy(" in l and l.split("=")[1].split("{")[0].strip() in state_shapes]
    assert not copies, copies


# --- rate limiter -------------------------------------------------------------------------------


def test_rate_limiter_holds_ratio_and_min_fill():
  lim = rl.RateLimiter(samples_per_insert=2.0, min_size_to_sample=64, error_buffer=128.0)
  lim.check_sizes(insert_size=32, sample_size=16)
  st, size, trace = rl.init(), 0, []
  for _ in range(400):
    a = rl.next_action(lim, st, 32, 16, size)
    trace.append(a)
    if a == "generate":
      st, size = rl.record_insert(st, 32), min(size + 32, 256)
    else:
      assert size >= 64
      st = rl.record_sample(st, 16)
    diff = 2.0 * int(st.inserted) - int(st.sampled)
    if size >= 64:
      assert lim.offset - lim.error_buffer <= diff <= lim.offset + lim.error_buffer
  assert trace[:2] == ["generate", "generate"]  # min fill of 64 = two inserts of 32
  ratio = int(st.sampled) / int(st.inserted)
  assert abs(ratio - 2.0) <= (lim.offset + lim.error_buffer) / int(st.inserted) + 1e-9
  with pytest.raises(ValueError, match="error_buffer=1.0"):
    rl.RateLimiter(2.0, 64, 1.0).check_sizes(32, 16)
  with pytest.raises(ValueError, match="samples_per_insert=0"):
    rl.RateLimiter(0, 1, 1.0)
