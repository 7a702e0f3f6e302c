"""Paths a user gives — local, or on cloud storage through ``etils.epath`` (``gs://``, ``s3://``).

Run directories and checkpoints are written through ``etils.epath`` and Orbax directly. The
inputs read by libraries that need local files — a Hugging Face checkpoint directory
(``safetensors.safe_open`` maps files), a GGUF file, task data files (grain's readers) — are
copied once into a local cache (``local_copy``), so every worker of a TPU pod can start from
one ``gs://`` copy instead of its own 15 GB.
"""

from __future__ import annotations

import fnmatch
import glob as glob_lib
import hashlib
import os
import shutil

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a URL other than ``file://`` (``gs://bucket/x``, ``s3://...``)."""
  text = str(path)
  return "://" in text and not text.startswith("file://")


def exists(path: str | os.PathLike) -> bool:
  """Whether a local path or URL exists (``etils.epath``)."""
  return epath.Path(path).exists() if is_remote(path) else os.path.exists(path)


def glob(pattern: str) -> list[str]:
  """Sorted paths matching ``pattern`` (``*``, ``?``, ``[...]``), local or a URL.

  Args:
    pattern: e.g. ``data/train-*.parquet`` or ``gs://bucket/data/train-*.parquet``; a
      pattern without wildcards names one path (returned when it exists).

  Returns:
    list of str paths (URLs stay URLs), sorted; empty when nothing matches.
  """
  if not glob_lib.has_magic(pattern):
    return [pattern] if exists(pattern) else []
  if not is_remote(pattern):
    return sorted(glob_lib.glob(pattern))
  scheme, _, rest = pattern.partition("://")
  parts = rest.split("/")
  first = next(i for i, p in enumerate(parts) if glob_lib.has_magic(p))
  # Walk the pattern one component at a time, naming children by their parent's URL and
  # their own name (backends differ in how they spell the URLs they list).
  found = [f"{scheme}://" + "/".join(parts[:first])]
  for part in parts[first:]:
    matches = []
    for parent in found:
      p = epath.Path(parent)
      if glob_lib.has_magic(part):
        if p.is_dir():
          matches += [f"{parent}/{c.name}" for c in p.iterdir()
                      if fnmatch.fnmatchcase(c.name, part)]
      elif epath.Path(f"{parent}/{part}").exists():
        matches.append(f"{parent}/{part}")
    found = matches
  return sorted(found)


def absolute(path: str) -> str:
  """A URL as it is; a local path made absolute."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def read_text(path: str | os.PathLike) -> str:
  """The text of a local file or a URL (``etils.epath``).

  Raises:
    FileNotFoundError: no such file.
  """
  return epath.Path(path).read_text()


def write_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes ``text`` to ``path`` so that a crash leaves the old file or the new one, whole.

  Local files: writes ``path.tmp-PID``, fsyncs it, then ``os.replace``s it over ``path``.
  Object stores (``gs://`` and other ``epath`` URLs) replace an object in one request,
  which is already all or nothing, so the text is written directly.
  """
  if is_remote(path):
    epath.Path(path).write_text(text)
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, str(path))


def upload(local: str, url: str) -> None:
  """Copies the local file ``local`` to ``url`` (one object write; parents created).

  Args:
    local: an existing local file. url: a URL or a local path.
  """
  dest = epath.Path(url)
  dest.parent.mkdir(parents=True, exist_ok=True)
  with open(local, "rb") as f:
    dest.write_bytes(f.read())


def local_side(path: str) -> str:
  """A local path for files that must stay local (logs appended to, caches) next to
  ``path``: ``path`` itself when local, else ``cache_root()/mirror/<scheme>/<rest>``."""
  if not is_remote(path):
    return path
  scheme, _, rest = str(path).partition("://")
  return os.path.join(cache_root(), "mirror", scheme, rest)


def cache_root() -> str:
  """Where ``local_copy`` keeps its copies: ``$JAXREPLAY_CACHE`` or ``~/.cache/jaxreplay``."""
  return os.environ.get("JAXREPLAY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "jaxreplay")


def local_copy(path: str, cache_dir: str | None = None) -> str:
  """A local path holding the file or directory ``path`` names; remote ones are copied once.

  A local path is returned as is. A URL is copied (a directory recursively) into
  ``cache_dir/remote/<hash of the URL>/<name>``; a ``.complete`` marker written last makes
  a copy interrupted midway be made again, and a complete one is reused without reading
  the remote again.

  Args:
    path: a local path or a URL. cache_dir: the cache root (default ``cache_root()``).

  Returns:
    A local path (str) of the same file or directory.

  Raises:
    FileNotFoundError: the URL names nothing.
  """
  if not is_remote(path):
    return path
  src = epath.Path(path)
  if not src.exists():
    raise FileNotFoundError(f"{path!r}: no such file or directory")
  key = hashlib.sha256(str(path).encode()).hexdigest()[:16]
  base = os.path.join(cache_dir or cache_root(), "remote", key)
  dest = os.path.join(base, src.name or "root")
  marker = os.path.join(base, ".complete")
  if os.path.exists(marker):
    return dest
  shutil.rmtree(base, ignore_errors=True)
  os.makedirs(base, exist_ok=True)
  _copy(src, dest)
  with open(marker, "w") as f:
    f.write(str(path))
  return dest


def _copy(src: epath.Path, dest: str) -> None:
  if src.is_dir():
    os.makedirs(dest, exist_ok=True)
    for child in src.iterdir():
      _copy(child, os.path.join(dest, child.name))
    return
  with src.open("rb") as fin, open(dest, "wb") as fout:
    shutil.copyfileobj(fin, fout, length=16 << 20)
