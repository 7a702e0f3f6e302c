"""The ``mesh`` and ``distributed`` config sections: the device mesh and the process group."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxreplay.spec import Spec, field

MESH_FIELDS = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshSpec(Spec):
  """The ``mesh`` section: sizes of the (data, fsdp, tensor) device mesh.

  Batches and the buffer's capacity axis split over data×fsdp / data; parameters by
  ``parallel.sharding.PARAM_RULES``. With ``generator_devices`` W > 0 (the actor–learner
  split, ``train.mode='async'``), each process's last W devices form the generator mesh
  and data/fsdp/tensor describe the learner mesh over the rest (``parallel.submesh``).

  Attributes:
    data: >= 1 devices on the data axis, or -1 for the remaining devices.
    fsdp: >= 1 devices on the fsdp axis (parameters sharded, gathered per layer), or -1.
    tensor: >= 1 devices on the tensor axis (heads and hidden units split), or -1.
    generator_devices: W >= 0 devices per process that only generate, on their own mesh
      with their own copy of the weights (0: generation runs on the learner's mesh).
    generator_tensor: >= 1 tensor-parallel size of the generator mesh (1: every generator
      device holds a whole inference replica; it must divide the job's generator devices).
  """

  SECTION: ClassVar[str] = "mesh"

  data: int = field(-1, allowed="(>= 1, or -1: the remaining devices)")
  fsdp: int = field(1, allowed="(>= 1, or -1: the remaining devices)")
  tensor: int = field(1, allowed="(>= 1, or -1: the remaining devices)")
  generator_devices: int = field(0, ge=0)
  generator_tensor: int = field(1, ge=1)

  def learner_device_count(self, device_count: int, process_count: int) -> int:
    """Devices of the learner mesh: all of them, less W per process with the split."""
    return device_count - self.generator_devices * process_count

  def check(self):
    """Raises ``ConfigError`` for a size below 1 other than -1, or more than one -1."""
    sizes = self.sizes
    for f, v in zip(MESH_FIELDS, sizes):
      if v < 1 and v != -1:
        self.fail(f, v, "must be a positive int, or -1 for the remaining devices")
    if sizes.count(-1) > 1:
      raise_mesh(dict(zip(MESH_FIELDS, sizes)), "at most one of data, fsdp, tensor may be -1")

  @property
  def sizes(self) -> tuple[int, int, int]:
    """(data, fsdp, tensor) as configured (-1 unresolved)."""
    return (self.data, self.fsdp, self.tensor)

  def shape(self, device_count: int) -> tuple[int, int, int]:
    """The resolved sizes on ``device_count`` devices.

    One size may be -1: it takes the remaining devices. Without a -1 the product may also
    be a divisor of the device count; the mesh then uses the first ``product`` devices.

    Args:
      device_count: number of devices (int).

    Returns:
      (data, fsdp, tensor), positive ints whose product divides ``device_count``.

    Raises:
      ConfigError: sizes whose product does not divide the device count.
    """
    sizes = list(self.sizes)
    known = 1
    for v in sizes:
      known *= v if v != -1 else 1
    if device_count % known:
      raise_mesh(dict(zip(MESH_FIELDS, sizes)), f"the product of the sizes ({known}) must "
                 f"divide jax.device_count()={device_count}")
    if -1 in sizes:
      sizes[sizes.index(-1)] = device_count // known
    return tuple(sizes)


def raise_mesh(sizes: dict, allowed: str):
  """Raises ``ConfigError("mesh={...} is invalid: ...")`` (a rule over all three sizes)."""
  from jaxreplay.spec import ConfigError
  raise ConfigError(f"mesh={sizes!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True)
class DistributedSpec(Spec):
  """The ``distributed`` section: ``jax.distributed.initialize`` of a multi-process job.

  Every process runs the same command; process 0 writes the run files. Unset fields are
  detected by JAX from the environment (TPU VM metadata, SLURM, Open MPI). See launch/.

  Attributes:
    initialize: call ``jax.distributed.initialize`` at start (a multi-process job).
    coordinator_address: "host:port" of process 0 ("" = detect).
    num_processes: >= 1 processes in the job (None = detect).
    process_id: this process's index in [0, num_processes) (None = detect).
    local_device_ids: comma-separated ids of this process's devices, such as "0,1" (""
      = JAX's choice).
  """

  SECTION: ClassVar[str] = "distributed"

  initialize: bool = field(False)
  coordinator_address: str = field("", allowed="('host:port', or '' to detect)")
  num_processes: int | None = field(None, ge=1)
  process_id: int | None = field(None, ge=0)
  local_device_ids: str = field("", allowed="(comma-separated ids such as '0,1', or '')")

  def check(self):
    """Raises ``ConfigError`` for an address not of the form host:port, a process id out of
    range or without the count, an explicit process id or count without an address, and
    device ids that are not comma-separated non-negative ints."""
    addr = self.coordinator_address
    if addr:
      host, _, port = addr.rpartition(":")
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        self.fail("coordinator_address", addr,
                  "must be 'host:port' (port 1..65535), or '' to let JAX detect it")
    n, pid = self.num_processes, self.process_id
    if pid is not None:
      if n is None:
        self.fail("process_id", pid, "needs distributed.num_processes as well")
      if pid >= n:
        self.fail("process_id", pid, f"must be < distributed.num_processes={n}")
    if self.initialize and (n is not None and n > 1 or pid is not None) and not addr:
      self.fail("coordinator_address", addr,
                "must be set when num_processes / process_id are given (JAX detects all "
                "three together or none)")
    text = self.local_device_ids.strip()
    if text and not all(x.strip().isdigit() for x in text.split(",")):
      self.fail("local_device_ids", text,
                "must be comma-separated device ids such as '0,1', or '' to detect them")

  def settings(self) -> dict | None:
    """The ``jax.distributed.initialize`` arguments, or None when ``initialize`` is False.

    Returns:
      {"coordinator_address": str | None, "num_processes": int | None,
       "process_id": int | None, "local_device_ids": tuple[int, ...] | None}; empty fields
      become None (JAX detects them), or None for a one-process job.
    """
    if not self.initialize:
      return None
    text = self.local_device_ids.strip()
    ids = tuple(int(x) for x in text.split(",")) if text else None
    return {"coordinator_address": self.coordinator_address or None,
            "num_processes": self.num_processes, "process_id": self.process_id,
            "local_device_ids": ids}
