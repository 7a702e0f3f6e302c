"""Multi-process helpers on JAX's own distributed runtime (``jax.distributed``,
``jax.experimental.multihost_utils``): start-up, the primary process, barriers, and moving
values between one process's host memory and arrays that span every process.

In a multi-process job (a TPU pod, several GPU nodes, or local CPU processes) each
process runs the same program and owns some devices of one global mesh. A ``jax.Array``
that spans devices of other processes cannot be read with ``np.asarray``; ``to_host``
gathers it (``process_allgather``), and ``to_global`` builds one from a value every
process holds (each process supplies only the blocks of its own devices). With one
process every function here reduces to the plain single-process call.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: Sequence[int] | None = None) -> None:
  """Starts JAX's distributed runtime (``jax.distributed.initialize``); call before any
  other JAX call.

  Arguments left None are detected by JAX from the environment: TPU VM metadata, SLURM
  (``SLURM_*`` variables, via ``jax._src.clusters.SlurmCluster``), Open MPI, and others.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: processes in the job (>= 1). process_id: this process, in
      [0, num_processes). local_device_ids: ids of the local devices this process uses
      (e.g. one GPU per process); None: all of them.

  Raises:
    RuntimeError: from JAX (the runtime is already initialised, the coordinator is not
      reachable, or nothing could be detected).
  """
  jax.distributed.initialize(coordinator_address=coordinator_address or None,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=(None if local_device_ids is None
                                               else list(local_device_ids)))


def is_primary() -> bool:
  """True in process 0: the one process that writes run files (metrics, configs,
  summaries, renames). Orbax itself coordinates its checkpoint writes across processes."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Blocks until every process reaches the barrier ``name`` (a no-op with one process).

  Source: ``jax.experimental.multihost_utils.sync_global_devices``.
  """
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _host(x):
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.device_get(x)


def to_host(tree: Any) -> Any:
  """Every array of ``tree`` as a whole host NumPy value, on every process.

  An array sharded over devices of several processes is gathered with
  ``multihost_utils.process_allgather(x, tiled=True)`` (a collective: every process must
  call ``to_host`` on the same tree); a fully addressable or fully replicated one is read
  locally with ``jax.device_get``. Non-array leaves pass through.

  Args:
    tree: pytree of ``jax.Array`` (any sharding), NumPy arrays or Python scalars.

  Returns:
    The same structure with NumPy arrays of the global shapes and dtypes.
  """
  return jax.tree.map(_host, tree)


def to_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array with ``sharding`` from a value every process holds whole.

  With one process (or a sharding whose devices are all local) this is
  ``jax.device_put``. Otherwise each process passes only the blocks of its own devices
  (``jax.make_array_from_callback``), so ``x`` must be the same on every process — as the
  prompts read at a data position, or a PRNG key built from the config's seed, are.

  Args:
    x: a NumPy array, a Python scalar, or a fully addressable ``jax.Array`` (a typed PRNG
      key array goes through its ``key_data``); an array that already spans processes is
      resharded (a jitted identity). sharding: the target sharding.

  Returns:
    ``jax.Array`` of ``x``'s shape and dtype laid out by ``sharding``.
  """
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard
    return x if x.sharding == sharding else jax.jit(lambda a: a, out_shardings=sharding)(x)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(x)
    data = to_global(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=impl)
  host = np.asarray(jax.device_get(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def agree(code: int) -> np.ndarray:
  """Every process's ``code`` (int32), indexed by process: how processes that must take
  one decision together (e.g. whether a checkpoint is corrupt) see each other's view.

  Returns:
    [process_count] int32 NumPy array (``[code]`` with one process).
  """
  if jax.process_count() == 1:
    return np.asarray([code], np.int32)
  return np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
