"""Meshes and partition rules: how parameters and batches are laid out on devices.

One ``jax.sharding.Mesh`` with the named axes ``("data", "fsdp", "tensor")`` (Auto axis
types, so ordinary jnp code runs unannotated). Batches shard their leading axis over
``("data", "fsdp")``; parameters follow ``PARAM_RULES``, an ordered list of
(regex over the ``/``-joined parameter path, PartitionSpec) pairs in the
MaxText/tunix style: the first matching rule wins, and any mesh axis whose size does
not divide the dimension it would shard is dropped (that dimension is replicated), so
tiny test models still run on 8 devices. A block parameter of the scan layout
(``blocks/attn/q/kernel`` [L, ...], no layer index in the path) gets its rule's spec
behind a replicated layer axis.

Inside the learner's jits (which set the mesh as the context mesh, ``jax.set_mesh``) the
model runs as FSDP: ``gather_params`` gathers one layer's weights at a time inside the
layer scan, ``constrain_batch`` keeps activations split over the batch, and the output head
is vocabulary-parallel (``constrain_vocab``, ``constrain_whole``), so no activation wider
than one log-prob chunk's hidden states is summed over devices. Without a context mesh
these are identities.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.parallel import multihost

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Parameter path (see ``jaxreplay.models.transformer.Transformer``) -> PartitionSpec.
# Kernels are [in, out]: column-parallel layers shard ``out`` over tensor, row-parallel
# layers shard ``in`` over tensor; the other dimension shards over fsdp.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"embed/embedding$", P("tensor", "fsdp")),             # [V, D]
    (r"attn/(q|k|v)/kernel$", P("fsdp", "tensor")),         # [D, H*E]
    (r"attn/(q|k|v)/bias$", P("tensor")),                   # [H*E]
    (r"attn/o/kernel$", P("tensor", "fsdp")),               # [H*E, D]
    (r"mlp/(gate|up)/kernel$", P("fsdp", "tensor")),        # [D, F]
    (r"mlp/(gate|up)/bias$", P("tensor")),                  # [F]
    (r"mlp/down/kernel$", P("tensor", "fsdp")),             # [F, D]
    # vocabulary-parallel head: logits come out split over V, so none is all-reduced
    (r"lm_head/kernel$", P(None, ("fsdp", "tensor"))),      # [D, V]
    (r".*", P()),                                           # norms, remaining biases
)


def mesh_devices(sizes: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
  """``devices`` arranged as a (data, fsdp, tensor) array that follows the interconnect.

  ``jax.experimental.mesh_utils`` orders them, the later axes (tensor, then fsdp: the
  most communication) on the nearest devices: ``create_device_mesh`` maps the axes onto
  a TPU slice's physical torus (first without splitting a physical axis, then with), and
  sorts GPUs by id; on CPU it keeps the given order. Devices of several TPU slices
  (``slice_index``) go through ``create_hybrid_device_mesh`` with the slices on ``data``
  (over DCN), when their count divides it. Where the topology cannot be mapped (a subset
  of a slice that is not a cuboid, slices that do not divide ``data``), the devices keep
  their given order, with a warning.

  Args:
    sizes: (data, fsdp, tensor), positive ints whose product is ``len(devices)``.
    devices: ``jax.Device`` objects (or objects with their ``platform``, ``device_kind``,
      ``id``, and on TPU ``coords``, ``core_on_chip``, ``slice_index`` attributes).

  Returns:
    numpy object array of shape ``sizes`` holding each device once.

  Raises:
    ValueError: the product of ``sizes`` is not ``len(devices)``.
  """
  sizes, devs = tuple(int(s) for s in sizes), list(devices)
  if int(np.prod(sizes)) != len(devs):
    raise ValueError(f"mesh sizes (data, fsdp, tensor)={sizes} need {int(np.prod(sizes))} "
                     f"devices, have {len(devs)}")
  slices = sorted({getattr(d, "slice_index", 0) for d in devs})
  failures = []
  if len(slices) > 1:
    n = len(slices)
    if sizes[0] % n == 0:
      try:
        return mesh_utils.create_hybrid_device_mesh(
            (sizes[0] // n,) + sizes[1:], (n, 1, 1), devs, allow_split_physical_axes=True)
      except (ValueError, AssertionError, NotImplementedError) as e:
        failures.append(str(e))
    else:
      failures.append(f"{n} slices do not divide mesh.data={sizes[0]}")
  else:
    for split in (False, True):
      try:
        return mesh_utils.create_device_mesh(sizes, devs, allow_split_physical_axes=split)
      except (ValueError, AssertionError, NotImplementedError) as e:
        failures.append(str(e))
  logging.warning("mesh %s over %d %s devices: no topology-aware order (%s); using the "
                  "given device order", sizes, len(devs), devs[0].platform,
                  "; ".join(failures)[:300])
  return np.asarray(devs, dtype=object).reshape(sizes)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``("data", "fsdp", "tensor")`` mesh with Auto axis types, its devices in a
  topology-aware order (``mesh_devices``).

  Args:
    data, fsdp, tensor: axis sizes; one of them may be -1 (the rest of the devices).
    devices: devices to use (default ``jax.devices()``); all of them are used (pass
      ``jax.devices()[:n]`` for a mesh over a prefix).

  Returns:
    ``jax.sharding.Mesh`` of shape (data, fsdp, tensor).

  Raises:
    ValueError: sizes that do not multiply to the device count, or more than one -1.
  """
  devs = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh sizes (data, fsdp, tensor)={tuple(sizes)}: at most one may be -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if known == 0 or len(devs) % known:
      raise ValueError(f"mesh sizes {tuple(sizes)} do not divide {len(devs)} devices")
    sizes[sizes.index(-1)] = len(devs) // known
  return Mesh(mesh_devices(sizes, devs), MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * 3)


def path_str(path: Sequence[Any]) -> str:
  """A pytree key path as ``a/b/0/c`` (``.value`` attribute keys of NNX variables dropped)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        parts.append(k.name)
    else:
      parts.append(str(k))
  return "/".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
  """``spec`` with every mesh axis that does not divide its dimension removed.

  Args:
    spec: PartitionSpec (entries None, an axis name, or a tuple of names).
    shape: the array shape.
    mesh: the mesh whose axis sizes are checked.

  Returns:
    A PartitionSpec of length ``len(shape)`` valid for ``shape`` on ``mesh``.
  """
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    kept, prod = [], 1
    for n in names:
      if mesh.shape[n] > 1 and dim % (prod * mesh.shape[n]) == 0:
        kept.append(n)
        prod *= mesh.shape[n]
    out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
  return P(*out)


# A block parameter stacked over layers (``TransformerConfig.scan_layers``).
_STACKED_BLOCK = re.compile(r"(^|/)blocks/(?!\d+(/|$))")


def spec_for(path: str, shape: Sequence[int], mesh: Mesh,
             rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
  """The PartitionSpec of the parameter at ``path`` (first matching rule, fitted to shape).

  A stacked block parameter (``blocks/<name>`` without a layer index, [L, ...], also
  inside a larger tree such as ``opt_state/.../mu/blocks/<name>``) takes its rule's spec
  for the per-layer shape behind an unsharded leading layer axis.
  """
  stacked = bool(_STACKED_BLOCK.search(path))
  for pattern, spec in rules:
    if re.search(pattern, path):
      if stacked:
        return P(None, *fit_spec(spec, shape[1:], mesh))
      return fit_spec(spec, shape, mesh)
  return P()


def param_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """NamedShardings for every array leaf of ``tree`` (arrays or ShapeDtypeStructs) by ``rules``.

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``tree``.
  """
  return jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, spec_for(path_str(p), x.shape, mesh, rules)), tree)


def shard_params(params: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """``params`` placed on ``mesh`` by ``rules`` (``jax.device_put``; a no-op where already so)."""
  return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int | None = None) -> NamedSharding:
  """Sharding for an array whose leading axis is the batch: over ``data`` × ``fsdp``.

  Axes that do not divide ``batch_size`` (when given) are dropped, so odd batches replicate.
  """
  spec = P(BATCH_AXES, *([None] * (ndim - 1)))
  if batch_size is not None:
    spec = fit_spec(spec, (batch_size,) + (1,) * (ndim - 1), mesh)
  return NamedSharding(mesh, spec)


def shard_batch(tree: Any, mesh: Mesh) -> Any:
  """Every array of ``tree`` placed with its leading axis split over ``data`` × ``fsdp``."""
  return jax.tree.map(
      lambda x: jax.device_put(x, batch_sharding(mesh, np.ndim(x), np.shape(x)[0])), tree)


def make_sharded_array(shape: Sequence[int], dtype: Any, sharding: NamedSharding,
                       read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """A global array built shard by shard: ``read(index)`` returns only that device's block.

  No device, and no host buffer, ever holds more than one shard of the array, so
  checkpoints larger than one device load directly into their sharded layout.
  """
  return jax.make_array_from_callback(
      tuple(shape), sharding, lambda idx: np.asarray(read(idx), dtype=dtype))


def batch_shards(mesh: Mesh | None) -> int:
  """Devices a batch axis splits over.

  Args:
    mesh: a mesh with ``data`` and ``fsdp`` axes, or None.

  Returns:
    int: the product of the ``data`` and ``fsdp`` sizes (1 without a mesh).
  """
  return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def place_rows(tree: Any, mesh: Mesh | None) -> Any:
  """Host arrays [..., R, T] placed with their row axis R split over ``data`` × ``fsdp``.

  For packing plans (``jaxreplay.rl.packing.PackPlan``, R a multiple of ``batch_shards``):
  a pass's packed rows then split over the devices as its batch does, so each device runs
  the forward of its own rows. Each process passes only its devices' blocks
  (``multihost.to_global``); without a mesh the tree is returned unchanged.

  Args:
    tree: pytree of host arrays of rank >= 2 (any dtype), the same on every process.
    mesh: the mesh, or None.

  Returns:
    The tree of global ``jax.Array`` (R split over data × fsdp where they divide it).
  """
  if mesh is None:
    return tree
  def place(x):
    spec = fit_spec(P(*([None] * (np.ndim(x) - 2)), BATCH_AXES, None), np.shape(x), mesh)
    return multihost.to_global(np.asarray(x), NamedSharding(mesh, spec))

  return jax.tree.map(place, tree)


# Activation and gathered-parameter layouts inside traced model code. They apply under a
# context mesh (``jax.set_mesh``, which the learner step sets) and are no-ops without one,
# so the same model code runs unsharded on one device and as FSDP on a mesh.


def context_mesh():
  """The enclosing ``jax.set_mesh``'s abstract mesh when it has the batch axes, else None
  (also inside ``jax.shard_map`` over all its axes: per-device code takes no layout)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names) or mesh.are_all_axes_manual:
    return None
  return mesh


def constrain_batch(x: jax.Array) -> jax.Array:
  """``x`` [B, ...] laid out with B split over ``data`` × ``fsdp``, the rest unsplit.

  An explicit activation layout: with every activation batch-split, a matmul against a
  weight split over ``fsdp`` can only gather the weight (FSDP), not all-reduce partial
  activations. Identity without a context mesh (``context_mesh``); axes that do not
  divide B are dropped (``fit_spec``).
  """
  mesh = context_mesh()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, fit_spec(P(BATCH_AXES), x.shape, mesh))


def _without_batch_axes(spec: P) -> P:
  def keep(entry):
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    kept = tuple(n for n in names if n not in BATCH_AXES)
    return None if not kept else (kept[0] if len(kept) == 1 else kept)
  return P(*(keep(e) for e in spec))


def gather_params(tree: Any, prefix: str = "",
                  rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """Parameters of ``tree`` laid out whole over ``data`` × ``fsdp`` (an all-gather of
  each FSDP shard), keeping their ``tensor`` split; identity without a context mesh.

  Call it where the weights are used (inside the layer scan: one layer at a time), so
  only one layer's gathered weights are live; their gradients then reduce-scatter back
  to the parameters' layout.

  Args:
    tree: pytree of arrays (e.g. one block's ``nnx.State`` inside the scan).
    prefix: path prefix for ``rules`` (e.g. ``"embed"``), joined with ``/``.
    rules: partition rules (``PARAM_RULES``).

  Returns:
    The tree, each leaf under a sharding constraint.
  """
  mesh = context_mesh()
  if mesh is None:
    return tree

  def one(path, x):
    name = "/".join(p for p in (prefix, path_str(path)) if p)
    spec = _without_batch_axes(spec_for(name, x.shape, mesh, rules))
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree_util.tree_map_with_path(one, tree)


def constrain_whole(x: jax.Array) -> jax.Array:
  """``x`` laid out whole on every device (an all-gather of a split array); identity
  without a context mesh."""
  mesh = context_mesh()
  return x if mesh is None else jax.lax.with_sharding_constraint(x, P())


def constrain_vocab(x: jax.Array, axis: int) -> jax.Array:
  """``x`` with dimension ``axis`` (the vocabulary) split over every mesh axis, the
  others whole: the vocabulary-parallel output head, whose logits and weight gradient
  stay local to each device's slice of V. Identity without a context mesh; axes that do
  not divide V are dropped (``fit_spec``)."""
  mesh = context_mesh()
  if mesh is None:
    return x
  spec = [None] * x.ndim
  spec[axis] = MESH_AXES
  return jax.lax.with_sharding_constraint(x, fit_spec(P(*spec), x.shape, mesh))
