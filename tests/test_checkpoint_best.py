"""Keep-best checkpoints: besides the last ``checkpoint.max_to_keep``, ``checkpoints_best``
keeps the train state with the best held-out accuracy (eval/acc_sampled); resuming still
uses the latest checkpoint."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.train import checkpoint as ckpt
from jaxreplay.train import build as build_lib
from conftest import run
from jaxreplay.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_best_keeps_only_the_best(tmp_path):
  mgr = ckpt.make_best_manager(str(tmp_path))
  best = ckpt.best_so_far(mgr)
  assert best is None
  for step, acc in enumerate([0.2, 0.5, 0.3, 0.5, 0.4], start=1):
    best = ckpt.save_best(mgr, best, step, {"w": jnp.full((4,), float(step))},
                          {"acc_sampled": acc, "acc_greedy": 0.0})
  mgr.wait_until_finished()
  assert best == (2, 0.5)  # ties keep the first
  assert mgr.all_steps() == [2]
  # a fresh process reads the best back, and does not save a recomputed step again
  mgr = ckpt.make_best_manager(str(tmp_path))
  assert ckpt.best_so_far(mgr) == (2, 0.5)
  state, meta = ckpt.restore(mgr, {"w": jnp.zeros((4,))})
  np.testing.assert_array_equal(state["w"], np.full((4,), 2.0))
  assert meta == {"step": 2, "eval": {"acc_sampled": 0.5, "acc_greedy": 0.0}}
  assert ckpt.save_best(mgr, (2, 0.5), 2, {"w": jnp.zeros((4,))}, {"acc_sampled": 0.9}) == (2, 0.5)
  # a better value at an earlier step number (e.g. a different eval after resume) still saves
  assert ckpt.save_best(mgr, (2, 0.5), 1, {"w": jnp.ones((4,))}, {"acc_sampled": 0.6}) == (1, 0.6)
  mgr.wait_until_finished()
  assert mgr.all_steps() == [1]


def tiny_config(workdir, cache_dir, **overrides):
  """configs/small.py shrunk to a 1-layer model, 20 warm-start steps and R = B = 16; an
  entropy bonus so that every update changes the parameters."""
  c = load_config(os.path.join(ROOT, "configs", "small.py"))
  c.workdir = str(workdir)
  c.warmstart.cache_dir = str(cache_dir)
  c.log.progress = False
  c.log.tensorboard = False
  c.task.update(train_size=400, heldout_size=100)
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  c.warmstart.update(steps=20, batch_size=32)
  c.rollout.update(per_step=16, group_size=4)
  c.train.batch_size = 16
  c.buffer.capacity = 32
  c.algo.warmup_steps = 1
  c.algo.entropy_coef = 0.01  # the tiny policy earns ~0 reward: the entropy term moves it
  c.eval.update(every=1, num_examples=8, samples_per_example=1)
  c.checkpoint.update(every=1, max_to_keep=20)
  c.mesh.data = 1  # one device: what is checked is which checkpoint is kept, not the layout
  for k, v in overrides.items():
    sec, name = k.split(".")
    c[sec][name] = v
  return c


@pytest.mark.slow
def test_trainer_keeps_best_and_resumes_from_latest(tmp_path, monkeypatch, base_policy_cache):
  # Held-out accuracies are scripted (the real evaluation runs; acc_sampled is replaced)
  # so that the best step is not the last one. Call 0 is the evaluation before RL.
  script = iter([0.9, 0.3, 0.6, 0.2, 0.5, 0.55, 0.7])
  real = build_lib.evaluate

  def scripted(*a, **k):
    return dict(real(*a, **k), acc_sampled=next(script))

  monkeypatch.setattr(build_lib, "evaluate", scripted)
  wd = tmp_path / "run"
  s = run(tiny_config(wd, base_policy_cache, **{"train.steps": 4}), log=lambda *_: None)
  best_dir = wd / "checkpoints_best"
  assert sorted(os.listdir(best_dir)) == ["2"]  # 0.6 at step 2; the 0.9 before RL is no checkpoint
  assert s["best_checkpoint"]["step"] == 2 and s["best_checkpoint"]["eval/acc_sampled"] == 0.6
  assert sorted(int(d) for d in os.listdir(wd / "checkpoints") if d.isdigit()) == [1, 2, 3, 4]
  # the best checkpoint holds exactly the train state of step 2
  regular = ckpt.make_manager(str(wd / "checkpoints"), 20)
  meta = ckpt.read_meta(regular)
  assert meta["step"] == 4
  full = regular.restore(2, args=ckpt.ocp.args.Composite(state=ckpt.ocp.args.StandardRestore()))
  kept = ckpt.make_best_manager(str(best_dir)).restore(
      2, args=ckpt.ocp.args.Composite(state=ckpt.ocp.args.StandardRestore()))
  a, b = jax.tree.leaves(full.state["train"]), jax.tree.leaves(kept.state["train"])
  assert len(a) == len(b) > 10
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  c = jax.tree.leaves(regular.restore(4, args=ckpt.ocp.args.Composite(
      state=ckpt.ocp.args.StandardRestore())).state["train"]["params"])
  p2 = jax.tree.leaves(full.state["train"]["params"])
  assert any(not np.array_equal(x, y) for x, y in zip(p2, c))  # and step 4 differs from it
  # resuming to 6 steps starts from the latest (4), not the best (2)
  logs = []
  s = run(tiny_config(wd, base_policy_cache, **{"train.steps": 6}), log=logs.append)
  assert any("resumed" in str(m) and "at step 4" in str(m) for m in logs), logs
  assert [r["step"] for r in read_metrics(wd)][-2:] == [5, 6]
  assert sorted(os.listdir(best_dir)) == ["6"]  # 0.55 at step 5 < 0.6; 0.7 at step 6
  assert s["best_checkpoint"]["step"] == 6

