"""Recorded completions: ``samples/eval_STEP.jsonl`` for the same held-out questions every
evaluation, ``samples/train_STEP.jsonl`` with the rows a learner step trained on; a resumed
run writes the same files as an uninterrupted one; ``log.progress=False`` prints no bar. The
async and split learners' records are checked on the runs of ``test_train_modes`` and
``test_split``."""

import json
import os

import numpy as np
import pytest

from jaxreplay.train import samples
from jaxreplay.tasks.base import Example
from conftest import run, tiny_run_config

M, S, K, REC = 6, 2, 3, 4  # max_new_tokens, samples per example, rollouts per file, questions


def _quiet(*_):
  pass


def _config(workdir, cache, **overrides):
  return tiny_run_config(workdir, cache, **{"eval.record": REC, "log.record_rollouts": K,
                                            **overrides})


def _read(workdir):
  d = os.path.join(workdir, "samples")
  return {f: [json.loads(line) for line in open(os.path.join(d, f))] for f in sorted(os.listdir(d))}


def test_record_indices_are_a_fixed_seeded_subset():
  a = samples.record_indices(100, 16, seed=3)
  assert a == samples.record_indices(100, 16, seed=3) and len(set(a)) == 16
  assert a == sorted(a) and 0 <= a[0] and a[-1] < 100
  assert a != samples.record_indices(100, 16, seed=4)
  assert samples.record_indices(5, 16, seed=3) == [0, 1, 2, 3, 4]
  assert samples.record_indices(5, 0, seed=3) == []


def test_eval_records_take_greedy_then_each_sample():
  class Bare:
    answer_extraction = "bare"
  ex = [Example("1 + 1 =", "2"), Example("2 + 3 =", "5")]
  recs = samples.eval_records(Bare(), ex, [1], (["x", " 5"], [0.0, 1.0], [1, 2]),
                              (["a", "b", " 5", " = 4"], [0.0, 0.0, 1.0, 0.0], [1, 1, 2, 3]), 2)
  assert [(r["question_id"], r["mode"], r["sample"], r["completion"], r["extracted"],
           r["reward"], r["completion_tokens"]) for r in recs] == [
      (1, "greedy", 0, " 5", "5", 1.0, 2), (1, "sampled", 0, " 5", "5", 1.0, 2),
      (1, "sampled", 1, " = 4", "4", 0.0, 3)]
  assert all(r["gold"] == "5" and r["prompt"] == "2 + 3 =" for r in recs)


@pytest.mark.slow
def test_a_run_records_its_completions_and_prints_no_bar(base_policy_cache, tmp_path, capfd):
  wd = tmp_path / "run"
  c = _config(wd, base_policy_cache)  # 6 steps, evaluations at 0, 3, 6 (8 questions × 2)
  assert c.log.progress is False
  run(c, log=_quiet)
  out, err = capfd.readouterr()
  assert "it/s" not in out + err and "chunk" not in out + err and "%|" not in out + err
  files = _read(wd)
  assert sorted(files) == ["eval_0.jsonl", "eval_3.jsonl", "eval_6.jsonl", "train_3.jsonl",
                           "train_6.jsonl"]  # log.record_every unset: eval.every
  from jaxreplay.tasks import make_task
  from jaxreplay.config import validate
  heldout = make_task(validate(c).task).heldout
  ids = None
  for step in (0, 3, 6):
    recs = files[f"eval_{step}.jsonl"]
    assert len(recs) == REC * (1 + S)
    assert all(set(r) == set(samples.EVAL_FIELDS) and r["step"] == step for r in recs)
    q = sorted({r["question_id"] for r in recs})
    assert ids is None or q == ids  # the same questions every evaluation
    ids = q
    for r in recs:
      e = heldout[r["question_id"]]
      assert r["prompt"] == e.prompt and r["gold"] == e.answer
      assert r["reward"] in (0.0, 1.0) and 1 <= r["completion_tokens"] <= M
      assert r["reward"] == (1.0 if r["extracted"] == e.answer else 0.0)
    assert [r["mode"] for r in recs[:1 + S]] == ["greedy"] + ["sampled"] * S
  assert ids == samples.record_indices(8, REC, c.seed)
  metrics = [json.loads(line) for line in open(wd / "metrics" / "000000.jsonl")]
  for step in (3, 6):
    recs = files[f"train_{step}.jsonl"]
    assert len(recs) == K and [r["row"] for r in recs] == list(range(K))
    for r in recs:
      assert set(r) == set(samples.TRAIN_FIELDS) and r["step"] == step
      # step t trains version t - 1 on rollouts of versions <= t - 1
      assert r["staleness"] == step - 1 - r["policy_version"] >= 0
      assert r["newest_version"] >= r["policy_version"]
      assert 1 <= r["completion_tokens"] <= M and r["prompt"].endswith("=")
      assert np.isfinite(r["importance_ratio_mean"]) and r["importance_ratio_mean"] > 0
    # the rows are the learner's own draw: their staleness is within the step's histogram
    hist = next(m["staleness_hist"] for m in metrics if m.get("step") == step
                and "staleness_hist" in m)
    for r in recs:
      assert hist[r["staleness"]] > 0


@pytest.mark.slow
def test_a_resumed_run_writes_the_files_of_an_uninterrupted_one(base_policy_cache, tmp_path):
  full = tmp_path / "full"
  run(_config(full, base_policy_cache, **{"log.record_every": 2}), log=_quiet)
  part = tmp_path / "part"
  run(_config(part, base_policy_cache, **{"log.record_every": 2, "train.steps": 3}), log=_quiet)
  first = _read(part)
  assert sorted(first) == ["eval_0.jsonl", "eval_3.jsonl", "train_2.jsonl"]
  run(_config(part, base_policy_cache, **{"log.record_every": 2}), log=_quiet)  # resumes at 3
  a, b = _read(full), _read(part)
  assert sorted(a) == ["eval_0.jsonl", "eval_3.jsonl", "eval_6.jsonl", "train_2.jsonl",
                       "train_4.jsonl", "train_6.jsonl"]
  assert sorted(b) == sorted(a)
  for f in a:
    assert b[f] == a[f], f


@pytest.mark.parametrize("field,value", [("eval.record", -1), ("log.record_every", -2),
                                         ("log.record_rollouts", 0)])
def test_bad_recording_fields_name_the_field(tmp_path, field, value):
  from jaxreplay.config import ConfigError, validate
  with pytest.raises(ConfigError, match=rf"^config\.{field}={value} is invalid: must be >= "):
    validate(_config(tmp_path, tmp_path, **{field: value}))


def test_records_go_to_tensorboard_as_text(tmp_path):
  from jaxreplay.train.metrics import MetricWriter
  w = MetricWriter(tmp_path, tensorboard=True, primary=True)
  recs = [{"step": 3, "question_id": 7, "mode": "greedy", "sample": 0, "prompt": "2 + 3 =",
           "completion": " 5", "extracted": "5", "gold": "5", "reward": 1.0,
           "completion_tokens": 2}]
  text = samples.as_text(recs)
  assert text == ("- question_id=7, mode=greedy, sample=0, extracted=5, gold=5, reward=1.0, "
                  "completion_tokens=2: `2 + 3 =` → ` 5`")
  w.text(3, "samples/eval", text)
  w.close()
  (event,) = list((tmp_path / "tb").iterdir())
  assert "`2 + 3 =` → ` 5`".encode() in event.read_bytes()
