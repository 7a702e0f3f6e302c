"""``parallel.transfers.implicit_transfers``: the placement audit counts a thread's implicit
host-to-device transfers by destination device, not its explicit ``device_put`` calls nor
another thread's transfers, and counts the repeats JAX logs without a destination."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.parallel import transfers


def ones(*shape):
  """float32 ones of a shape no other test transfers: JAX logs a transfer of a given shape,
  dtype and destination once per process (``parallel.transfers``), and test files share
  worker processes."""
  return np.ones(shape, np.float32)


def test_implicit_transfers_are_counted_by_device_and_thread():
  last = jax.devices()[-1]
  with transfers.implicit_transfers() as seen:
    jax.device_put(ones(3, 1, 4, 1, 5), last)  # explicit: not counted
    jnp.asarray(ones(4, 1, 4, 1, 5))  # implicit, onto the default device
    with jax.default_device(last):
      jnp.asarray(ones(5, 1, 4, 1, 5))
      jnp.asarray(ones(6, 1, 4, 1, 5))
    other = threading.Thread(target=lambda: jnp.asarray(ones(7, 1, 4, 1, 5)))  # another thread
    other.start()
    other.join()
  first = jax.devices()[0].id
  want = {first: 1}
  want[last.id] = want.get(last.id, 0) + 2
  assert dict(seen.single) == want and seen.sharded == 0 and seen.total == 3
  assert seen.onto([last.id]) == want[last.id]


def test_parse_reads_the_guard_lines_and_ignores_the_rest():
  seen = transfers.Transfers()
  seen.parse(
      "W1205 guard_lib.cc:125] host-to-device transfer: aval=ShapedArray(float32[3]), "
      "dst_sharding=SingleDeviceSharding(device=CpuDevice(id=5), memory_kind=device)\n"
      "some other warning id=3\n"
      "W1205 guard_lib.cc:125] host-to-device transfer: aval=ShapedArray(float32[4]), "
      "dst_sharding=NamedSharding(mesh=Mesh('d': 2, axis_types=(Auto,)), spec=P('d',), "
      "memory_kind=device)\n"
      "W1205 guard_lib.cc:125] host-to-device transfer: \n")
  assert dict(seen.single) == {5: 1} and seen.sharded == 1 and seen.repeated == 1
  assert seen.total == 3
  assert seen.onto([5, 6]) == 1 and seen.onto([3]) == 0


def test_a_repeated_transfer_is_counted_without_its_destination():
  """JAX writes a transfer's destination only the first time the process makes it; the
  repeats are counted in ``repeated``."""
  with transfers.implicit_transfers() as seen:
    for _ in range(3):
      jnp.asarray(ones(2, 7, 1, 8, 2))
  assert dict(seen.single) == {jax.devices()[0].id: 1} and seen.repeated == 2
  assert seen.total == 3
