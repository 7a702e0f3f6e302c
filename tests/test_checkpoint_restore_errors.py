"""Restore tells a corrupt checkpoint from a failing machine or store: only a verified
corrupt one is set aside; out of memory, I/O, permission and missing-storage errors stop
the run with a clear message and move nothing."""

import errno
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.train import checkpoint as ckpt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A directory with checkpoints at steps 1 and 2 (w = 1.0, 2.0), written once."""
  d = tmp_path_factory.mktemp("saved") / "ckpt"
  mgr = ckpt.make_manager(str(d), 3)
  for step in (1, 2):
    ckpt.save(mgr, step, {"w": jnp.full((64,), float(step))}, {"step": step})
  mgr.wait_until_finished()
  return d


def _copy(saved, dest):
  """A fresh copy of the saved checkpoints at ``dest`` and a manager on it."""
  shutil.copytree(saved, dest)
  return ckpt.make_manager(str(dest), 3)


def _entries(tmp_path):
  return sorted(os.listdir(tmp_path))


class _XlaLikeError(RuntimeError):
  """What XLA raises when a device allocation fails (jaxlib's XlaRuntimeError is a
  RuntimeError whose message starts with the status code)."""


ENVIRONMENT_ERRORS = {
    "oom_xla": lambda: _XlaLikeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                     "allocate 4294967296 bytes."),
    "memory_error": lambda: MemoryError(),
    "permission": lambda: PermissionError(errno.EACCES, "Permission denied", "/ckpt/2/state"),
    "io_error": lambda: OSError(errno.EIO, "Input/output error"),
    # TensorStore wraps storage failures in ValueError with the status in the message.
    "gcs_unavailable": lambda: ValueError("UNAVAILABLE: Error reading gs://b/ckpt/2/state: "
                                          "connection reset"),
    # the cause chain counts: a wrapper around a storage timeout
    "wrapped_timeout": lambda: _wrapped(TimeoutError("read timed out")),
}


def _wrapped(inner):
  try:
    raise inner
  except Exception as e:  # noqa: BLE001
    try:
      raise ValueError("restore failed") from e
    except ValueError as outer:
      return outer


def test_environment_error_stops_and_moves_nothing(saved, tmp_path, monkeypatch):
  mgr = _copy(saved, tmp_path / "c")
  tmp_path = tmp_path / "c"
  before = _entries(tmp_path)
  assert before == ["1", "2"]
  for kind, make in sorted(ENVIRONMENT_ERRORS.items()):
    def failing_restore(step, args=None, make=make):
      raise make()

    monkeypatch.setattr(mgr, "restore", failing_restore)
    logs = []
    with pytest.raises(ckpt.CheckpointReadError, match="step 2.*nothing was moved") as info:
      ckpt.restore(mgr, {"w": jnp.zeros((64,))}, log=logs.append)
    assert ckpt.environment_cause(info.value.__cause__) is not None, kind
    assert _entries(tmp_path) == before and mgr.all_steps() == [1, 2] and not logs, kind
  # nothing was lost: once the cause is gone the newest checkpoint reads
  monkeypatch.undo()
  state, meta = ckpt.restore(ckpt.make_manager(str(tmp_path), 3), {"w": jnp.zeros((64,))})
  assert meta == {"step": 2}
  np.testing.assert_array_equal(state["w"], np.full((64,), 2.0))


def test_missing_storage_is_not_corruption(saved, tmp_path):
  """The whole directory vanishing (an unmounted disk, a deleted bucket) after the
  manager listed its steps: the storage check sees it, nothing is renamed."""
  mgr = _copy(saved, tmp_path / "ckpt")
  os.rename(tmp_path / "ckpt", tmp_path / "elsewhere")
  with pytest.raises(ckpt.CheckpointReadError, match="does not exist"):
    ckpt.restore(mgr, {"w": jnp.zeros((64,))})
  assert _entries(tmp_path / "elsewhere") == ["1", "2"]


def test_unreadable_file_in_an_intact_store_is_not_corruption(saved, tmp_path, monkeypatch):
  """A restore error that names no cause, while opening one of the checkpoint's files
  fails with EIO: the storage check reports it and nothing moves."""
  mgr = _copy(saved, tmp_path / "c")
  tmp_path = tmp_path / "c"
  monkeypatch.setattr(mgr, "restore", lambda step, args=None: (_ for _ in ()).throw(
      ValueError("could not decode chunk")))
  path_cls = type(ckpt.epath.Path(str(tmp_path)))  # the concrete local path class
  real_open = path_cls.open

  def flaky_open(self, mode="r", *a, **k):
    if "/2/" in str(self) and "b" in mode:
      raise OSError(errno.EIO, "Input/output error", str(self))
    return real_open(self, mode, *a, **k)

  monkeypatch.setattr(path_cls, "open", flaky_open)
  with pytest.raises(ckpt.CheckpointReadError, match="OSError"):
    ckpt.restore(mgr, {"w": jnp.zeros((64,))})
  assert _entries(tmp_path) == ["1", "2"]


def test_corrupt_checkpoint_is_set_aside(saved, tmp_path):
  """The same restore path on real damage (truncated array files, storage intact): step 2
  is verified corrupt, moved aside, and step 1 is restored."""
  _copy(saved, tmp_path / "c")
  tmp_path = tmp_path / "c"
  for root, _, files in os.walk(tmp_path / "2" / "state"):
    for f in files:
      path = os.path.join(root, f)
      with open(path, "r+b") as fh:
        fh.truncate(max(os.path.getsize(path) // 3, 1))
  logs = []
  state, meta = ckpt.restore(ckpt.make_manager(str(tmp_path), 3), {"w": jnp.zeros((64,))},
                             log=logs.append)
  assert meta == {"step": 1} and float(state["w"][0]) == 1.0
  assert any("corrupt" in m and "step 2" in m for m in logs)
  assert [e for e in _entries(tmp_path) if e.startswith("2.unreadable-")]


def test_read_meta_raises_on_environment_error(saved, tmp_path, monkeypatch):
  mgr = _copy(saved, tmp_path / "c")
  tmp_path = tmp_path / "c"
  monkeypatch.setattr(mgr, "restore", lambda step, args=None: (_ for _ in ()).throw(
      PermissionError(errno.EACCES, "Permission denied")))
  with pytest.raises(ckpt.CheckpointReadError, match="PermissionError"):
    ckpt.read_meta(mgr)
  assert _entries(tmp_path) == ["1", "2"]


def test_environment_cause_classification():
  assert ckpt.environment_cause(ValueError("DATA_LOSS: truncated chunk")) is None
  assert ckpt.environment_cause(FileNotFoundError(errno.ENOENT, "no such file")) is None
  assert ckpt.environment_cause(OSError(errno.ENOSPC, "No space left")) == "OSError ENOSPC"
  assert ckpt.environment_cause(MemoryError()) == "out of memory"
  assert ckpt.environment_cause(RuntimeError("PERMISSION_DENIED: 403")) == "PERMISSION_DENIED"


def test_a_field_the_checkpoints_config_lacks_resumes_only_at_the_value_it_behaved_as():
  from jaxreplay.train.checkpoint import config_changes
  saved = {"rollout": {"per_step": 128}, "eval": {"every": 25}, "train": {"steps": 10}}
  current = {"rollout": {"per_step": 128, "behaviour_logprobs": "sampler"},
             "eval": {"every": 50, "batch_rows": 1024}, "train": {"steps": 20}}
  assert config_changes(saved, current) == []  # eval.every and train.steps are resumable
  current["rollout"]["behaviour_logprobs"] = "learner"
  current["eval"]["batch_rows"] = 256
  assert config_changes(saved, current) == ["eval.batch_rows: None -> 256",
                                            "rollout.behaviour_logprobs: None -> 'learner'"]
  # model.scan_layers / model.remat were optional keys (absent = off) before the model spec
  saved = {"model": {"d_model": 128}}
  assert config_changes(saved, {"model": {"d_model": 128, "scan_layers": False,
                                          "remat": "none"}}) == []
  assert config_changes(saved, {"model": {"d_model": 128, "scan_layers": True,
                                          "remat": "none"}}) == ["model.scan_layers: None -> True"]
