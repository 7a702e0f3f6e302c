"""The mesh's device order: topology-aware (``jax.experimental.mesh_utils``) where JAX knows
the topology (TPU slices, here fake TPU v4 devices with coordinates), the given order on CPU
(the 8 fake CPU devices of conftest.py) and where the topology cannot be mapped."""

import dataclasses
import random

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

from jaxreplay.parallel import sharding


@dataclasses.dataclass(frozen=True)
class FakeTpu:
  """The attributes of a TPU ``jax.Device`` that ``mesh_utils`` reads."""
  id: int
  coords: tuple
  core_on_chip: int = 0
  slice_index: int = 0
  process_index: int = 0
  platform: str = "tpu"
  device_kind: str = "TPU v4"


def v4_slice(chips, slice_index=0):
  """A TPU v4 slice of 2×2×(chips/4) chips, ids in x, y, z order (4 chips per host)."""
  return [FakeTpu(id=100 * slice_index + i, coords=(i % 2, i // 2 % 2, i // 4),
                  slice_index=slice_index, process_index=i // 4) for i in range(chips)]


def ids(grid):
  return np.vectorize(lambda d: d.id)(grid).tolist()


def test_cpu_keeps_the_device_order_and_a_prefix():
  devs = jax.devices()
  mesh = sharding.make_mesh(2, 2, 2)
  assert mesh.axis_names == ("data", "fsdp", "tensor") and dict(mesh.shape) == {
      "data": 2, "fsdp": 2, "tensor": 2}
  assert [d.id for d in mesh.devices.flat] == [d.id for d in devs]
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  prefix = sharding.make_mesh(-1, 1, 2, devices=devs[:4])  # as train.build passes it
  assert prefix.devices.shape == (2, 1, 2)
  assert [d.id for d in prefix.devices.flat] == [d.id for d in devs[:4]]
  np.testing.assert_array_equal(ids(mesh.devices),
                                ids(mesh_utils.create_device_mesh((2, 2, 2), devs)))
  with pytest.raises(ValueError, match=r"\(data, fsdp, tensor\)=\(3, 1, 2\) need 6 devices, "
                                       r"have 8"):
    sharding.make_mesh(3, 1, 2)
  with pytest.raises(ValueError, match="at most one may be -1"):
    sharding.make_mesh(-1, -1, 2)


def test_tpu_axes_follow_the_torus_whatever_the_device_order():
  devs = v4_slice(16)  # 2×2×4 chips
  shuffled = list(devs)
  random.Random(0).shuffle(shuffled)
  grid = sharding.mesh_devices((4, 1, 4), shuffled)
  # tensor groups: the 4 chips of one 2×2 plane (one host); data walks along z
  assert ids(grid) == [[[0, 2, 1, 3]], [[4, 6, 5, 7]], [[8, 10, 9, 11]], [[12, 14, 13, 15]]]
  assert [{d.coords[2] for d in grid[i].flat} for i in range(4)] == [{0}, {1}, {2}, {3}]
  # what a plain reshape of that order would give: tensor groups across the torus
  plain = np.asarray(shuffled, dtype=object).reshape(4, 1, 4)
  assert any(len({d.coords[2] for d in plain[i].flat}) > 1 for i in range(4))
  # 2×2×2: tensor along x, fsdp along y, data along z
  assert ids(sharding.mesh_devices((2, 2, 2), v4_slice(8))) == [[[0, 1], [2, 3]],
                                                               [[4, 5], [6, 7]]]


def test_slices_go_on_the_data_axis():
  devs = v4_slice(8, 0) + v4_slice(8, 1)
  grid = sharding.mesh_devices((4, 2, 2), devs[::-1])
  assert [{d.slice_index for d in grid[i].flat} for i in range(4)] == [{0}, {0}, {1}, {1}]
  assert ids(grid) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[100, 101], [102, 103]],
                       [[104, 105], [106, 107]]]


def test_unmappable_topology_falls_back_to_the_given_order(caplog):
  holey = v4_slice(16)[:3] + v4_slice(16)[4:9]  # not a cuboid of chips
  grid = sharding.mesh_devices((2, 2, 2), holey)
  assert ids(grid) == [[[0, 1], [2, 4]], [[5, 6], [7, 8]]]
  two = v4_slice(4, 0) + v4_slice(4, 1)  # 2 slices do not divide data=1
  assert ids(sharding.mesh_devices((1, 2, 4), two)) == [[[0, 1, 2, 3], [100, 101, 102, 103]]]
  assert "2 slices do not divide mesh.data=1" in caplog.text
