"""Self-tuning replay wired into the lagged strategy (``train.self_tuning``): the controller
sets R and the age cut-off as ``replay.auto.plan`` says for its estimates, the following
rounds generate the new R and sample within the new cut-off, the controller's state is
checkpointed and restored exactly, and the config rules name the fields."""

import os
import sys

import numpy as np
import pytest

from conftest import run
from jaxreplay.config import ConfigError, validate
from jaxreplay.replay import auto
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train import loop
from jaxreplay.train import self_tuning
from jaxreplay.train.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiprocess_worker import tiny_config as _tiny  # noqa: E402

B, R0, C = 16, 8, 32
ALPHA, RHO = 0.25, 0.1  # the estimates the controller is given (the estimator itself runs)


def tiny_config(workdir, cache_dir, steps=6, **auto_replay):
  """``multiprocess_worker.tiny_config`` on one device, R = 8 (B = 16, C = 32), the
  controller on every 2 steps with y pinned to 1 (so R = B = 16 once it acts)."""
  c = _tiny(str(workdir), str(cache_dir), steps)
  c.mesh.update(data=1)
  c.rollout.per_step = R0
  c.auto_replay.update({**dict(enabled=True, every=2, warmup=1, ema=0.0, num_samples=16,
                              num_projections=8, min_samples=2, y_min=1.0, y_max=1.0,
                              mu_source="flops"), **auto_replay})
  return c


def test_config_rules_name_the_field_and_the_choices(tmp_path):
  validate(tiny_config(tmp_path, tmp_path))
  c = tiny_config(tmp_path, tmp_path)
  c.train.mode = "async"
  with pytest.raises(ConfigError, match=r"^config\.auto_replay\.enabled=True is invalid: needs "
                                        r"train\.mode 'sync' or 'simulated_async'.*not 'async'"):
    validate(c)
  c = tiny_config(tmp_path, tmp_path, center="fresh")
  c.train.mode = "simulated_async"
  with pytest.raises(ConfigError, match=r"auto_replay\.center='fresh' is invalid.*lag 1"):
    validate(c)
  c = tiny_config(tmp_path, tmp_path)
  c.algo.advantage = "gae"
  with pytest.raises(ConfigError, match=r"auto_replay\.enabled=True.*algo\.advantage='gae'"):
    validate(c)
  c = tiny_config(tmp_path, tmp_path, y_max=4.0)
  c.buffer.max_times_sampled = 2
  with pytest.raises(ConfigError, match=r"buffer\.max_times_sampled=2 is invalid: must be >= "
                                        r"auto_replay\.y_max=4\.0"):
    validate(c)
  with pytest.raises(ConfigError, match=r"auto_replay\.mu_source='seconds' is invalid"):
    validate(tiny_config(tmp_path, tmp_path, mu_source="seconds"))
  c = tiny_config(tmp_path, tmp_path)  # off: nothing is checked
  c.auto_replay.enabled, c.train.mode = False, "async"
  validate(c)


@pytest.fixture
def fixed_estimates(monkeypatch):
  """The real noise estimate runs; its α and ρ are replaced by ``ALPHA``, ``RHO``."""
  real = self_tuning.estimate

  def estimate(run_, carry, step):
    est, seconds = real(run_, carry, step)
    # every scored item is in a staleness bucket (the tiny policy's groups often have
    # equal rewards, zero gradients: σ² may be 0 or not identifiable)
    assert int(np.asarray(est.count).sum()) == int(est.num_items) == 16
    return est._replace(alpha=np.float32(ALPHA), rho=np.float32(RHO)), seconds

  monkeypatch.setattr(self_tuning, "estimate", estimate)


def _meta(workdir):
  return ckpt_lib.read_meta(ckpt_lib.make_manager(os.path.join(workdir, "checkpoints"), 2))


@pytest.mark.slow
def test_controller_sets_r_and_cutoff_and_resumes_exactly(tmp_path, fixed_estimates,
                                                          monkeypatch, base_policy_cache):
  cache, wd = base_policy_cache, tmp_path / "run"
  logs = []
  run(tiny_config(wd, cache, steps=4), log=logs.append)
  recs = [r for r in read_metrics(wd) if "staleness_hist" in r]
  assert [r["step"] for r in recs] == [1, 2, 3, 4]
  # estimates at records 2 and 4 (every 2 steps); the decision of record 2 is the closed form
  d = recs[1]
  assert "noise/alpha" in d and "auto/estimate_s" in d and "noise/alpha" not in recs[0]
  assert (d["auto/alpha"], d["auto/rho"]) == (float(np.float32(ALPHA)), float(np.float32(RHO)))
  spec = auto.AutoReplaySpec(warmup=1, ema=0.0, y_min=1.0, y_max=1.0)
  p = auto.plan(d["auto/mu"], d["auto/alpha"], d["auto/rho"], spec, batch_size=B,
                group_size=4, capacity=C, lag=0, min_items=B)
  assert d["auto/mu"] == d["auto/mu_measured"] == d["mu_flops"] > 0
  assert (d["auto/x"], d["auto/y"], d["auto/horizon"]) == (p.x, p.y, p.horizon)
  assert p.rollouts_per_step == 16 and d["auto/changed"] == 1.0
  assert (d["auto/next_R"], d["auto/next_max_staleness"]) == (16.0, float(p.max_staleness))
  assert any(str(m).startswith("auto_replay: from step 2: rollout.per_step=16, "
                               f"buffer.max_staleness={p.max_staleness}") for m in logs)
  # the rounds after the decision generate the new R and sample within the new cut-off
  assert [r["auto/R"] for r in recs] == [8.0, 8.0, 16.0, 16.0]
  assert [r["auto/max_staleness"] for r in recs] == [-1.0, -1.0] + [float(p.max_staleness)] * 2
  gen = np.diff([0] + [r["generated_rollouts"] for r in recs]).tolist()
  assert gen == [16, 8, 16, 16]  # step 0: two rounds of 8 before B = 16 can be drawn
  assert all(r["staleness_max"] <= p.max_staleness for r in recs[2:])
  assert recs[3]["auto/changed"] == 0.0  # same estimates: nothing new

  # the checkpoint holds the controller's state; a resume restores it exactly and continues
  saved = _meta(wd)["auto_replay"]
  state = auto.AutoReplayState.from_dict(saved)
  assert state.to_dict() == saved and state.rollouts_per_step == 16 and state.last_step == 4
  assert [c.step for c in state.log] == [2] and state.num_estimates == 2
  restored = []
  real_resume = loop.resume
  monkeypatch.setattr(loop, "resume",
                      lambda *a: restored.append(real_resume(*a)) or restored[-1])
  logs.clear()
  run(tiny_config(wd, cache, steps=6), log=logs.append)
  assert restored[0].step == 4 and restored[0].auto == state
  assert restored[0].auto.to_dict() == saved
  assert any("auto_replay: continuing with rollout.per_step=16" in str(m) for m in logs)
  recs = [r for r in read_metrics(wd) if "staleness_hist" in r]
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
  assert [r["auto/R"] for r in recs[4:]] == [16.0, 16.0]
  assert recs[-1]["generated_rollouts"] - recs[3]["generated_rollouts"] == 32
  final = auto.AutoReplayState.from_dict(_meta(wd)["auto_replay"])
  assert final.num_estimates == 3 and final.last_step == 6 and final.log == state.log


@pytest.mark.slow
def test_generation_budget_ends_the_run_and_a_resume_keeps_it(tmp_path, fixed_estimates,
                                                               base_policy_cache):
  """``train.max_generated_rollouts``: the run ends after the step whose generation spends
  the budget (evaluated and checkpointed there), a resume does not train past it, and a
  larger budget continues the same run."""
  cache, wd = base_policy_cache, tmp_path / "run"
  c = tiny_config(wd, cache, steps=6)
  c.train.max_generated_rollouts = 40
  summary = run(c)
  recs = [r for r in read_metrics(wd) if "staleness_hist" in r]
  # generated 16, 24, 40 after steps 1, 2, 3 (R = 8, then 16 from the decision at step 2)
  assert [r["generated_rollouts"] for r in recs] == [16, 24, 40]
  assert "eval/acc_sampled" in recs[-1] and "eval/acc_sampled" not in recs[1]
  assert (summary["steps"], summary["steps_done"], summary["budget_reached"]) == (6, 3, True)
  logs = []
  summary = run(c, log=logs.append)
  assert any("spent its generation budget at step 3" in str(m) for m in logs)
  assert summary["steps_done"] == 3 and len([r for r in read_metrics(wd)
                                              if "staleness_hist" in r]) == 3
  c.train.max_generated_rollouts = 56
  summary = run(c)
  assert (summary["steps_done"], summary["generated_rollouts"]) == (4, 56)
  c.train.mode = "async"
  c.auto_replay.enabled = False
  with pytest.raises(ConfigError, match=r"^config\.train\.max_generated_rollouts=56 is invalid: "
                                        r"\(a generation budget\) needs train\.mode 'sync'"):
    validate(c)
