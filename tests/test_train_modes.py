"""The trainer's modes on a tiny config: simulated_async staleness and exact resume,
threaded async (staleness, replay ratio held by the rate limiter, clean shutdown), config
validation, and the compute ledger of a run adding up."""

import json
import threading

import numpy as np
import pytest

from jaxreplay.config import ConfigError, validate
from jaxreplay.train import generation as generation_lib
from jaxreplay.train import metrics as metrics_lib
from conftest import run
from jaxreplay.train.metrics import read_metrics
from conftest import tiny_run_argv, tiny_run_config
from test_train_e2e import _strip  # noqa: E402

B, R, C = 32, 16, 64


def tiny_config(workdir, cache_dir, **overrides):
  """``conftest.tiny_run_config``: configs/small.py shrunk to a 1-layer model and 6 steps."""
  return tiny_run_config(workdir, cache_dir, **overrides)


@pytest.fixture(scope="module")
def cache_dir(base_policy_cache):
  return base_policy_cache


def _quiet(*_):
  pass


def test_mode_and_rate_limiter_validation(tmp_path):
  c = tiny_config(tmp_path, tmp_path)
  validate(c)
  with pytest.raises(ConfigError, match=r"train.mode='asynk'.*'sync', 'simulated_async', "
                                        r"'async'.*did you mean 'async'"):
    validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "asynk"}))
  with pytest.raises(ConfigError, match=r"train.lag=-1"):
    validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "simulated_async",
                                                "train.lag": -1}))
  with pytest.raises(ConfigError, match=r"train.weight_sync_every=0"):
    validate(tiny_config(tmp_path, tmp_path, **{"train.weight_sync_every": 0}))
  # (ρR + B)/2 = (2·16 + 32)/2 = 32 is the smallest deadlock-free tolerance
  with pytest.raises(ConfigError, match=r"rate_limiter.error_buffer=31.0.*= 32.0"):
    validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "async",
                                                "rate_limiter.error_buffer": 31.0}))
  validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "async",
                                              "rate_limiter.error_buffer": 32.0}))
  with pytest.raises(ConfigError, match=r"rate_limiter.min_fill=65.*buffer.capacity=64"):
    validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "async",
                                                "rate_limiter.min_fill": 65}))
  with pytest.raises(ConfigError, match=r"drift.every=-1"):
    validate(tiny_config(tmp_path, tmp_path, **{"drift.every": -1}))


@pytest.mark.slow
def test_simulated_async_lag_and_exact_resume(cache_dir, tmp_path):
  """Rollouts of step t come from version max(t − lag, 0); n + resume + n == 2n."""
  kw = {"train.mode": "simulated_async", "train.lag": 2}
  s = run(tiny_config(tmp_path / "a", cache_dir, **kw), log=_quiet)
  a = read_metrics(tmp_path / "a")
  steps = [r for r in a if "staleness_hist" in r]
  assert len(steps) == 6
  for t, rec in enumerate(steps):
    hist = rec["staleness_hist"]
    assert sum(hist) == B
    # the freshest rollouts at step t were made by version max(t−2, 0): staleness min(t, 2)
    assert sum(hist[:min(t, 2)]) == 0 and hist[min(t, 2)] > 0, (t, hist)
  assert steps[-1]["staleness_max"] >= 3
  # drift is logged on the buffer sample at steps 3 and 6, every row in a staleness bucket
  d6 = steps[-1]
  buckets = [k for k in d6 if k.startswith("drift/s") and k.endswith("/count")]
  assert d6["drift/count"] == 32 and sum(d6[k] for k in buckets) == 32
  assert d6["drift/s0/count"] == 0 and d6["drift/s1/count"] == 0  # nothing fresher than lag
  assert d6["drift/kl"] > 0
  # the ledger adds up: every generated token was trained on, overwritten unused, or is
  # still in the buffer unused
  led = s["ledger"]
  assert led["generated_tokens"] == (led["first_use_tokens"] + led["evicted_unused_tokens"]
                                     + led["unused_in_buffer_tokens"])
  # B = 2R: step 0 generates two rounds before its first draw, then one per step
  assert led["generated_rollouts"] == 7 * R and led["trained_samples"] == 6 * B
  rho = 6 * B / (7 * R)  # 12/7
  assert led["replay_ratio"] == pytest.approx(rho) and led["mu_flops"] > 0
  assert led["gamma_flops"] == pytest.approx((1 + led["mu_flops"] / rho) / (1 + led["mu_flops"]))
  assert {"eval/pass@1", "eval/pass@2", "eval/entropy_fresh"} <= set(steps[-1])
  assert steps[-1]["eval/pass@1"] == pytest.approx(steps[-1]["eval/acc_sampled"], abs=1e-6)
  # interrupted after 3 steps (the snapshot ring is in the checkpoint), then resumed
  run(tiny_config(tmp_path / "c", cache_dir, **{**kw, "train.steps": 3}), log=_quiet)
  logs = []
  run(tiny_config(tmp_path / "c", cache_dir, **kw), log=logs.append)
  assert any("resumed" in str(m) and "step 3" in str(m) for m in logs)
  assert _strip(read_metrics(tmp_path / "c")) == _strip(a)


def _generator_threads():
  return [t for t in threading.enumerate() if t.name == "jaxreplay-generator" and t.is_alive()]


@pytest.mark.slow
def test_async_staleness_replay_ratio_and_clean_shutdown(cache_dir, tmp_path):
  """Also the async learner's sample records (``test_samples`` checks the sync ones): the
  rows of ``train_STEP.jsonl`` are those it trained on, as stale as their versions say."""
  from test_samples import K, _read
  c = tiny_config(tmp_path / "x", cache_dir, **{"train.mode": "async", "train.steps": 8,
                                                 "eval.every": 0, "checkpoint.every": 4,
                                                 "log.record_every": 2,
                                                 "log.record_rollouts": K})
  lines = []
  s = run(c, log=lines.append)
  assert not _generator_threads()
  files = _read(tmp_path / "x")
  assert sorted(files) == ["eval_0.jsonl", "eval_8.jsonl", "train_2.jsonl", "train_4.jsonl",
                           "train_6.jsonl", "train_8.jsonl"]
  for step in (2, 4, 6, 8):
    recs = files[f"train_{step}.jsonl"]
    assert len(recs) == K and all(r["staleness"] == step - 1 - r["policy_version"] >= 0
                                  for r in recs)
  # each long phase closes with one duration line
  for name in ("eval step 0", "eval step 8", "checkpoint save step 4", "checkpoint save step 8",
               "checkpoint write"):
    assert sum(ln.startswith(name + ": ") for ln in lines) == 1, (name, lines)
  recs = [r for r in read_metrics(tmp_path / "x") if "staleness_hist" in r]
  assert len(recs) == 8
  rho, e, offset = 2.0, 2.0 * R + B, 2.0 * B  # defaults: ρ = B/R, e = ρR + B, min fill B
  for r in recs:
    diff = rho * r["limiter_inserted"] - r["limiter_sampled"]
    assert offset - e <= diff <= offset + e, r
    assert r["limiter_sampled"] == r["trained_samples"]
  assert recs[-1]["trained_samples"] == 8 * B
  assert sum(sum(r["staleness_hist"][1:]) for r in recs) > 0  # stale samples appear
  led = s["ledger"]
  assert led["generated_rollouts"] >= recs[-1]["limiter_inserted"]
  assert led["generated_tokens"] == (led["first_use_tokens"] + led["evicted_unused_tokens"]
                                     + led["unused_in_buffer_tokens"])
  last = recs[-1]
  assert abs(last["trained_samples"] / last["limiter_inserted"] - rho) \
      <= (offset + e) / last["limiter_inserted"]
  assert s["mode"] == "async" and s["learner_wait_s"] >= 0


@pytest.mark.slow
def test_async_generator_failure_is_raised_and_the_thread_joined(cache_dir, tmp_path,
                                                                 monkeypatch):
  real, calls = generation_lib.generate_rollouts, []

  def flaky(*a, **k):
    calls.append(1)
    if len(calls) > 2:
      raise ValueError("sampler exploded")
    return real(*a, **k)

  monkeypatch.setattr(generation_lib, "generate_rollouts", flaky)
  c = tiny_config(tmp_path / "f", cache_dir, **{"train.mode": "async", "train.steps": 50,
                                                 "eval.every": 0, "checkpoint.every": 0})
  with pytest.raises(RuntimeError, match="generator thread failed.*sampler exploded"):
    run(c, log=_quiet)
  assert not _generator_threads()


@pytest.mark.slow
def test_async_learner_failure_stops_the_generator(cache_dir, tmp_path, monkeypatch):
  real = metrics_lib.MetricWriter.write

  def write(self, step, metrics):
    if step == 2:
      raise OSError("disk full")
    return real(self, step, metrics)

  monkeypatch.setattr(metrics_lib.MetricWriter, "write", write)
  c = tiny_config(tmp_path / "g", cache_dir, **{"train.mode": "async", "train.steps": 50,
                                                 "eval.every": 0, "checkpoint.every": 0})
  with pytest.raises(OSError, match="disk full"):
    run(c, log=_quiet)
  assert not _generator_threads()


def _buffer_after(workdir, cache_dir, **kw):
  """The buffer of the run's latest checkpoint (restored through the trainer's own resume)."""
  from conftest import build
  from jaxreplay.train.carry import resume
  job, fresh = build(tiny_config(workdir, cache_dir, **kw), log=_quiet)
  try:
    return resume(job, fresh).buffer
  finally:
    job.writer.close()


@pytest.mark.slow
def test_first_batch_waits_for_b_items_and_every_use_is_counted(cache_dir, tmp_path):
  """B = 2R: step 0 generates two rounds before its first draw (Reverb's min size), so
  the no-duplicate batch holds B distinct items and the use counts add up exactly:
  32 + 16 + 16 = 64 = C rollouts (nothing overwritten), 3 · 32 draws."""
  kw = {"train.steps": 3, "checkpoint.every": 3, "eval.every": 0}
  run(tiny_config(tmp_path / "a", cache_dir, **kw), log=_quiet)
  recs = [r for r in read_metrics(tmp_path / "a") if "staleness_hist" in r]
  assert [r["generation_rounds"] for r in recs] == [2, 1, 1]
  assert [r["generated_rollouts"] for r in recs] == [2 * R, 3 * R, 4 * R]
  assert recs[0]["replay_count_mean"] == 1.0 and recs[0]["frac_never_used"] == 1.0
  buf = _buffer_after(tmp_path / "a", cache_dir, **kw)
  used = np.asarray(buf.times_sampled)
  assert int(buf.size) == C and used.sum() == 3 * B and used.max() <= 3


@pytest.mark.slow
def test_a_batch_with_empty_slots_stops_the_run(cache_dir, tmp_path, monkeypatch):
  """Were the sampler called without B items (the fill rule bypassed), the step's
  no-duplicate batch of 32 would repeat 16 of the 16 items: the run stops with an error
  instead of training on it (and counting uses wrongly)."""
  from jaxreplay.train import build as build_lib
  monkeypatch.setattr(build_lib, "make_ready", lambda *a: lambda *b: True)
  with pytest.raises(RuntimeError, match="drew 16 empty or repeated buffer slots"):
    run(tiny_config(tmp_path / "e", cache_dir, **{"train.steps": 2, "eval.every": 0}),
        log=_quiet)


@pytest.mark.parametrize("kw, field", [
    ({"buffer.max_staleness": 0}, "buffer.max_staleness=0"),  # keeps R = 16 < B
    ({"train.mode": "simulated_async", "train.lag": 2, "buffer.max_staleness": 1},
     "buffer.max_staleness=1"),  # s < lag: every rollout is evicted before its first use
    ({"buffer.max_times_sampled": 1}, "buffer.max_times_sampled=1"),  # 16 draws < 32
])
def test_eviction_rules_that_starve_the_batch_are_rejected(tmp_path, kw, field):
  with pytest.raises(ConfigError, match=field + r".*train.batch_size=32"):
    validate(tiny_config(tmp_path, tmp_path, **kw))


def test_eviction_rules_that_keep_a_batch_are_accepted(tmp_path):
  validate(tiny_config(tmp_path, tmp_path, **{"buffer.max_staleness": 1}))  # 2 rounds = B
  validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "simulated_async",
                                              "train.lag": 1, "buffer.max_staleness": 2}))
  validate(tiny_config(tmp_path, tmp_path, **{"buffer.max_times_sampled": 2}))


def test_positive_bias_and_async_age_cutoffs_that_starve_the_batch_are_rejected(tmp_path):
  """round((1 − 0.5)·40) = 20 freshest items of any kind < B = 32: the batch would wait on
  correct rollouts; in async, a round starts with weights up to weight_sync_every − 1 = 3
  versions old and ages while it is generated and queued: max_staleness below
  weight_sync_every = 4 can evict every round (at 3, runs waited for ever)."""
  with pytest.raises(ConfigError, match=r"buffer.positive_bias_size=40.*= 20.*batch_size=32"):
    validate(tiny_config(tmp_path, tmp_path, **{"buffer.sampler": "positive_bias",
                                                "buffer.positive_bias_size": 40}))
  validate(tiny_config(tmp_path, tmp_path, **{"buffer.sampler": "positive_bias",
                                              "buffer.positive_bias_size": 64}))
  for s in (1, 3):
    with pytest.raises(ConfigError, match=rf"buffer.max_staleness={s}.*weight_sync_every = 4"):
      validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "async",
                                                  "train.weight_sync_every": 4,
                                                  "buffer.max_staleness": s}))
  validate(tiny_config(tmp_path, tmp_path, **{"train.mode": "async",
                                              "train.weight_sync_every": 4,
                                              "buffer.max_staleness": 4}))


@pytest.mark.slow
def test_a_stalled_async_run_stops_with_one_line(cache_dir, tmp_path):
  """No batch within train.async_timeout_s: the command ends with one ``jaxreplay:`` line
  naming the counters and what to check, not a traceback (the last checkpoint stays).

  The stall does not depend on the machine's speed: a batch needs two rounds (B = 2R),
  and the learner gives up at its first look, or at the latest when the first round
  arrives and wakes it, long past 1 µs. The command runs ``tiny_config``'s shapes on this
  process's devices, with its base policy: the session's caches serve its compiles."""
  import os
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = tiny_config(tmp_path / "run", cache_dir, **{"train.mode": "async", "train.steps": 3,
                                                   "train.async_timeout_s": 1e-6})
  out = subprocess.run(tiny_run_argv(c),
                       capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("jaxreplay: async mode: no batch became available in 0 s"), last
  assert "check buffer.max_staleness" in last


@pytest.mark.slow
def test_paged_sampler_returns_every_page_and_resumes_exactly(cache_dir, tmp_path, monkeypatch):
  """sampler.paged: rollouts and evaluations decode on the paged cache, after every engine
  call the page pool is empty again, and 2 steps + resume + 2 equal 4 steps."""
  from jaxreplay.sampling import engine, paged
  pools = []
  real_run = engine.run

  def run_and_keep_pool(*a, **kw):
    out = real_run(*a, **kw)
    pools.append((kw.get("paged"), np.asarray(a[2]).shape, out[-1].pool))
    return out

  monkeypatch.setattr(engine, "run", run_and_keep_pool)
  kw = {"sampler.paged": True, "sampler.page_size": 8, "train.steps": 4, "eval.every": 2,
        "checkpoint.every": 2, "drift.every": 2}
  run(tiny_config(tmp_path / "a", cache_dir, **kw), log=_quiet)
  a = read_metrics(tmp_path / "a")
  # 5 rollout rounds (step 0 draws two: B = 2R), 3 evaluations (steps 0, 2, 4) of a greedy
  # and a sampled call each: every one on the paged cache
  assert [p for p, _, _ in pools].count(True) == 11 == len(pools)
  for _, _, pool in pools:
    paged.check_pool(pool)
    assert pool.num_free == pool.refcount.shape[0] and not pool.mapped.any()
  run(tiny_config(tmp_path / "c", cache_dir, **{**kw, "train.steps": 2}), log=_quiet)
  logs = []
  run(tiny_config(tmp_path / "c", cache_dir, **kw), log=logs.append)
  assert any("resumed" in str(m) and "step 2" in str(m) for m in logs)
  assert _strip(read_metrics(tmp_path / "c")) == _strip(a)
