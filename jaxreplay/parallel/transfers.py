"""Where a thread's implicit host-to-device transfers land: a placement audit.

An eager op (``jnp.asarray(host)``, ``jax.random.fold_in(key, i)`` on a host key, any jnp
call on numpy inputs) places its uncommitted inputs on the thread's default device. In the
actor–learner split that must be a generator device: on the learner's device 0 the op
would queue behind the learner step running there (``train.split.Generator`` sets its
thread's default device). ``implicit_transfers`` counts, per destination device, the
implicit transfers a block of code makes, read from JAX's transfer guard log
(``jax.transfer_guard_host_to_device('log')``, thread-local): explicit ``jax.device_put``
calls are not logged, and neither are other threads' transfers.

JAX logs every implicit transfer, but writes its shape and destination only the first time
the process makes a transfer of that shape, dtype and destination (any thread's); a repeat
is logged bare (measured on jax 0.10.2: the same ``jnp.asarray`` four times gives one full
line and three bare ones). Repeats are counted in ``Transfers.repeated``, their destination
unknown: a count of 0 onto a device is exact only with ``repeated`` 0, and otherwise says
that no transfer went there that the process had not made before.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import tempfile

import jax

_LINE = re.compile(r"host-to-device transfer: .*?dst_sharding=(\w+)\((.*)\)")
_BARE = re.compile(r"host-to-device transfer:[ \t]*$", re.M)
_DEVICE_ID = re.compile(r"\bid=(\d+)")


class Transfers:
  """The implicit host-to-device transfers of a block (``implicit_transfers``).

  Attributes:
    single: collections.Counter device id -> transfers onto that one device (a
      ``SingleDeviceSharding``: the default device, or a committed input's device).
    sharded: int, transfers onto a multi-device sharding (a jitted function's
      ``in_shardings``; the log names its mesh's shape, not its devices).
    repeated: int, transfers logged without shape or destination (a repeat of one the
      process made before; module docstring).
  """

  def __init__(self):
    self.single: collections.Counter = collections.Counter()
    self.sharded = 0
    self.repeated = 0

  @property
  def total(self) -> int:
    """Every implicit transfer the block made."""
    return sum(self.single.values()) + self.sharded + self.repeated

  def onto(self, device_ids) -> int:
    """Transfers onto one of ``device_ids`` (ints) as a single device."""
    ids = set(int(i) for i in device_ids)
    return sum(n for i, n in self.single.items() if i in ids)

  def parse(self, text: str) -> None:
    """Adds the transfers logged in ``text`` (the guard's lines; others are ignored)."""
    for kind, body in _LINE.findall(text):
      if kind == "SingleDeviceSharding":
        for i in _DEVICE_ID.findall(body)[:1]:
          self.single[int(i)] += 1
      else:
        self.sharded += 1
    self.repeated += len(_BARE.findall(text))


@contextlib.contextmanager
def implicit_transfers():
  """Counts the current thread's implicit host-to-device transfers inside the block.

  The guard logs through the C++ runtime to file descriptor 2, so the block's stderr (every
  thread's, at the file-descriptor level) is captured; lines that are not the guard's are
  written back to stderr when the block ends.

  Yields:
    a ``Transfers``, filled when the block exits.

  Raises:
    whatever the block raises (the counts are still filled).
  """
  out = Transfers()
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      with jax.transfer_guard_host_to_device("log"):
        yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      text = tmp.read().decode("utf-8", "replace")
      out.parse(text)
      rest = "".join(line for line in text.splitlines(keepends=True)
                     if "host-to-device transfer" not in line)
      if rest:
        sys.stderr.write(rest)
