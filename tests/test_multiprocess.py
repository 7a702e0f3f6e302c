"""Two processes on JAX's distributed runtime train like one: the acceptance test of the
multi-host path (issue 14).

Two CPU processes on 127.0.0.1 (``jax.distributed.initialize``, 2 fake devices each, gloo
collectives — the CPU default of this jax) form one 4-device data mesh and run the tiny
config of ``multiprocess_worker.py``: generation, rewards, 2 learner steps, a checkpoint
(Orbax, multi-process), then, in the same processes, a restore of step 2 and step 3.
The final parameters must equal those of one process on 4 devices with the same global
batch, and only process 0 may have written run files.
"""

import json
import os
import resource

import jax
import numpy as np
import pytest

from jaxreplay import config as config_lib
from jaxreplay.train import checkpoint as ckpt_lib
from conftest import run, run_processes
from jaxreplay.train.metrics import read_metrics, read_records
from multiprocess_worker import tiny_config

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")


@pytest.fixture(scope="module")
def cache(base_policy_cache):
  """The session's base-policy cache (the tiny config's entry filled by its first run)."""
  return base_policy_cache


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
  """(one-process run dir, its final params) and (two-process run dir, params, reports)."""
  # The one-process reference, 4 devices of this process; it also warm-starts the base
  # policy into the cache the two processes then restore onto their mesh.
  ref_dir = str(tmp_path_factory.mktemp("one"))
  saved = {}
  real_save = ckpt_lib.save

  def spy(manager, step, tree, meta):
    saved["tree"] = tree
    real_save(manager, step, tree, meta)

  ckpt_lib.save = spy
  cpu0 = resource.getrusage(resource.RUSAGE_SELF)
  try:
    run(tiny_config(ref_dir, cache, steps=3, record=True), log=lambda *_: None)
  finally:
    ckpt_lib.save = real_save
  cpu1 = resource.getrusage(resource.RUSAGE_SELF)
  ref_cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
  ref_params = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
                jax.tree_util.tree_flatten_with_path(saved["tree"]["train"].params)[0]}

  two_dir = str(tmp_path_factory.mktemp("two"))
  out = str(tmp_path_factory.mktemp("out"))
  # The persistent compilation cache lets each process's second run (the restore) reuse
  # the executables its first run compiled.
  run_processes("multiprocess_worker.py", [two_dir, cache, out],
                env={"JAX_COMPILATION_CACHE_DIR": os.path.join(out, "jax_cache"),
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  with np.load(os.path.join(out, "params.npz")) as z:
    two_params = dict(z)
  reports = []
  for i in range(2):
    with open(os.path.join(out, f"process_{i}.json")) as f:
      reports.append(json.load(f))
  print(f"CPU seconds: one-process reference {ref_cpu:.1f}, two processes "
        f"{[r['cpu_s'] for r in reports]}")
  return (ref_dir, ref_params), (two_dir, two_params, reports)


@pytest.mark.slow
def test_two_processes_form_one_mesh_and_restore(runs):
  _, (_, _, reports) = runs
  for r in reports:
    assert (r["process_count"], r["device_count"], r["local_devices"]) == (2, 4, 2)
    assert any("resumed from" in m and "at step 2" in m for m in r["logs"]), r["logs"]


@pytest.mark.slow
def test_two_processes_train_the_same_parameters_as_one(runs):
  (_, ref), (_, two, _) = runs
  assert sorted(ref) == sorted(two) and len(ref) > 5
  worst = 0.0
  for k in ref:
    assert two[k].shape == ref[k].shape and two[k].dtype == ref[k].dtype == np.float32, k
    scale = float(np.max(np.abs(ref[k])))
    worst = max(worst, float(np.max(np.abs(two[k] - ref[k]))) / scale)
  print(f"largest parameter difference / largest parameter, per tensor: {worst:.2e}")
  assert worst <= 1e-6


@pytest.mark.slow
def test_metrics_agree_and_only_process_0_wrote_run_files(runs):
  (ref_dir, _), (two_dir, _, reports) = runs
  wrote0, wrote1 = reports[0]["wrote"], reports[1]["wrote"]
  assert wrote1 == []
  assert wrote0.count("config.json") == 2 and wrote0.count("summary.json") == 2
  assert sorted(w for w in wrote0 if w.startswith("metrics")) == [
      f"metrics.jsonl:{s}" for s in (0, 1, 2, 3)]
  steps = [r["step"] for r in read_records(two_dir)]
  assert steps == [0, 1, 2, 3]  # each record once: process 1 wrote none
  # the recorded completions: evaluations at steps 0, 2 and the last, trained rollouts every
  # step, from process 0 alone, and the same files the one-process run wrote
  names = sorted(w[len("samples/"):] for w in wrote0 if w.startswith("samples/"))
  assert names == ["eval_0.jsonl", "eval_2.jsonl", "eval_3.jsonl",
                   "train_1.jsonl", "train_2.jsonl", "train_3.jsonl"], names
  assert sorted(os.listdir(os.path.join(two_dir, "samples"))) == names
  for name in names:
    with open(os.path.join(ref_dir, "samples", name)) as a, \
         open(os.path.join(two_dir, "samples", name)) as b:
      assert a.read() == b.read(), name
  assert not [f for f in os.listdir(two_dir) if ".tmp-" in f]
  one, two = read_metrics(ref_dir), read_metrics(two_dir)
  assert [r["step"] for r in one] == [0, 1, 2, 3]
  for a, b in zip(one, two):
    for k in ("reward", "batch_reward", "generated_tokens", "trained_tokens", "buffer_size"):
      if k in a:
        assert a[k] == b[k], (a["step"], k)
    for k in ("loss", "grad_norm"):
      if k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=k)


@pytest.mark.slow
def test_state_ring_and_reference_share_the_parameter_layout(runs, cache, tmp_path):
  """build() on a (2, 2, 2) mesh: the train state (optimizer moments included), the KL
  reference and simulated_async's parameter ring are created in the parameters' own
  sharded layout; the ring and the reference exist only when the config uses them."""
  from conftest import build
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  c = tiny_config(str(tmp_path / "a"), cache, steps=3)
  c.mesh.update(data=2, fsdp=2, tensor=2)
  c.train.update(mode="simulated_async", lag=2)
  c.algo.kl_coef = 0.1
  job, carry = build(c, log=lambda *_: None)
  job.writer.close()
  params = carry.state.params
  shardings = [x.sharding for x in jax.tree.leaves(params)]
  assert any(not s.is_fully_replicated for s in shardings)  # q/k/v/o, mlp, embed split
  for other in (carry.state.ref_params, *carry.ring):
    assert [x.sharding for x in jax.tree.leaves(other)] == shardings
  emb = params["embed"]["embedding"][...]
  mu = [x for p, x in jax.tree_util.tree_leaves_with_path(carry.state.opt_state)
        if "embed" in jax.tree_util.keystr(p) and x.ndim == 2]
  assert mu and all(x.sharding == emb.sharding for x in mu)
  assert len(carry.ring) == 2
  c = tiny_config(str(tmp_path / "b"), cache, steps=3)
  job, carry = build(c, log=lambda *_: None)
  job.writer.close()
  assert carry.ring == () and carry.state.ref_params is None


@pytest.mark.parametrize("field,value,match", [
    ("coordinator_address", "localhost", "host:port"),
    ("num_processes", 0, "must be >= 1"),
    ("process_id", 2, "must be < distributed.num_processes=2"),
    ("local_device_ids", "0,a", "comma-separated"),
])
def test_distributed_fields_are_validated(field, value, match):
  c = tiny_config("/tmp/unused", "/tmp/unused", steps=1)
  c.distributed.update(initialize=True, coordinator_address="10.0.0.1:1234", num_processes=2,
                       process_id=1, local_device_ids="0,1")
  assert config_lib.distributed_settings(c) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
      "local_device_ids": (0, 1)}
  c.distributed[field] = value
  with pytest.raises(config_lib.ConfigError, match=f"distributed.{field}.*{match}"):
    config_lib.distributed_settings(c)


def test_distributed_defaults_let_jax_detect():
  c = tiny_config("/tmp/unused", "/tmp/unused", steps=1)
  assert config_lib.distributed_settings(c) is None  # initialize=False: one process
  c.distributed.initialize = True
  assert config_lib.distributed_settings(c) == {
      "coordinator_address": None, "num_processes": None, "process_id": None,
      "local_device_ids": None}


def test_multiprocess_job_rejects_async_and_a_partial_mesh():
  c = tiny_config("/tmp/unused", "/tmp/unused", steps=3)
  c.train.mode = "async"
  with pytest.raises(config_lib.ConfigError, match="train.mode='async'.*one-process only"):
    config_lib.validate(c, device_count=8, process_count=2)
  c.train.mode = "sync"
  with pytest.raises(config_lib.ConfigError, match="must use all 8 devices"):
    config_lib.validate(c, device_count=8, process_count=2)
  config_lib.validate(c, device_count=4, process_count=2)
