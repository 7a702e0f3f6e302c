"""A corrupted or truncated latest checkpoint is detected and the previous one is used."""

import glob
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.train import checkpoint as ckpt


def _save_two(tmp_path):
  mgr = ckpt.make_manager(str(tmp_path), 3)
  for step in (1, 2):
    ckpt.save(mgr, step, {"w": jnp.full((64,), float(step))}, {"step": step})
  mgr.wait_until_finished()
  return mgr


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_corrupted_latest_falls_back_to_previous(tmp_path, damage):
  _save_two(tmp_path)
  files = [f for f in glob.glob(str(tmp_path / "2" / "state" / "**" / "*"), recursive=True)
           if os.path.isfile(f)]
  assert files
  for f in files:
    if damage == "truncate":
      with open(f, "r+b") as fh:
        fh.truncate(max(os.path.getsize(f) // 3, 1))
    else:
      os.remove(f)
  mgr = ckpt.make_manager(str(tmp_path), 3)  # a fresh process would build a new manager
  with pytest.raises(RuntimeError, match="no readable checkpoint"):
    ckpt.restore(mgr, {"w": jnp.zeros((64,))}, step=2)  # the damage is real
  logs = []
  state, meta = ckpt.restore(mgr, {"w": jnp.zeros((64,))}, log=logs.append)
  assert meta == {"step": 1}
  np.testing.assert_array_equal(state["w"], np.full((64,), 1.0))
  assert any("step 2" in m and "falling back" in m for m in logs)
  # the unreadable checkpoint is moved aside (kept), so step 2 can be written again
  assert mgr.all_steps() == [1]
  assert [d for d in os.listdir(tmp_path) if d.startswith("2.unreadable-")]
  ckpt.save(mgr, 2, {"w": jnp.full((64,), 5.0)}, {"step": 2})
  mgr.wait_until_finished()
  state, meta = ckpt.restore(ckpt.make_manager(str(tmp_path), 3), {"w": jnp.zeros((64,))})
  assert meta == {"step": 2} and float(state["w"][0]) == 5.0


def test_intact_latest_is_used_and_empty_dir_gives_none(tmp_path):
  mgr = _save_two(tmp_path / "a")
  state, meta = ckpt.restore(mgr, {"w": jnp.zeros((64,))})
  assert meta == {"step": 2} and float(state["w"][0]) == 2.0
  assert ckpt.restore(ckpt.make_manager(str(tmp_path / "b"), 2), {"w": jnp.zeros(1)}) is None
