"""The same operations on 1 device and on 8 fake CPU devices (buffer sharded along C over
mesh axis 'data') give bit-identical results, and the sharding is kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay
from jaxreplay.replay.config import SamplerConfig

C = 32
CONFIGS = [
    SamplerConfig(),
    SamplerConfig(sampler="priority", priority_alpha=0.5),
    SamplerConfig(sampler="positive_bias", positive_bias_size=12, positive_bias_delta=0.5),
    SamplerConfig(sampler="recency", recency_temperature=2.0, max_staleness=3),
    SamplerConfig(group_size=4, max_times_sampled=2),
]


def _items(n, start):
  ids = jnp.arange(start, start + n, dtype=jnp.int32)
  return {"tokens": jnp.stack([ids, 2 * ids, 3 * ids, 4 * ids], 1),
          "logp": -0.01 * jnp.stack([ids] * 4, 1).astype(jnp.float32),
          "rewards": (ids % 3 == 0).astype(jnp.float32),
          "advantages": jnp.sin(ids.astype(jnp.float32))}


def _scenario(state, key):
  results = []
  state = replay.add(state, _items(20, 0), jnp.arange(20, dtype=jnp.int32) // 5, 0)
  for i, cfg in enumerate(CONFIGS):
    state, r = replay.sample(state, jax.random.fold_in(key, i), 8, 4, 1, cfg)
    results.append(r)
  state = replay.add(state, _items(24, 100), jnp.full((24,), 5, jnp.int32), 2)  # wraps
  state, r = replay.sample(state, jax.random.fold_in(key, 99), 8, 5, 2, CONFIGS[0])
  return state, results + [r]


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_one_device_and_eight_sharded_devices_agree():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  single = jax.device_put(replay.init(_items(1, 0), C), jax.devices()[0])
  sharded = replay.shard(replay.init(_items(1, 0), C), mesh)
  assert sharded.items["tokens"].sharding.spec == jax.sharding.PartitionSpec("data")
  assert len(sharded.valid.addressable_shards) == 8
  assert sharded.valid.addressable_shards[0].data.shape == (C // 8,)
  run = jax.jit(_scenario, donate_argnums=0)
  key = jax.random.key(0)
  s1, r1 = run(single, key)
  s8, r8 = run(sharded, key)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               (s1, r1), (s8, r8))
  assert int(s8.total_inserted) == 44
  # the sharding along C survives add/sample under jit
  for leaf in (s8.items["tokens"], s8.valid, s8.times_sampled):
    assert leaf.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")), leaf.ndim), \
        leaf.sharding


def test_state_sharding_rejects_indivisible_capacity():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1] * 1), ("data",))
  replay.state_sharding(replay.init(_items(1, 0), 5), mesh)  # 1 shard: fine
  if jax.device_count() >= 8:
    mesh8 = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    with pytest.raises(ValueError, match="buffer.capacity=12"):
      replay.state_sharding(replay.init(_items(1, 0), 12), mesh8)
