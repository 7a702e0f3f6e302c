"""The zero-advantage options through the whole trainer, on-policy on a tiny config: the
learner leaves out exactly the rollouts of the groups whose rewards were all equal, and a step
with no informative group leaves the weights alone."""

import numpy as np
import pytest

from conftest import run, tiny_run_config
from jaxreplay.train.metrics import read_metrics


@pytest.mark.slow
def test_the_learner_drops_exactly_the_equal_reward_groups(tmp_path, base_policy_cache):
  # on-policy (N = R = B): each learner batch is the step's generation, so the fraction it
  # leaves out is the fraction of groups without a reward spread, 1 - frac_mixed_groups
  c = tiny_run_config(tmp_path, base_policy_cache, **{
      "rollout.per_step": 32, "buffer.capacity": 32, "train.batch_size": 32, "train.steps": 4,
      "eval.every": 4, "checkpoint.every": 4, "drift.every": 0, "warmstart.steps": 200,
      "task.kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
      "algo.drop_zero_advantage": True, "algo.skip_zero_gradient": True})
  run(c, lambda *_: None)
  steps = [m for m in read_metrics(str(tmp_path)) if m.get("step", 0) >= 1 and "reward" in m]
  assert [m["step"] for m in steps] == [1, 2, 3, 4]
  for m in steps:
    assert np.isclose(m["dropped_zero_advantage"], 1.0 - m["frac_mixed_groups"], atol=1e-6), m
    assert m["zero_gradient_skipped"] == float(m["frac_mixed_groups"] == 0.0), m
    assert (m["grad_norm"] > 0) == (m["frac_mixed_groups"] > 0), m
  # the tiny policy's groups are mixed at least once, and not always all of them
  fracs = [m["frac_mixed_groups"] for m in steps]
  assert 0 < max(fracs) and min(fracs) < 1, fracs
