"""Generator and learner sub-meshes of one job, and the weight reshard between them.

The actor–learner split of Arnal et al. (2026, §3: W inference workers and T trainers per
node) on JAX's own runtime: each process gives its last W local devices to the generator
mesh and the rest (T) to the learner mesh, so both meshes span every process and each is
an ordinary SPMD mesh. The learner trains on its FSDP/tensor layout; the generator holds
its own inference copy of the parameters, replicated over its ``data`` axis and optionally
split over ``tensor`` (``mesh.generator_tensor``), in the model's activation dtype — so its
compiled decode loop gathers no parameter (``param_collectives`` counts them).

Every program runs on one of the two meshes, issued by one thread each (the generator
thread, the learner's main loop). Decisions both meshes' processes must take together
(which weights, how many rollouts to insert, when to stop) are agreed with a tiny
collective on the deciding thread's own mesh (``agree_min``), never on all devices.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.models import lora as lora_lib
from jaxreplay.parallel import sharding as sharding_lib


def split_devices(devices: Sequence[jax.Device], generator_per_process: int
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
  """Each process's devices split into learner and generator devices.

  Args:
    devices: every device of the job (``jax.devices()``). generator_per_process: W >= 1,
      the devices of each process that generate (its W highest ids).

  Returns:
    (learner devices, generator devices), each ordered by process, then id.

  Raises:
    ValueError: a process with W or fewer devices (nothing left to learn on).
  """
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  learner, generator = [], []
  for p in sorted(by_process):
    local = sorted(by_process[p], key=lambda d: d.id)
    if len(local) <= generator_per_process:
      raise ValueError(f"mesh.generator_devices={generator_per_process} must be below the "
                       f"{len(local)} devices of process {p}: the learner needs at least one")
    cut = len(local) - generator_per_process
    learner += local[:cut]
    generator += local[cut:]
  return learner, generator


def make_meshes(sizes: tuple[int, int, int], generator_per_process: int, generator_tensor: int,
                devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
  """The learner mesh (``sizes`` = (data, fsdp, tensor) over the learner devices) and the
  generator mesh ((W_total / tensor, 1, tensor) over the generator devices).

  Args:
    sizes: resolved learner mesh sizes (``MeshSpec.shape`` of the learner device count).
    generator_per_process: W per process. generator_tensor: tensor-parallel size of the
      generator mesh (divides the generator devices of the job).
    devices: the job's devices (default ``jax.devices()``).

  Returns:
    (learner_mesh, generator_mesh), both with axes ("data", "fsdp", "tensor").

  Raises:
    ValueError: a device split or a size that does not fit (see ``split_devices``).
  """
  learner, generator = split_devices(jax.devices() if devices is None else devices,
                                     generator_per_process)
  if len(generator) % generator_tensor:
    raise ValueError(f"mesh.generator_tensor={generator_tensor} must divide the "
                     f"{len(generator)} generator devices")
  n = int(np.prod(sizes))
  learner_mesh = sharding_lib.make_mesh(*sizes, devices=learner[:n])
  gen_mesh = sharding_lib.make_mesh(len(generator) // generator_tensor, 1, generator_tensor,
                                    devices=generator)
  return learner_mesh, gen_mesh


def _cast(x, dtype):
  return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


def publish_bytes(params: Any, dtype, adapters_only: bool = False) -> int:
  """Bytes one publish moves: one copy of the moved leaves in the sync's dtypes.

  Args:
    params: the learner's parameter pytree (arrays or ``ShapeDtypeStruct``s, e.g. from
      ``jax.eval_shape``, so a 7B model needs no memory).
    dtype: the inference copy's floating dtype (integer leaves count in their own).
    adapters_only: count only the ``nnx.LoRAParam`` leaves (a LoRA publish after the
      first); without adapters in ``params`` every leaf counts.

  Returns:
    int, sum over the moved leaves of size × itemsize after the cast.
  """
  if adapters_only:
    params = lora_lib.split_adapters(params)[0]

  def size(x) -> int:
    moved = jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(x.dtype)
    return int(np.prod(x.shape)) * moved.itemsize

  return sum(size(x) for x in jax.tree.leaves(params))


def _stacked(path: str, sharding: NamedSharding, ndim: int) -> bool:
  """A scan-layout block parameter ([L, ...], ``blocks/attn/q/kernel``) whose layer axis
  the learner does not split: it moves one layer at a time."""
  parts = path.split("/")
  spec = tuple(sharding.spec)
  return (ndim >= 2 and len(parts) > 1 and parts[0] == "blocks" and not parts[1].isdigit()
          and (not spec or spec[0] is None))


@functools.lru_cache(maxsize=None)
def _gather_program(mesh: Mesh, dtype, layer: bool):
  """jit on ``mesh``: (x[, i]) -> x (or x[i]) cast to ``dtype``, replicated on every device
  of the mesh (an all-gather of that block only)."""
  out = NamedSharding(mesh, P())
  if layer:
    return jax.jit(lambda x, i: _cast(jax.lax.dynamic_index_in_dim(x, i, 0, False), dtype),
                   out_shardings=out)
  return jax.jit(lambda x: _cast(x, dtype), out_shardings=out)


# writes one layer into a generator device's [L, ...] buffer in place (the buffer donated)
_put_layer = jax.jit(lambda buf, block, i: jax.lax.dynamic_update_index_in_dim(buf, block, i, 0),
                     donate_argnums=0)


class _Move:
  """``move(params) -> generator params`` for one pytree, streamed block by block.

  A block is one leaf, or one layer of a scan-layout block parameter (``_stacked``). For
  each block in turn: a jit on the learner mesh casts it to ``dtype`` and gathers it to a
  replica on every learner device; then each process copies, device to device, the part
  each of its generator devices holds (``addressable_devices_indices_map``) from one of its
  local learner replicas, taking the replicas in turn so the copies spread over the learner
  devices; the call waits for those copies before the next block, so a learner device holds
  one block's replica at a time. Layers land in a per-device [L, ...] buffer in place
  (``_put_layer``); each leaf is then assembled as a global array
  (``jax.make_array_from_single_device_arrays``). No process reads another's memory.

  Attributes:
    peak_block_bytes: int, the largest block replica of the last call (bytes on one learner
      device): the publish's extra memory there, besides XLA's temporaries.
    sent_from: dict learner device id -> bytes copied from it in the last call.
  """

  def __init__(self, learner_shardings: Any, generator_shardings: Any, dtype):
    self._dtype = dtype
    self._layered = jax.tree_util.tree_map_with_path(
        lambda p, sh: sharding_lib.path_str(p), learner_shardings)
    self._learner, self._generator = learner_shardings, generator_shardings
    self.peak_block_bytes = 0
    self.sent_from: dict[int, int] = {}

  def __call__(self, params: Any) -> Any:
    self.peak_block_bytes, self.sent_from = 0, {}
    return jax.tree.map(self._leaf, params, self._learner, self._generator, self._layered)

  def _copies(self, replica: jax.Array, target: NamedSharding, shape, parts):
    """Copies each addressable generator device's part of ``replica`` (a block replicated
    on the learner devices) onto it; ``parts(device) -> index`` into the block."""
    local = replica.addressable_shards
    out = {}
    for k, d in enumerate(target.addressable_devices):
      src = local[k % len(local)]
      piece = src.data[parts(d)]
      out[d] = jax.device_put(piece, d)
      self.sent_from[src.device.id] = (self.sent_from.get(src.device.id, 0) +
                                       piece.size * piece.dtype.itemsize)
    self.peak_block_bytes = max(self.peak_block_bytes,
                                replica.size * replica.dtype.itemsize)
    return out

  def _leaf(self, x: jax.Array, learner: NamedSharding, target: NamedSharding, path: str):
    index = target.addressable_devices_indices_map(x.shape)
    if not _stacked(path, learner, x.ndim) or any(
        index[d][0] != slice(None) and index[d][0] != slice(0, x.shape[0])
        for d in target.addressable_devices):
      replica = _gather_program(learner.mesh, self._dtype, False)(x)
      blocks = self._copies(replica, target, x.shape, lambda d: index[d])
      jax.block_until_ready(list(blocks.values()))
      del replica
      return jax.make_array_from_single_device_arrays(
          x.shape, target, [blocks[d] for d in target.addressable_devices])
    gather = _gather_program(learner.mesh, self._dtype, True)
    bufs = None
    for i in range(x.shape[0]):
      replica = gather(x, np.int32(i))
      pieces = self._copies(replica, target, x.shape, lambda d: index[d][1:])
      if bufs is None:
        bufs = {d: jnp.zeros((x.shape[0],) + p.shape, p.dtype, device=d)
                for d, p in pieces.items()}
      bufs = {d: _put_layer(bufs[d], pieces[d], np.int32(i)) for d in bufs}
      jax.block_until_ready(list(bufs.values()))
      del replica, pieces
    return jax.make_array_from_single_device_arrays(
        x.shape, target, [bufs[d] for d in target.addressable_devices])


def publish_programs(params: Any, learner_shardings: Any, dtype) -> dict:
  """The streamed publish's gather programs (``_Move``), one per distinct block, for memory
  plans and compiled-program checks: nothing runs.

  Args:
    params: the learner's parameter pytree (arrays or ``ShapeDtypeStruct``s).
    learner_shardings: the same pytree's ``NamedSharding``s on the learner mesh.
    dtype: the inference copy's floating dtype.

  Returns:
    dict path of the first leaf with that block -> (jitted gather, abstract arguments):
    ``jitted.lower(*arguments).compile()`` is the program a publish runs for that block
    (a scan-layout leaf [L, ...] with a layer index, int32 scalar; another leaf whole).
  """
  out, seen = {}, set()

  def add(path, x, sh):
    name = sharding_lib.path_str(path)
    layer = _stacked(name, sh, len(x.shape))
    key = (tuple(x.shape), str(jnp.dtype(x.dtype)), sh, layer)
    if key in seen:
      return
    seen.add(key)
    args = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),)
    if layer:
      args += (jax.ShapeDtypeStruct((), jnp.int32),)
    out[name] = (_gather_program(sh.mesh, dtype, layer), args)

  jax.tree_util.tree_map_with_path(add, params, learner_shardings)
  return out


def _make_move(learner_shardings: Any, generator_shardings: Any, dtype) -> _Move:
  """The streamed ``move(params) -> generator params`` of one pytree (``_Move``)."""
  return _Move(learner_shardings, generator_shardings, dtype)


class WeightSync:
  """``sync(params) -> generator params`` (built by ``make_weight_sync``).

  Attributes:
    bytes_moved: int, the bytes the last call moved (``publish_bytes`` of what it moved);
      0 before the first call.
    peak_block_bytes: int, the largest block the last call replicated on a learner device
      (one leaf, or one layer of a scan-layout leaf, in ``dtype``): the publish's extra
      memory on a learner device, besides XLA's temporaries.
    sent_from: dict learner device id -> bytes the last call copied from that device.
    frozen: with LoRA, the generator's cached copy of the frozen base (``nnx.State`` on the
      generator mesh, in ``dtype``) after the first call, else None.
  """

  def __init__(self, move: "_Move", move_frozen: "_Move | None", dtype):
    """``move``: the whole pytree's move, or with LoRA the adapters'; ``move_frozen``: the
    frozen base's (LoRA) or None."""
    self._move, self._move_frozen, self._dtype = move, move_frozen, dtype
    self.bytes_moved = self.peak_block_bytes = 0
    self.sent_from: dict[int, int] = {}
    self.frozen = None

  def __call__(self, params):
    moves = [self._move]
    if self._move_frozen is None:
      self.bytes_moved = publish_bytes(params, self._dtype)
      out = self._move(params)
    else:
      adapters, frozen = lora_lib.split_adapters(params)
      moved = 0
      if self.frozen is None:  # the base never trains: one copy serves every later publish
        self.frozen = self._move_frozen(frozen)
        moved = publish_bytes(frozen, self._dtype)
        moves.append(self._move_frozen)
      self.bytes_moved = moved + publish_bytes(adapters, self._dtype)
      out = lora_lib.join_adapters(self._move(adapters), self.frozen)
    self.peak_block_bytes = max(m.peak_block_bytes for m in moves)
    self.sent_from = {}
    for m in moves:
      for k, v in m.sent_from.items():
        self.sent_from[k] = self.sent_from.get(k, 0) + v
    return out


def make_weight_sync(learner_shardings: Any, generator_shardings: Any, dtype) -> WeightSync:
  """Builds ``sync(params) -> generator params``: the learner's parameters, cast to
  ``dtype``, in the generator's layout on the generator mesh.

  Streamed block by block (``_Move``), both steps on JAX's runtime: a jit on the learner
  mesh casts one block (a leaf, or one layer of a scan-layout leaf) to ``dtype`` (before
  moving, so half the bytes move in bfloat16) and gathers it to a replica on each learner
  device; then each process copies, device to device, the parts its own generator devices
  hold (``addressable_devices_indices_map``) from its local replicas in turn and assembles
  the global array (``jax.make_array_from_single_device_arrays``). No process reads
  another's memory, which is why this works across processes where ``jax.device_put``
  between two device sets does not (multi-controller JAX refuses a cross-host reshard onto
  another device set). Extra memory on a learner device: one block's replica at a time
  (``WeightSync.peak_block_bytes``; at Qwen2.5-7B widths the largest is the embedding,
  152064 × 3584 in bfloat16, 1.09 GB, where a whole replica is 15.2 GB).

  With LoRA (``nnx.LoRAParam`` leaves in the shardings), the first call moves the whole
  policy as above and keeps the generator's copy of the frozen base (``WeightSync.frozen``);
  every later call moves only the adapters (A [.., in, r], B [.., r, out], cast to
  ``dtype``) and joins them with that copy, so a publish costs ``publish_bytes(params,
  dtype, adapters_only=True)`` (about 0.3% of the replica at rank 8 on Qwen2.5-7B) and its
  peak is one adapter replica per learner device. The generator runs the adapters
  unmerged (``LoRALinear``); the published versions it holds share the one frozen copy.

  Args:
    learner_shardings: pytree of ``NamedSharding`` of the parameters on the learner mesh.
    generator_shardings: the same pytree's shardings on the generator mesh
      (``sharding.param_shardings(abstract, generator_mesh)``).
    dtype: the inference copy's floating dtype (integers keep theirs).

  Returns:
    The ``WeightSync``; its result has ``generator_shardings`` and floating leaves in
    ``dtype``; ``bytes_moved`` says what the last call moved.
  """
  if not lora_lib.has_adapters(learner_shardings):
    return WeightSync(_make_move(learner_shardings, generator_shardings, dtype), None, dtype)
  (ad_l, frozen_l), (ad_g, frozen_g) = (lora_lib.split_adapters(learner_shardings),
                                        lora_lib.split_adapters(generator_shardings))
  return WeightSync(_make_move(ad_l, ad_g, dtype), _make_move(frozen_l, frozen_g, dtype), dtype)


@functools.lru_cache(maxsize=None)
def _min_program(mesh: Mesh):
  flat = Mesh(mesh.devices.reshape(-1), ("all",))
  return flat, jax.jit(lambda a: a.min(0), out_shardings=NamedSharding(flat, P()))


def agree_min(values: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
  """The element-wise minimum over processes of ``values``, agreed with a collective on
  ``mesh``'s devices only (so a thread that owns ``mesh`` may call it while another thread
  runs programs on a disjoint mesh). Every process of ``mesh`` must call it, in the same
  order relative to its other programs on ``mesh``.

  Args:
    values: ints (int32 range), the same count on every process. mesh: the deciding mesh.

  Returns:
    Tuple of ints, the same on every process (``values`` itself with one process).
  """
  vals = np.asarray(values, np.int32).reshape(1, -1)
  if jax.process_count() == 1:
    return tuple(int(v) for v in vals[0])
  flat, program = _min_program(mesh)
  n = flat.devices.size
  arr = jax.make_array_from_callback((n, vals.shape[1]), NamedSharding(flat, P("all")),
                                     lambda idx: vals)
  out = program(arr)
  return tuple(int(v) for v in np.asarray(out.addressable_shards[0].data))


_COLLECTIVE = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*?\b(all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute|all-to-all)(?:-start|-done)?\(")


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """The collectives of a compiled program: (op, result dims) for every all-gather,
  all-reduce, reduce-scatter, collective-permute and all-to-all (``-start`` forms
  included; a tuple-shaped result is skipped).

  Args:
    hlo_text: ``compiled.as_text()`` (optimized HLO).

  Returns:
    List of (op name, dims tuple).
  """
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      dims = tuple(int(d) for d in m.group(2).split(",") if d)
      out.append((m.group(3), dims))
  return out


def param_collectives(hlo_text: str, params: Any) -> int:
  """Collectives of a compiled program whose result has the shape of a parameter or of one
  layer of a stacked (scan-layout) parameter: the gathers that bring sharded weights
  together, which a generator holding its own inference layout must not run.

  Args:
    hlo_text: ``compiled.as_text()``. params: the parameter pytree (arrays or
      ``ShapeDtypeStruct``s) the program was compiled with.

  Returns:
    int, the count.
  """
  shapes = set()
  for x in jax.tree.leaves(params):
    shape = tuple(x.shape)
    shapes.add(shape)
    if len(shape) > 1:
      shapes.add(shape[1:])
  return sum(dims in shapes for _, dims in collectives(hlo_text))
