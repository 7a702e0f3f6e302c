"""The actor–learner split (issue 25): in-flight weight swaps, the generator's own
parameter layout, and a whole run on two sub-meshes of 8 fake CPU devices.

* Engine: weights swapped between decode chunks re-prefill the decoding slots, so every
  token's recorded behaviour log-prob equals the learner's full-forward log-prob under the
  version the token records (float32), and tokens before the swap are those of the old
  policy alone.
* Layout: the compiled decode chunk gathers FSDP-sharded parameters when it runs on the
  learner's layout, and none on the generator's inference copy. With LoRA the first
  publish copies the frozen base once; later ones move only the adapters (their exact bytes)
  and the generator's parameters equal the learner's cast to its dtype.
* Run (W/T = 4/4): every inserted token's behaviour log-prob equals the learner's
  recomputation under the parameters of the version it records; no batch holds an item
  older than ``buffer.max_staleness``; a checkpoint restores the learner side exactly; lost
  in-flight rollouts are counted; the idle/overlap fractions are fractions; the rows it
  records are those its learner trained on; the generator thread places no array on a
  learner device (JAX's transfer guard log).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import restore, run, run_processes
from jaxreplay.models import Transformer, TransformerConfig, lora
from jaxreplay.models.spec import LoraSpec
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.parallel import submesh, transfers
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.sampling import engine, generate
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train import split
from jaxreplay.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=64, tie_embeddings=False)
N, G, P, M, TEMP = 8, 2, 8, 24, 1.0


def _logp(graphdef, params, prompt_toks, prompt_mask, gen):
  full = jnp.concatenate([prompt_toks, gen.tokens], 1)
  attn = jnp.concatenate([prompt_mask, gen.mask], 1)
  logp, _ = jax.jit(token_logprobs, static_argnums=(0, 4))(graphdef, params, full, attn, TEMP)
  return np.asarray(logp)[:, P:]


def test_inflight_swap_records_the_version_of_every_token():
  graphdef, old = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  _, new = nnx.split(Transformer(CFG, nnx.Rngs(1)), nnx.Param)
  rng = np.random.default_rng(0)
  toks = rng.integers(8, CFG.vocab_size, (N, P)).astype(np.int32)
  mask = np.ones((N, P), bool)
  calls = []

  def weights():  # the third decode chunk and later run on version 5
    calls.append(1)
    return (new, 5) if len(calls) >= 3 else None

  args = dict(max_new_tokens=M, temperature=TEMP, eos_ids=(), pad_id=0, group_size=G,
              chunk_steps=4, return_stats=True)
  key = jax.random.key(3)
  gen, stats = generate(graphdef, old, toks, mask, key, version=2, weights=weights, **args)
  plain = generate(graphdef, old, toks, mask, key, **args)[0]
  gen, plain = jax.tree.map(np.asarray, gen), jax.tree.map(np.asarray, plain)
  assert stats.swaps == 1
  # all rows decode together in chunks of 4 steps: tokens 0-7 by version 2, 8-23 by 5
  np.testing.assert_array_equal(gen.versions[:, :8], 2)
  np.testing.assert_array_equal(gen.versions[:, 8:], 5)
  np.testing.assert_array_equal(gen.tokens[:, :8], plain.tokens[:, :8])
  assert (gen.tokens[:, 8:] != plain.tokens[:, 8:]).any()
  rep = lambda x: np.repeat(x, G, 0)  # noqa: E731
  lp_old = _logp(graphdef, old, rep(toks), rep(mask), gen)
  lp_new = _logp(graphdef, new, rep(toks), rep(mask), gen)
  expected = np.where(gen.versions == 2, lp_old, lp_new)
  np.testing.assert_allclose(gen.logprobs, expected, atol=2e-4)
  # the tokens after the swap are not the old policy's: its log-probs differ there
  assert np.abs(gen.logprobs[:, 8:] - lp_old[:, 8:]).max() > 0.1


@pytest.mark.slow
def test_generator_layout_has_no_parameter_collectives_in_decode():
  cfg = TransformerConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=12, d_ff=80)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  learner_mesh, gen_mesh = submesh.make_meshes((1, 4, 1), 4, 1)
  learner_sh = sharding_lib.param_shardings(params, learner_mesh)
  gen_sh = sharding_lib.param_shardings(params, gen_mesh)
  learner_params = jax.device_put(params, learner_sh)
  gen_params = submesh.make_weight_sync(learner_sh, gen_sh, jnp.float32)(learner_params)
  for a, b in zip(jax.tree.leaves(gen_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.mesh.devices.tolist() == gen_mesh.devices.tolist()
  counts = {}
  for name, mesh, p in (("learner", learner_mesh, learner_params),
                        ("generator", gen_mesh, gen_params)):
    progs = engine.lower_programs(graphdef, p, slots=64, prompt_width=16, max_new_tokens=24,
                                  requests=64, temperature=1.0, mesh=mesh)
    counts[name] = submesh.param_collectives(progs["decode"].as_text(), params)
  assert counts["learner"] > 0, counts  # FSDP: weights gathered inside the decode loop
  assert counts["generator"] == 0, counts


def test_weight_sync_casts_to_the_inference_dtype():
  _, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  learner_mesh, gen_mesh = submesh.make_meshes((1, 2, 2), 4, 2)
  learner_sh = sharding_lib.param_shardings(params, learner_mesh)
  gen_sh = sharding_lib.param_shardings(params, gen_mesh)
  out = submesh.make_weight_sync(learner_sh, gen_sh, jnp.bfloat16)(
      jax.device_put(params, learner_sh))
  for a, b, sh in zip(jax.tree.leaves(out), jax.tree.leaves(params), jax.tree.leaves(gen_sh)):
    assert a.dtype == jnp.bfloat16 and a.sharding == sh
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


@pytest.mark.parametrize("generator_tensor", [1, 2])
def test_publish_streams_one_layer_at_a_time_from_every_learner_device(generator_tensor):
  import dataclasses
  cfg = dataclasses.replace(CFG, scan_layers=True, n_layers=4)
  _, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  learner_mesh, gen_mesh = submesh.make_meshes((1, 4, 1), 4, generator_tensor)
  learner_sh = sharding_lib.param_shardings(params, learner_mesh)
  gen_sh = sharding_lib.param_shardings(params, gen_mesh)
  sync = submesh.make_weight_sync(learner_sh, gen_sh, jnp.bfloat16)
  out = sync(jax.device_put(params, learner_sh))
  for a, b, sh in zip(jax.tree.leaves(out), jax.tree.leaves(params), jax.tree.leaves(gen_sh)):
    assert a.dtype == jnp.bfloat16 and a.sharding == sh
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
  # a block: one layer of a stacked block parameter [L = 4, ...], or a whole other leaf;
  # the largest here is one layer of the MLP (32 x 64) or the embedding (64 x 32), 2 bytes
  flat = {sharding_lib.path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
  block = lambda k, v: v.size // (cfg.n_layers if k.startswith("blocks/") else 1) * 2
  assert sync.peak_block_bytes == max(block(k, v) for k, v in flat.items()) == 64 * 32 * 2
  whole = submesh.publish_bytes(params, jnp.bfloat16)
  assert sync.bytes_moved == whole and sync.peak_block_bytes < whole / 10
  # the 4 generator devices' parts come from the 4 learner replicas in turn: each learner
  # device sends one generator device's share of every block
  learner_ids = sorted(d.id for d in learner_mesh.devices.flat)
  assert sorted(sync.sent_from) == learner_ids
  assert len(set(sync.sent_from.values())) == 1  # evenly
  if generator_tensor == 1:  # each generator device a whole replica
    assert sync.sent_from[learner_ids[0]] == whole
  else:  # each half a replica, less the leaves the tensor axis leaves whole (norms)
    assert whole // 2 < sync.sent_from[learner_ids[0]] < whole


def test_lora_publish_moves_the_base_once_then_only_the_adapters():
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)))
  _, params = lora.add_adapters(graphdef, params, LoraSpec(rank=2, alpha=4.0),
                                jax.random.key(1))  # q, k, v, o, gate, up, down
  learner_mesh, gen_mesh = submesh.make_meshes((1, 2, 2), 4, 2)
  learner_sh = sharding_lib.param_shardings(params, learner_mesh)
  gen_sh = sharding_lib.param_shardings(params, gen_mesh)
  sync = submesh.make_weight_sync(learner_sh, gen_sh, jnp.bfloat16)
  first = sync(jax.device_put(params, learner_sh))
  assert sync.bytes_moved == submesh.publish_bytes(params, jnp.bfloat16)  # base + adapters
  # the learner trains: the adapters move (B leaves zero), the base stays
  adapters, frozen = lora.split_adapters(params)
  adapters = jax.tree.map(lambda x: x + 0.25, adapters)
  params = lora.join_adapters(adapters, frozen)
  second = sync(jax.device_put(params, learner_sh))
  # per layer, rank 2 × (in + out) of q 32→32, k 32→16, v 32→16, o 32→32, gate and up
  # 32→64, down 64→32 = 2 × 512 = 1024 values; 2 layers, 2 bytes each in bfloat16
  assert sync.bytes_moved == 2 * 1024 * 2 == submesh.publish_bytes(
      params, jnp.bfloat16, adapters_only=True)
  flat = lambda t: dict(nnx.to_flat_state(t))  # noqa: E731
  got, want, shs = flat(second), flat(params), flat(gen_sh)
  assert got.keys() == want.keys()
  for path, var in got.items():
    a = var[...]
    assert a.dtype == jnp.bfloat16 and a.sharding == shs[path].get_value(), path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want[path][...].astype(jnp.bfloat16)))
  # the second publish reuses the generator's first copy of the base
  base_first = flat(lora.split_adapters(first)[1])
  base_second = flat(lora.split_adapters(second)[1])
  assert all(base_second[k][...] is base_first[k][...] for k in base_first)


def test_split_devices_per_process():
  class D:
    def __init__(self, i, p):
      self.id, self.process_index = i, p
  devs = [D(i, i // 4) for i in range(8)]
  learner, gen = submesh.split_devices(devs, 1)
  assert [d.id for d in learner] == [0, 1, 2, 4, 5, 6]
  assert [d.id for d in gen] == [3, 7]
  with pytest.raises(ValueError, match="generator_devices=4"):
    submesh.split_devices(devs, 4)


def split_config(workdir, cache, steps):
  """The tiny two-process config on one process: W = 4 generator devices, T = 4 learner
  devices (data 4), weights published every step, chunks of 2 decode steps."""
  from multiprocess_worker import tiny_config
  c = tiny_config(workdir, cache, steps=steps)
  c.train.update(mode="async", weight_sync_every=1)
  c.mesh.update(data=4, generator_devices=4)
  c.sampler.chunk_steps = 2
  c.buffer.max_staleness = 3
  return c


RECORDED = 3  # rows of each samples/train_STEP.jsonl in the split run


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, base_policy_cache):
  """A 4-step run with spies on what was generated, published and checkpointed."""
  workdir = str(tmp_path_factory.mktemp("split"))
  cache = base_policy_cache
  made, published, saved, graphdefs = [], {}, {}, []
  real_deliver, real_publish, real_init = (split.Generator._deliver, split.Generator.publish,
                                           split.Generator.__init__)
  real_save = ckpt_lib.save
  real_loop = split.Generator._loop
  audits = []

  def loop_spy(self):  # the generator thread's implicit transfers, by destination
    with transfers.implicit_transfers() as seen:
      real_loop(self)
    audits.append((seen, {d.id for d in self._mesh.devices.flat}))

  real_load = engine._Stream.load
  streams, loads = [], []

  def load_spy(self, *a):  # rounds in flight when the engine takes the next one
    if self not in streams:
      streams.append(self)
    loads.append((streams.index(self), len(self.loaded), int((~self.loop.done).sum())))
    real_load(self, *a)

  def deliver_spy(self, rollout, produced):  # each finished round, in order
    graphdefs.append(self._run.source.graphdef)
    made.append((jax.tree.map(np.asarray, rollout), produced.token_versions))
    real_deliver(self, rollout, produced)

  def keep(version, params):
    published[version] = jax.tree.map(np.asarray, params)

  def init_spy(self, *, params, version, **kw):
    keep(version, params)
    real_init(self, params=params, version=version, **kw)

  def publish_spy(self, params, version):
    keep(version, params)
    real_publish(self, params, version)

  def save_spy(manager, step, tree, meta):
    saved[step] = jax.tree.map(np.asarray, tree["train"].params)
    real_save(manager, step, tree, meta)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(split.Generator, "_deliver", deliver_spy)
    mp.setattr(engine._Stream, "load", load_spy)
    mp.setattr(split.Generator, "publish", publish_spy)
    mp.setattr(split.Generator, "__init__", init_spy)
    mp.setattr(ckpt_lib, "save", save_spy)
    mp.setattr(split.Generator, "_loop", loop_spy)
    c = split_config(workdir, cache, steps=4)
    c.log.record_every, c.log.record_rollouts = 2, RECORDED  # samples/train_{2,4}.jsonl
    summary = run(c, log=lambda *_: None)
  return dict(workdir=workdir, cache=cache, made=made, published=published, saved=saved,
              summary=summary, graphdef=graphdefs[0], audits=audits, loads=loads)


@pytest.mark.slow
def test_split_generator_thread_places_nothing_on_learner_devices(split_run):
  # Eager ops place their host inputs on the thread's default device: learner device 0
  # unless the generator thread sets its own (the round key's fold_in, the stop
  # post-processing, the advantages).
  (seen, generator_ids), = split_run["audits"]
  learner_ids = {d.id for d in jax.devices()} - generator_ids
  assert seen.total > 0  # the audit reads the guard's log: the rounds' own transfers
  assert seen.onto(generator_ids) > 0
  assert seen.onto(learner_ids) == 0, dict(seen.single)


@pytest.mark.slow
def test_split_run_behaviour_logprobs_match_the_recorded_versions(split_run):
  made, published, graphdef = split_run["made"], split_run["published"], split_run["graphdef"]
  assert made, "no round was generated"
  checked = 0
  for rollout, versions in made:
    p_width = rollout.tokens.shape[1] - versions.shape[1]
    mask = rollout.completion_mask[:, p_width:]
    for v in np.unique(versions[mask]):
      assert int(v) in published, (int(v), sorted(published))
      logp, _ = jax.jit(token_logprobs, static_argnums=(0, 4))(
          graphdef, published[int(v)], rollout.tokens, rollout.attention_mask, 1.0)
      sel = mask & (versions == v)
      np.testing.assert_allclose(rollout.behaviour_logprobs[:, p_width:][sel],
                                 np.asarray(logp)[:, p_width:][sel], atol=2e-4)
      checked += int(sel.sum())
    np.testing.assert_array_equal(rollout.policy_version,
                                  np.where(mask, versions, 1 << 30).min(1))
    np.testing.assert_array_equal(rollout.newest_version, np.where(mask, versions, -1).max(1))
  assert checked == sum(int(r.completion_mask.sum()) for r, _ in made)


@pytest.mark.slow
def test_split_run_respects_staleness_and_counts(split_run):
  recs = [r for r in read_metrics(split_run["workdir"]) if "staleness_max" in r]
  assert len(recs) == 4
  for r in recs:
    assert r["staleness_max"] <= 3 and r["batch_bad_slots"] == 0
    for k in ("generator_idle", "learner_idle", "overlap"):
      assert 0.0 <= r[k] <= 1.0, (k, r[k])
    # one reading of the busy clock: both sides worked at once no longer than either did, and
    # at least as long as their busy times must overlap within the wall time (1e-9: rounding)
    busy_g, busy_l = 1.0 - r["generator_idle"], 1.0 - r["learner_idle"]
    assert busy_g + busy_l - 1.0 - 1e-9 <= r["overlap"] <= min(busy_g, busy_l) + 1e-9, r
  ledger = split_run["summary"]["ledger"]
  made = sum(r.rewards.shape[0] for r, _ in split_run["made"])
  inserted = recs[-1]["limiter_inserted"]
  # every finished round counts as generated; those never inserted count as lost, and so
  # do the rounds abandoned mid-way when the run stopped (16 rollouts each, at most
  # engine.ROUNDS_IN_FLIGHT)
  assert ledger["generated_rollouts"] == made
  abandoned = ledger["lost_in_flight_rollouts"] - (made - inserted)
  assert abandoned % 16 == 0 and 0 <= abandoned <= 16 * engine.ROUNDS_IN_FLIGHT
  s = split_run["summary"]
  assert 0.0 <= s["both_busy_s"] <= s["wall_seconds"]
  # generate_s counts the generator's busy time up to each record, the stretch in progress
  # included (a stream stays busy across rounds): positive from the first step on, growing
  gen_s = [r["generate_s"] for r in recs]
  assert gen_s[0] > 0 and gen_s == sorted(gen_s) and gen_s[-1] <= s["wall_seconds"], gen_s


def test_split_generator_keeps_its_slots_full_across_rounds(split_run):
  """The generator thread streams its rounds through one set of decode slots
  (``engine.stream``): one stream for the whole run, and the next round is taken while
  the one before still decodes, its requests filling the slots that round's finished
  requests freed."""
  loads = split_run["loads"]  # (stream, rounds held, slots decoding) at each round taken
  assert {stream for stream, _, _ in loads} == {0} and len(loads) >= len(split_run["made"])
  assert any(held >= 1 and decoding > 0 for _, held, decoding in loads), loads


@pytest.mark.slow
def test_split_run_records_the_rows_it_trains_on(split_run):
  """``samples/train_STEP.jsonl`` of the split learner (``test_samples`` checks the sync
  trainer's): the rows it trained on, as stale as their versions say."""
  from test_samples import _read
  files = _read(split_run["workdir"])
  assert {"train_2.jsonl", "train_4.jsonl"} <= set(files)
  assert "eval_0.jsonl" in files and "eval_4.jsonl" in files  # before RL and at the end
  for step in (2, 4):
    recs = files[f"train_{step}.jsonl"]
    assert len(recs) == RECORDED
    assert all(r["staleness"] == step - 1 - r["policy_version"] >= 0 for r in recs)


@pytest.mark.slow
def test_split_run_resumes_the_learner_side_exactly(split_run):
  saved = split_run["saved"]
  assert 4 in saved
  job, carry = restore(split_config(split_run["workdir"], split_run["cache"], steps=6))
  assert carry.step == 4
  for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, carry.state.params)),
                  jax.tree.leaves(saved[4])):
    np.testing.assert_array_equal(a, b)
  assert carry.position > 0 and int(carry.limiter_state.inserted) > 0


@pytest.mark.slow
def test_two_processes_split_generator_and_learner(split_run, tmp_path):
  """2 processes × 2 fake devices, W = 2, T = 2 (one of each per process): the same checks
  as the one-process run, and an exact restore of the learner side (tests/split_worker.py)."""
  import json
  import os
  out = str(tmp_path)
  run_processes("split_worker.py", [str(tmp_path / "run"), split_run["cache"], out])
  reports = []
  for i in range(2):
    with open(os.path.join(out, f"process_{i}.json")) as f:
      reports.append(json.load(f))
  for r in reports:
    print({k: v for k, v in r.items() if k != "logs"})
    assert (r["process_count"], r["device_count"]) == (2, 4)
    assert r["checked_tokens"] > 0 and r["worst_logprob_diff"] <= 2e-4
    assert r["restored_equals_saved"] and r["restored_step"] == r["last_saved"] == 3
    assert r["staleness_max"] <= 3 and r["bad_slots"] == 0
    assert r["steps"] == [1, 2, 3, 4]
    assert all(x >= 0 for x in r["lost"])
  # the recorded completions come from process 0 alone: an evaluation before RL, at step 2
  # and at the end of each run (3, 4), trained rollouts every step
  assert reports[1]["samples_written"] == []
  assert sorted(reports[0]["samples_written"]) == sorted(
      [f"eval_{s}.jsonl" for s in (0, 2, 3, 4)] + [f"train_{s}.jsonl" for s in (1, 2, 3, 4)])
  # both processes agreed on every round and every swap: the same rounds and versions
  assert reports[0]["rounds"] == reports[1]["rounds"]
  assert reports[0]["versions"] == reports[1]["versions"]


@pytest.mark.parametrize("change, match", [
    (dict(mode="sync"), r"mesh.generator_devices=4 .*needs train.mode='async'"),
    (dict(w=8), r"mesh.generator_devices=8 .*below the 8 device\(s\) of each process"),
    (dict(tensor=3), r"mesh.generator_tensor=3 .*divide the 4 generator devices"),
    (dict(rescore=True), r"rollout.behaviour_logprobs='learner' .*must be 'sampler'"),
    (dict(kl=True), r"algo.kl_mode='reward' .*use algo.kl_mode='loss'"),
])
def test_split_config_errors(change, match):
  from jaxreplay import config as config_lib
  c = split_config("/tmp/unused", "/tmp/unused", steps=3)
  if "mode" in change:
    c.train.mode = change["mode"]
  c.mesh.generator_devices = change.get("w", 4)
  c.mesh.generator_tensor = change.get("tensor", 1)
  if change.get("rescore"):
    c.rollout.behaviour_logprobs = "learner"
  if change.get("kl"):
    c.algo.update(kl_mode="reward", kl_coef=0.1)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c, device_count=8, process_count=1)


def test_split_config_learner_mesh_and_processes():
  from jaxreplay import config as config_lib
  c = split_config("/tmp/unused", "/tmp/unused", steps=3)
  config_lib.validate(c, device_count=8, process_count=1)  # T = 4 learner devices, data 4
  c.mesh.update(data=2, generator_devices=1)
  config_lib.validate(c, device_count=4, process_count=2)  # async across processes: allowed
  c.mesh.update(data=1)  # the learner mesh must span both processes' learner devices
  with pytest.raises(config_lib.ConfigError, match="must use all 2 devices"):
    config_lib.validate(c, device_count=4, process_count=2)


def test_generator_busy_seconds_never_decrease_across_a_transition_during_a_reading():
  """A transition the generator thread makes while the learner holds ``cond`` to read its
  busy seconds is stamped after that reading: the next reading is never smaller (a CI run
  once read 2.5457 s and then 2.5424 s when the stamp was taken before the lock)."""
  import threading
  import time
  now = time.monotonic()
  gen = types.SimpleNamespace(cond=threading.Condition(), busy_s=0.0, _busy_since=now - 1.0,
                              _clock=split.BusyClock(now))
  with gen.cond:
    t = threading.Thread(target=split.Generator._set_busy, args=(gen, False))
    t.start()
    time.sleep(0.05)  # the thread is now blocked on ``cond``, after the old code's stamp
    first = split.Generator.busy_seconds(gen, time.monotonic())
  t.join()
  with gen.cond:
    second = split.Generator.busy_seconds(gen, time.monotonic())
  assert gen._busy_since is None and 1.05 <= first <= second, (first, second)
