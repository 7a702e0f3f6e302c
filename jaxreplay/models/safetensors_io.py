"""Safetensors checkpoints through the Hugging Face ``safetensors`` library (NumPy arrays).

Reading opens each file once with ``safetensors.safe_open(path, framework="numpy")``,
which memory-maps it and validates the header. ``SafetensorsFile.get`` returns the
library's lazy slice object: indexing it copies only the bytes of the requested block,
so a parameter shard is filled without reading the whole tensor. Writing goes through
``safetensors.numpy.save_file``.

bfloat16 tensors are built by the library as ``numpy.dtype("bfloat16")``, a name NumPy
knows only once ``ml_dtypes`` (a JAX dependency) is imported; this module imports it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

# Format codes this module reads and writes -> NumPy dtype. The library knows more
# (float8, float4, complex) that NumPy or our models cannot use; those are rejected.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
  """One open ``.safetensors`` file (a ``safetensors.safe_open`` handle).

  The handle (and its memory map) is released by ``close``, on leaving a ``with``
  block, or when this object and every slice taken from it are garbage collected.

  Attributes:
    path: the file. metadata: the ``__metadata__`` string map ({} if absent).

  Raises:
    FileNotFoundError: ``path`` does not exist (on open).
    ValueError: the library rejects the file (malformed header, header longer than
      the file, data not covering the header's offsets), or a tensor has a dtype
      outside ``DTYPES``; the message names the file.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      self._f = safetensors.safe_open(path, framework="numpy")
      self.metadata = dict(self._f.metadata() or {})
      self._slices = {k: self._f.get_slice(k) for k in sorted(self._f.keys())}
      self._dtypes = {k: s.get_dtype() for k, s in self._slices.items()}
    except safetensors.SafetensorError as e:
      raise ValueError(f"{path}: not a readable safetensors file: {e}") from e
    for name, code in self._dtypes.items():
      if code not in DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {code}")

  def keys(self) -> list[str]:
    """Tensor names in the file (sorted)."""
    return list(self._slices)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor ``name`` (from the header; nothing is read).

    Raises:
      KeyError: no tensor ``name`` in the file.
    """
    return tuple(self._slices[name].get_shape())

  def dtype(self, name: str) -> np.dtype:
    """The NumPy dtype of tensor ``name`` (a value of ``DTYPES``).

    Raises:
      KeyError: no tensor ``name`` in the file.
    """
    return DTYPES[self._dtypes[name]]

  def get(self, name: str) -> Any:
    """A lazy view of tensor ``name``: ``view[index]`` reads only that block.

    The view is the library's ``PySafeSlice``. ``index`` is what NumPy basic indexing
    takes (ints, slices with positive step, ``...``; ``view[...]`` reads the whole
    tensor). The result is a new writeable ``np.ndarray`` of dtype ``self.dtype(name)``
    and the indexed shape; the view itself has no array methods. Unlike NumPy, slice
    bounds past a dimension are not clipped: indexing raises ``safetensors.SafetensorError``.

    Raises:
      KeyError: no tensor ``name`` in the file.
    """
    return self._slices[name]

  def close(self) -> None:
    """Releases the file handle; views taken by ``get`` are not to be read afterwards."""
    self._f.__exit__(None, None, None)

  def __enter__(self) -> SafetensorsFile:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
  """Tensor name -> open file, for a directory (single file or sharded index) or one file.

  Each file is opened once and shared by all its tensors; ``close_checkpoint`` releases them.

  Args:
    path: a ``.safetensors`` file, or a directory holding ``model.safetensors`` or
      ``model.safetensors.index.json`` (whose ``weight_map`` names the shard files).

  Returns:
    dict mapping every tensor name to the ``SafetensorsFile`` that holds it.

  Raises:
    FileNotFoundError: no safetensors checkpoint at ``path``, or a shard the index names.
    ValueError: the index names a tensor its shard lacks; see ``SafetensorsFile``.
  """
  if os.path.isfile(path):
    f = SafetensorsFile(path)
    return {k: f for k in f.keys()}
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    with open(index) as fh:
      weight_map = json.load(fh)["weight_map"]
    files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(weight_map.values()))}
    out = {}
    for name, fn in weight_map.items():
      if name not in files[fn]._slices:
        raise ValueError(f"{index}: weight_map puts {name!r} in {fn}, which lacks it")
      out[name] = files[fn]
    return out
  if os.path.exists(single):
    f = SafetensorsFile(single)
    return {k: f for k in f.keys()}
  raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def close_checkpoint(files: Mapping[str, SafetensorsFile]) -> None:
  """Closes every file of an ``open_checkpoint`` result."""
  for f in {id(f): f for f in files.values()}.values():
    f.close()


def write_file(path: str, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str] | None = None) -> int:
  """Writes ``tensors`` to one ``.safetensors`` file with ``safetensors.numpy.save_file``.

  Args:
    path: output file. tensors: name -> array of any shape, dtype one of ``DTYPES``
      (either byte order; any memory layout).
    metadata: string map stored as ``__metadata__`` (Hugging Face expects
      ``{"format": "pt"}``).

  Returns:
    Bytes of tensor data written (the sum of the arrays' ``nbytes``).

  Raises:
    ValueError: an array with a dtype outside ``DTYPES`` (nothing is written).
  """
  out = {}
  for name, a in tensors.items():
    a = np.asarray(a)
    if _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype) is None:
      raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
    # save_file serializes from each array's data pointer, so it needs C-contiguous
    # arrays (np.ascontiguousarray would turn a 0-d array into shape (1,)).
    out[name] = a if a.flags.c_contiguous else a.copy(order="C")
  safetensors.numpy.save_file(out, path, metadata=dict(metadata) if metadata else None)
  chmod_as_umask(path)
  return sum(a.nbytes for a in out.values())


def chmod_as_umask(path: str) -> int:
  """Gives ``path`` the mode a file made with ``open(path, "w")`` gets: 0o666 less the
  process's umask (0o644 under the usual 022).

  ``safetensors`` writes its file through a private temporary file, mode 0o600, so
  without this an exported model could be read by its owner alone (a shared cache, a
  serving user, a container running as another uid).

  Args:
    path: an existing file.

  Returns:
    The mode set (permission bits, an int).

  Raises:
    OSError: ``path`` is missing or its mode cannot be changed.
  """
  umask = os.umask(0)  # the only way to read it; restored on the next line
  os.umask(umask)
  mode = 0o666 & ~umask
  os.chmod(path, mode)
  return mode


def write_checkpoint(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                     max_shard_bytes: int | None = None) -> list[str]:
  """Writes ``model.safetensors``, or shards plus ``model.safetensors.index.json``.

  Args:
    directory: output directory (created).
    tensors: (name, array) pairs in the order to fill shards; arrays as for ``write_file``.
    max_shard_bytes: start a new shard once one would exceed this; None for one file.

  Returns:
    The written file names.

  Raises:
    ValueError: see ``write_file``.
  """
  os.makedirs(directory, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, a in tensors:
    if max_shard_bytes is not None and shards[-1] and size + a.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = a
    size += a.nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    write_file(os.path.join(directory, "model.safetensors"), shards[0], meta)
    return ["model.safetensors"]
  names, weight_map, total = [], {}, 0
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    total += write_file(os.path.join(directory, fn), shard, meta)
    weight_map.update({k: fn for k in shard})
    names.append(fn)
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names + ["model.safetensors.index.json"]
