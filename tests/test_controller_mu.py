"""The self-tuning controller's μ is a property of the run, not of the machine: the ledger's
FLOP μ (or a configured one), never the phase timers. The same config and seed take the
same decisions however slow the machine is; the wall-time μ is recorded beside it."""

import os
import sys
import time

import numpy as np
import pytest

from conftest import run
from jaxreplay.config import ConfigError, validate
from jaxreplay.replay import auto
from jaxreplay.train import accounting
from jaxreplay.train import generation
from jaxreplay.train import self_tuning
from jaxreplay.train.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiprocess_worker import tiny_config as _tiny  # noqa: E402

COUNTS = {"generated_rollouts": 4, "trained_samples": 8, "generation_flops": 12.0,
          "training_flops": 16.0}


def test_controller_mu_is_the_ledgers_flop_ratio_or_the_configured_value():
  flops = auto.AutoReplaySpec()
  assert flops.mu_source == "flops" and flops.mu is None
  assert self_tuning.controller_mu(flops, COUNTS) == (12.0 / 4) / (16.0 / 8) == 1.5
  assert self_tuning.controller_mu(flops, COUNTS) == accounting.summarize(
      COUNTS, {"generate_s": 9.0, "train_s": 0.1})["mu_flops"]
  assert np.isnan(self_tuning.controller_mu(flops, {**COUNTS, "trained_samples": 0}))
  configured = auto.AutoReplaySpec(mu_source="configured", mu=5.3)
  assert self_tuning.controller_mu(configured, COUNTS) == 5.3
  assert self_tuning.controller_mu(configured, {**COUNTS, "trained_samples": 0}) == 5.3


ALPHA, RHO = 0.25, 0.1  # the estimates the controller is given (the estimator itself runs)


def _config(workdir, cache, **auto_replay):
  """``multiprocess_worker.tiny_config`` on one device, R = 8 (B = 16, C = 32), the
  controller on every 2 steps, y in [1, 2]."""
  c = _tiny(str(workdir), str(cache), 4)
  c.mesh.update(data=1)
  c.rollout.per_step = 8
  c.auto_replay.update({**dict(enabled=True, every=2, warmup=1, ema=0.0, num_samples=16,
                               num_projections=8, min_samples=2, y_min=1.0, y_max=2.0),
                        **auto_replay})
  return c


def _decisions(workdir):
  """Per record: the controller's inputs and outputs, the FLOP ledger and the rounds."""
  recs = [r for r in read_metrics(workdir) if "staleness_hist" in r]
  keep = lambda k: (k.startswith(("auto/", "noise/")) and k != "auto/estimate_s"
                    or k.endswith("_flops") or k == "generated_rollouts")
  return [{k: v for k, v in r.items() if keep(k)} for r in recs]


@pytest.fixture
def fixed_estimates(monkeypatch):
  """The real noise estimate runs; its α and ρ are replaced by ``ALPHA``, ``RHO`` (the tiny
  policy's groups often have equal rewards, so its own α, ρ may not be identifiable)."""
  real = self_tuning.estimate

  def estimate(run_, carry, step):
    est, seconds = real(run_, carry, step)
    return est._replace(alpha=np.float32(ALPHA), rho=np.float32(RHO)), seconds

  monkeypatch.setattr(self_tuning, "estimate", estimate)


@pytest.mark.slow
def test_same_decisions_on_a_loaded_machine_and_a_configured_mu_steers(tmp_path, monkeypatch,
                                                                       fixed_estimates):
  cache = tmp_path / "cache"
  summaries = [run(_config(tmp_path / "idle", cache))]
  real = generation.generate_rollouts
  rounds = []

  def slow(*args, **kwargs):  # a loaded machine: every generation round takes 0.3 s longer
    rounds.append(1)
    time.sleep(0.3)
    return real(*args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(generation, "generate_rollouts", slow)
    summaries.append(run(_config(tmp_path / "loaded", cache)))
  idle, loaded = _decisions(tmp_path / "idle"), _decisions(tmp_path / "loaded")
  # FLOP μ ≈ 0.31 puts y* below y_min = 1: R = B = 16 from the first decision (record 2) on
  assert [r["auto/R"] for r in idle] == [8.0, 8.0, 16.0, 16.0]
  assert idle == loaded  # every estimate, μ and decision, bit for bit
  decided = [r for r in idle if "auto/mu_measured" in r]
  assert len(decided) == 2 and all(r["auto/mu_measured"] == r["mu_flops"] for r in decided)
  ledgers = [s["ledger"] for s in summaries]
  assert ledgers[0]["mu_flops"] == ledgers[1]["mu_flops"] > 0  # recorded beside ...
  # ... the wall-time μ, from timers that saw every round's extra 0.3 s (compared with the
  # idle run's μ it is not an inequality that must hold: either run may pay the compiles)
  assert len(rounds) >= 4 and summaries[1]["generate_s"] >= 0.3 * len(rounds)
  assert ledgers[1]["mu_time"] == accounting.summarize(
      {k: summaries[1]["ledger"][k] for k in COUNTS}, summaries[1])["mu_time"]

  # the paper's μ = 5.3 puts y* = 3.2 above y_max = 2: R stays at B / 2 = 8
  run(_config(tmp_path / "configured", cache, mu_source="configured", mu=5.3))
  configured = _decisions(tmp_path / "configured")
  assert [r["auto/R"] for r in configured] == [8.0] * 4
  assert [(r["auto/mu_measured"], r["auto/y"]) for r in configured
          if "auto/mu_measured" in r] == [(5.3, 2.0)] * 2


def test_a_configured_mu_needs_its_value(tmp_path):
  validate(_config(tmp_path, tmp_path, mu_source="configured", mu=5.3))
  with pytest.raises(ConfigError, match=r"^config\.auto_replay\.mu=None is invalid: must be "
                                        r"a number > 0 with auto_replay\.mu_source='configured'"):
    validate(_config(tmp_path, tmp_path, mu_source="configured"))
