"""The trainer on a device mesh: state, buffer and batches are laid out by ``config.mesh``,
the layout survives the loop, and a run on 1 device matches one on 8 fake devices."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxreplay.train import checkpoint as ckpt_lib
from conftest import run, tiny_run_config
from jaxreplay.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def small_config(workdir, cache_dir, mesh, **overrides):
  """``conftest.tiny_run_config`` (its 1-layer d=32 model, R = 16, B = 32 from a buffer of
  64, and the base policy every tiny run shares) with 3 RL steps and an evaluation (8 × 2)
  before and after only: every batch, buffer and evaluation splits evenly over 8 devices."""
  return tiny_run_config(workdir, cache_dir, **{
      "train.steps": 3, "eval.every": 0, "checkpoint.every": 3, "drift.every": 0,
      "mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2], **overrides})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_policy_cache):
  """Metrics and the saved (final) train state/buffer of the same run on three meshes."""
  cache = base_policy_cache
  out = {}
  for mesh in ((1, 1, 1), (-1, 1, 1), (2, 2, 2)):
    saved = {}
    real_save = ckpt_lib.save

    def spy(manager, step, state, meta, _saved=saved):
      _saved["tree"] = state
      real_save(manager, step, state, meta)

    ckpt_lib.save = spy
    try:
      wd = tmp_path_factory.mktemp("mesh")
      run(small_config(wd, cache, mesh), log=lambda *_: None)
    finally:
      ckpt_lib.save = real_save
    out[mesh] = (read_metrics(wd), saved["tree"])
  return out


@pytest.mark.slow
def test_layout_is_kept_through_the_loop(runs):
  _, tree8 = runs[(-1, 1, 1)]
  buf = tree8["buffer"]
  assert buf.valid.sharding.spec == P("data") and len(buf.valid.sharding.device_set) == 8
  assert buf.items.tokens.addressable_shards[0].data.shape[0] == buf.capacity // 8
  params = tree8["train"].params
  assert len(params["embed"]["embedding"][...].sharding.device_set) == 8
  # data-only mesh: the parameters are replicated
  assert params["embed"]["embedding"][...].sharding.is_fully_replicated
  _, tree222 = runs[(2, 2, 2)]
  emb = tree222["train"].params["embed"]["embedding"][...]
  assert emb.sharding.spec == P("tensor", "fsdp"), emb.sharding
  mu = tree222["train"].opt_state
  mu_emb = [x for p, x in jax.tree_util.tree_leaves_with_path(mu)
            if "embed" in jax.tree_util.keystr(p) and x.ndim == 2]
  assert mu_emb and all(x.sharding.spec == P("tensor", "fsdp") for x in mu_emb)
  assert tree222["buffer"].valid.sharding.spec == P("data")
  _, tree1 = runs[(1, 1, 1)]
  assert tree1["buffer"].valid.sharding.device_set == {jax.devices()[0]}


# Sampling uses the same keys on every layout (threefry is partitionable), so generated
# tokens, rewards and accuracies agree exactly; the loss and gradient are float32 sums
# whose order can change when the batch splits over 8 shards. Measured (3 steps, this
# machine): on configs/small.py's 3-layer d=96 model, loss rel. diff <= 1.3e-6, grad_norm
# <= 1.8e-7, params abs. diff <= 2.4e-7 (a couple of float32 ulps) for both 8-device meshes,
# which RTOL/ATOL leave ~10x room; on the tiny run's 1-layer d=32 model run here, 0 for
# every metric and parameter (its shorter sums may reorder on other CPUs: within the same
# bounds).
EXACT = ("reward", "batch_reward", "eval/acc_sampled", "eval/acc_greedy")
KEYS = EXACT + ("loss", "grad_norm")
RTOL, ATOL = 2e-5, 2e-6


@pytest.mark.slow
def test_one_device_and_eight_devices_match(runs):
  m1, t1 = runs[(1, 1, 1)]
  for mesh in ((-1, 1, 1), (2, 2, 2)):
    m8, t8 = runs[mesh]
    assert len(m1) == len(m8) == 4  # eval before RL + 3 steps
    worst = {}
    for a, b in zip(m1, m8):
      for k in KEYS:
        if k in a:
          worst[k] = max(worst.get(k, 0.0), abs(b[k] - a[k]) / max(abs(a[k]), 1e-12))
          np.testing.assert_allclose(b[k], a[k], rtol=0 if k in EXACT else RTOL,
                                     atol=0 if k in EXACT else ATOL, err_msg=f"{mesh} {k}")
    pairs = zip(jax.tree.leaves(t1["train"].params), jax.tree.leaves(t8["train"].params))
    worst["params"] = max(float(np.max(np.abs(np.asarray(b) - np.asarray(a)))) for a, b in pairs)
    print(f"mesh {mesh}: worst relative metric / absolute param differences {worst}")
    for a, b in zip(jax.tree.leaves(t1["train"].params), jax.tree.leaves(t8["train"].params)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=ATOL)

