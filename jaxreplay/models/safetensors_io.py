"""Reading and writing the safetensors format with NumPy memory maps (no framework needed).

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length N, N bytes of JSON mapping each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (byte offsets into the data section that follows) plus
an optional ``"__metadata__"`` string map, then the raw little-endian data.

Reading maps the file and returns zero-copy views, so slicing a tensor reads only the
pages of that slice: a parameter shard can be filled without loading the whole tensor.
bfloat16 uses ``ml_dtypes`` (a JAX dependency).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
  """A memory-mapped ``.safetensors`` file.

  Attributes:
    path: the file. header: tensor name -> {"dtype", "shape", "data_offsets"}.
    metadata: the ``__metadata__`` map ({} if absent).

  Raises:
    ValueError: a malformed header or an unsupported dtype (on open).
  """

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      if n > os.path.getsize(path):
        raise ValueError(f"{path}: header length {n} exceeds the file size; not a safetensors file")
      header = json.loads(f.read(n))
    self.metadata = header.pop("__metadata__", {}) or {}
    self.header = header
    for name, h in header.items():
      if h["dtype"] not in DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {h['dtype']}")
    self._start = 8 + n
    self._mm = np.memmap(path, dtype=np.uint8, mode="r") if header else None

  def keys(self) -> list[str]:
    """Tensor names in the file."""
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of tensor ``name``."""
    return tuple(self.header[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    """The NumPy dtype of tensor ``name``."""
    return DTYPES[self.header[name]["dtype"]]

  def get(self, name: str) -> np.ndarray:
    """A read-only zero-copy view of tensor ``name`` (pages are read when touched)."""
    h = self.header[name]
    b, e = h["data_offsets"]
    buf = self._mm[self._start + b:self._start + e]
    return buf.view(DTYPES[h["dtype"]]).reshape(h["shape"])


def open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
  """Tensor name -> open file, for a directory (single file or sharded index) or one file.

  Args:
    path: a ``.safetensors`` file, or a directory holding ``model.safetensors`` or
      ``model.safetensors.index.json`` (whose ``weight_map`` names the shard files).

  Returns:
    dict mapping every tensor name to the ``SafetensorsFile`` that holds it.

  Raises:
    FileNotFoundError: no safetensors checkpoint at ``path``.
    ValueError: the index names a tensor its shard lacks.
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
      if name not in files[fn].header:
        raise ValueError(f"{index}: weight_map puts {name!r} in {fn}, which lacks it")
      out[name] = files[fn]
    return out
  if os.path.exists(single):
    f = SafetensorsFile(single)
    return {k: f for k in f.keys()}
  raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def write_file(path: str, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str] | None = None) -> int:
  """Writes ``tensors`` to one ``.safetensors`` file (header padded to 8 bytes).

  Args:
    path: output file. tensors: name -> array (dtypes of ``DTYPES``).
    metadata: string map stored as ``__metadata__`` (Hugging Face expects
      ``{"format": "pt"}``).

  Returns:
    Bytes of tensor data written.

  Raises:
    ValueError: an array with an unsupported dtype.
  """
  header, offset, arrays = {}, 0, []
  for name, a in tensors.items():
    a = np.ascontiguousarray(a)
    code = _CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if code is None:
      raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
    header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    arrays.append(a)
  if metadata:
    header = {"__metadata__": dict(metadata), **header}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
  return offset


def write_checkpoint(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                     max_shard_bytes: int | None = None) -> list[str]:
  """Writes ``model.safetensors``, or shards plus ``model.safetensors.index.json``.

  Args:
    directory: output directory (created).
    tensors: (name, array) pairs in the order to write.
    max_shard_bytes: start a new shard once one would exceed this; None for one file.

  Returns:
    The written file names.
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
