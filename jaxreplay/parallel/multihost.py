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

import os
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


# What JAX's own SLURM detection reads (jax/_src/clusters/slurm_cluster.py): all five present
# means JAX takes coordinator, process count and id from them.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
  """Tasks of this job step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (or
  ``SLURM_TASKS_PER_NODE``; format ``2(x3),1``: per node, in node order) and
  ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``, else ``SLURM_NTASKS`` over
  ``SLURM_STEP_NUM_NODES`` (or ``SLURM_NNODES``) when it divides evenly; None otherwise."""
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    text = env.get(name, "")
    counts = []
    for part in filter(None, text.split(",")):
      m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
      if m is None:
        counts = []
        break
      counts += [int(m.group(1))] * int(m.group(2) or 1)
    if counts:
      node = int(env.get("SLURM_NODEID", "0") or 0)
      return counts[node] if node < len(counts) else counts[0]
  per_node = env.get("SLURM_NTASKS_PER_NODE", "")
  if per_node.isdigit():
    return int(per_node)
  tasks, nodes = env.get("SLURM_NTASKS", ""), env.get("SLURM_STEP_NUM_NODES",
                                                      env.get("SLURM_NNODES", ""))
  if tasks.isdigit() and nodes.isdigit() and int(nodes) and int(tasks) % int(nodes) == 0:
    return int(tasks) // int(nodes)
  return None


def _visible_gpus(env: Mapping[str, str]) -> int | None:
  """GPUs this process's CUDA runtime will see: the entries of ``CUDA_VISIBLE_DEVICES``
  (SLURM sets it for the task's GPUs), else ``SLURM_GPUS_ON_NODE`` (the node's GPUs of the
  job, all visible to every task); None when neither is set."""
  cvd = env.get("CUDA_VISIBLE_DEVICES")
  if cvd is not None:
    cvd = cvd.strip()
    return 0 if cvd in ("", "NoDevFiles", "-1") else len(cvd.split(","))
  on_node = env.get("SLURM_GPUS_ON_NODE", "")
  return int(on_node) if on_node.isdigit() else None


def slurm_local_device_ids(env: Mapping[str, str]) -> list[int] | None:
  """The GPUs one SLURM task drives, as ``local_device_ids`` for ``jax.distributed``.

  JAX, given no ``local_device_ids`` under SLURM, restricts each process to the one GPU
  ``[SLURM_LOCALID]`` (``jax/_src/clusters/cluster.py``): right for one task per GPU
  whose tasks all see every GPU of the node, wrong for one task per node (it would drive
  only GPU 0 of 8) and for ``--gpus-per-task=1`` (each task sees one GPU, index 0, so
  local ids 1..7 do not exist). This splits the GPUs the task sees (``n``, see below)
  between the ``k`` tasks of its node:

  - ``k == 1`` (one process per node): all of them, ``[0, ..., n-1]``;
  - ``SLURM_GPUS_PER_TASK=g`` and ``n == g`` (SLURM bound g GPUs to each task, e.g.
    ``--gpus-per-task=1``): all of them, ``[0, ..., g-1]``;
  - otherwise ``n`` a multiple of ``k`` (every task sees all the node's GPUs): the
    ``n // k`` consecutive ones of local task ``SLURM_LOCALID``.

  ``n`` is the number of entries of ``CUDA_VISIBLE_DEVICES`` (device ids are indices into
  that list), else ``SLURM_GPUS_ON_NODE``. A process with no GPU information gets None
  (JAX's own choice, ``[SLURM_LOCALID]``; harmless on CPU), or ``[]`` when it is alone on
  its node: no restriction, every device it sees.

  Args:
    env: environment variables (``os.environ`` or a test's dict); read, never changed.

  Returns:
    list of local device ids (ints >= 0), ``[]`` (all visible devices), or None (leave it
    to JAX): None also outside SLURM (any of ``SLURM_VARS`` unset), where JAX sets no ids,
    and when ``JAX_LOCAL_DEVICE_IDS`` is set (JAX reads it itself).

  Raises:
    ValueError: the visible GPUs do not split evenly between the node's tasks; the
      message names the variables and the fix (``distributed.local_device_ids``).
  """
  if not all(v in env for v in SLURM_VARS) or env.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  n, k, local = _visible_gpus(env), _tasks_on_node(env), int(env["SLURM_LOCALID"])
  per_task = env.get("SLURM_GPUS_PER_TASK", "")
  if n == 0:
    return None
  if k == 1:
    return [] if n is None else list(range(n))
  if n is None or k is None:
    return None
  if n == 1 or (per_task.isdigit() and int(per_task) == n):
    return list(range(n))
  if n % k:
    raise ValueError(
        f"SLURM: {n} visible GPUs (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}, "
        f"SLURM_GPUS_ON_NODE={env.get('SLURM_GPUS_ON_NODE')!r}) do not split between the "
        f"{k} tasks on this node; launch one task per node, or --gpus-per-task=G, or set "
        "config.distributed.local_device_ids")
  g = n // k
  return list(range(local * g, (local + 1) * g))


def initialize_args(settings: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
  """The ``jax.distributed.initialize`` keyword arguments for ``settings`` in ``env``.

  Pure: ``initialize`` calls it with ``os.environ``. Settings left None stay None, so JAX
  detects them (TPU metadata, ``SLURM_*``, Open MPI), except ``local_device_ids`` under
  SLURM when the process placement is SLURM's too (``num_processes`` unset): then
  ``slurm_local_device_ids(env)``, so that a task drives every GPU it owns. Settings given
  explicitly are passed as they are.

  Args:
    settings: ``jaxreplay.config.distributed_settings`` output: ``coordinator_address``
      (str ``host:port`` or None), ``num_processes`` (int or None), ``process_id`` (int or
      None), ``local_device_ids`` (sequence of int or None); missing keys count as None.
    env: environment variables.

  Returns:
    dict with exactly those four keys; ``local_device_ids`` a list of int, ``[]`` (no
    restriction) or None.

  Raises:
    ValueError: from ``slurm_local_device_ids``.
  """
  out = {k: settings.get(k) for k in ("coordinator_address", "num_processes", "process_id",
                                       "local_device_ids")}
  out["coordinator_address"] = out["coordinator_address"] or None
  if out["local_device_ids"] is not None:
    out["local_device_ids"] = [int(i) for i in out["local_device_ids"]]
  elif out["num_processes"] is None:
    out["local_device_ids"] = slurm_local_device_ids(env)
  return out


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: Sequence[int] | None = None) -> dict[str, Any]:
  """Starts JAX's distributed runtime (``jax.distributed.initialize``); call before any
  other JAX call.

  Arguments left None are detected by JAX from the environment: TPU VM metadata, SLURM
  (``SLURM_*`` variables, via ``jax._src.clusters.SlurmCluster``), Open MPI, and others.
  Under SLURM the local devices are this module's choice (``initialize_args``): every GPU
  the task owns — all of the node's with one task per node, its own with
  ``--gpus-per-task`` — where JAX alone would take only GPU ``SLURM_LOCALID``.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: processes in the job (>= 1). process_id: this process, in
      [0, num_processes). local_device_ids: ids of the local devices this process uses
      (e.g. one GPU per process); None: detected as above (outside SLURM: all of them).

  Returns:
    The keyword arguments passed to ``jax.distributed.initialize`` (for logs).

  Raises:
    ValueError: under SLURM, visible GPUs that do not split between the node's tasks.
    RuntimeError: from JAX (the runtime is already initialised, the coordinator is not
      reachable, or nothing could be detected).
  """
  args = initialize_args(dict(coordinator_address=coordinator_address,
                              num_processes=num_processes, process_id=process_id,
                              local_device_ids=local_device_ids), os.environ)
  jax.distributed.initialize(**args)
  return args


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
