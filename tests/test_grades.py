"""Strict and lenient grades: ``math_answer.verify_boxed`` (only the last box counts) and
``verify_last_number`` (the last number, no format needed) on hand-made completions; the
``boxed`` answer extraction; every evaluation of a math-graded task graded both ways through
the reward's scorer (failures counted), in its metrics, summary and records."""

import os
import random

import jax
import numpy as np
import pytest

from jaxreplay import config as config_lib
from jaxreplay.main import summary_lines
from jaxreplay.tasks import make_task
from jaxreplay.tasks.base import Example
from jaxreplay.tasks.file_task import ExactMatchReward
from jaxreplay.tasks.math_answer import (BoxedReward, MathReward, boxed_answer, parse_gold,
                                         verify_boxed, verify_last_number)
from jaxreplay.tasks.scoring import Scorer
from jaxreplay.train import evaluate as evaluate_lib
from jaxreplay.train import samples
from scoring_faults import FaultyGrades

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (gold, completion, strict, lenient)
GRADES = [
    ("12", "3 * 4 = 12, so \\boxed{12}", 1.0, 1.0),  # boxed right
    ("12", "3 * 4 = 13, so \\boxed{13}", 0.0, 0.0),  # boxed wrong
    ("12", "3 * 4 = 12", 0.0, 1.0),  # no box, right last number
    ("12", "The answer is 12.", 0.0, 1.0),  # a final period is no decimal point
    ("12", "12, no wait: \\boxed{13}", 0.0, 0.0),  # right number, then a wrong box
    ("12", "\\boxed{13}, no wait: 12", 0.0, 1.0),  # a wrong box, then the right number
    ("12", "\\boxed{12} after 20 tries", 1.0, 0.0),  # a number after the right box
    ("12", "\\boxed{13} then \\boxed{12}", 1.0, 1.0),  # the last box wins
    ("12", "\\boxed{12} then \\boxed{13}", 0.0, 0.0),
    ("12", "\\boxed{12.0}", 1.0, 1.0),  # numerically equal
    ("12", "twelve is 12.0", 0.0, 1.0),
    ("12", "\\fbox{12}", 1.0, 1.0),
    ("12", "\\boxed{12", 0.0, 1.0),  # an unclosed box is no box; its number still counts
    ("12", "\\boxed{}", 0.0, 0.0),
    ("12", "<think>it is \\boxed{12}", 0.0, 1.0),  # stopped while reasoning: no boxed answer
    ("12", "<think>maybe \\boxed{13}</think> \\boxed{12}", 1.0, 1.0),
    ("12", "<think>\\boxed{12}</think> so 12", 0.0, 1.0),  # a box inside the think block
    ("12", "<answer>12</answer>", 0.0, 1.0),  # an answer tag is not a box
    ("-5", "x = -5", 0.0, 1.0),  # negative numbers
    ("-5", "\\boxed{-5}", 1.0, 1.0),
    ("-5", "\\boxed{\u22125}", 1.0, 1.0),  # the unicode minus is a minus
    ("-5", "x = \u22125", 0.0, 1.0),
    ("5", "x = -5", 0.0, 0.0),  # the sign is kept
    ("-5", "(-5)", 0.0, 1.0),
    ("2", "5-3", 0.0, 0.0),  # "5-3" is a subtraction: its last number is 3
    ("3", "5-3", 0.0, 1.0),
    ("-3", "5-3", 0.0, 0.0),
    ("2", "5-3 = 2", 0.0, 1.0),
    ("1200", "1,200 apples", 0.0, 1.0),  # thousands separators
    ("1200", "\\boxed{1,200}", 1.0, 1.0),
    ("1200", "\\boxed{1{,}200}", 1.0, 1.0),
    ("1200000", "1,200,000", 0.0, 1.0),
    ("12", "1,2", 0.0, 0.0),  # a comma before one digit is a list: "1,2" reads 2
    ("2", "1,2", 0.0, 1.0),
    ("12", "\\boxed{1,2}", 0.0, 0.0),
    ("0.75", "3/4", 0.0, 1.0),  # a plain fraction
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", 1.0, 0.0),  # LaTeX is not read leniently
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0, 1.0),
    ("12", "", 0.0, 0.0),  # empty
    ("12", "}{}{\\boxed{ ))(( $$ \\frac{", 0.0, 0.0),  # garbage
    ("12", "no number here", 0.0, 0.0),
]


@pytest.mark.parametrize("gold,completion,strict,lenient", GRADES)
def test_strict_and_lenient_grades_of_hand_made_completions(gold, completion, strict, lenient):
  g = parse_gold(gold)
  assert verify_boxed(g, completion) == strict
  assert verify_last_number(g, completion) == lenient


def test_grades_never_raise_and_an_invalid_gold_scores_zero():
  rng = random.Random(0)
  alphabet = "0123456789-.,/{}\\$%<>boxed think answer\u2212 "
  g = parse_gold("7")
  for _ in range(300):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
    assert verify_boxed(g, text) in (0.0, 1.0) and verify_last_number(g, text) in (0.0, 1.0)
  assert verify_boxed(None, "\\boxed{7}") == 0.0 and verify_last_number(None, "7") == 0.0
  assert boxed_answer("a \\boxed{ 7 } b") == "7" and boxed_answer("<think>\\boxed{7}") is None


def test_the_boxed_extraction_is_validated_with_the_field_and_its_choices():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "default.py"))
  c.task.update(answer_extraction="boxd", reward_workers=1)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, device_count=1)
  msg = str(e.value)
  assert msg.startswith("config.task.answer_extraction='boxd' is invalid") and "\n" not in msg
  assert "('bare', 'math', 'boxed')" in msg and "did you mean 'boxed'" in msg
  c.task.update(answer_extraction="boxed", reward_workers=0)  # math-verify needs a pool
  with pytest.raises(config_lib.ConfigError,
                     match=r"^config.task.reward_workers=0 is invalid: task.answer_extraction="
                           r"'boxed' needs a process pool"):
    config_lib.validate(c, device_count=1)
  c.task.update(reward_workers=1)
  assert config_lib.validate(c, device_count=1).task.answer_extraction == "boxed"


def _example(answer):
  return Example(prompt=f"what is {answer}?", answer=answer, gold=parse_gold(answer))


def test_a_boxed_task_rewards_only_its_last_box_in_a_worker(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"question": "6 times 7?", "answer": "42"}\n'
                  '{"question": "9 minus 4?", "answer": "5"}\n')
  task = make_task(dict(source="jsonl", name="", kwargs={}, train_path=str(path),
                        heldout_path=str(path), prompt_template="{question}",
                        answer_extraction="boxed", reward_workers=1,
                        reward_timeout_s=30.0))
  try:
    assert isinstance(task.reward_fn, BoxedReward) and task.scorer.workers == 1
    ex = {e.answer: e for e in task.heldout}["42"]
    texts = ["\\boxed{42}", "The answer is 42.", "#### 42", "\\boxed{41}", "42 \\boxed{"]
    rewards, failures = task.scorer(texts, [ex] * 5)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0] and failures == 0
    lenient, failures = task.scorer(texts, [ex] * 5, grader="lenient")
    assert lenient.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0] and failures == 0
    assert samples.extracted_answer(task, "so \\boxed{41} then \\boxed{42}.") == "42"
    with pytest.raises(ValueError, match="grader 'loose' is not one of BoxedReward's graders "
                                         r"\('strict', 'lenient'\)"):
      task.scorer(texts, [ex] * 5, grader="loose")
  finally:
    task.scorer.close()


def test_a_grader_that_crashes_its_worker_or_raises_scores_zero_and_is_counted():
  ex = _example("12")
  texts = ["\\boxed{12} crash", "12 raise", "\\boxed{12}", "so 12"]
  pool = Scorer(FaultyGrades(), workers=1, timeout_s=30.0)
  try:
    strict, f_strict = pool(texts, [ex] * 4, grader="strict")
    lenient, f_lenient = pool(texts, [ex] * 4, grader="lenient")
    rewards, f_reward = pool(texts, [ex] * 4)
  finally:
    pool.close()
  assert strict.tolist() == [0.0, 0.0, 1.0, 0.0] and f_strict == 1
  assert lenient.tolist() == [1.0, 0.0, 1.0, 1.0] and f_lenient == 1
  assert rewards.tolist() == [1.0, 1.0, 1.0, 1.0] and f_reward == 0
  assert pool.stats.crashes == 1 and pool.stats.restarts == 1
  local = Scorer(FaultyGrades(), workers=0, timeout_s=None)  # in process: a raise only
  assert local(texts[1:], [ex] * 3, grader="lenient")[1] == 1


# --- evaluation --------------------------------------------------------------------------

GOLDS = ["12", "-3"]
S = 2
# Greedy: one per example; sampled: S per example, consecutively.
GREEDY = ["\\boxed{12}", "so it is -3"]
SAMPLED = ["12 then \\boxed{13}", "1,2", "5-8 = -3", "\\boxed{-3} from 5 - 8"]
# Hand-computed, per completion:
#   reward ("math": the stated answer)  greedy [1, 1]  sampled [0, 0, 1, 1]
#   strict (last box)                   greedy [1, 0]  sampled [0, 0, 0, 1]
#   lenient (last number)               greedy [1, 1]  sampled [0, 0, 1, 0]
EXPECTED = {"acc_greedy": 1.0, "acc_sampled": 0.5, "acc_greedy_strict": 0.5,
            "acc_sampled_strict": 0.25, "acc_greedy_lenient": 1.0, "acc_sampled_lenient": 0.25}
BARE_KEYS = {"acc_greedy", "acc_sampled", "len_sampled", "entropy_fresh", "reward_failures",
             "pass@1", "pass@2"}


class _ScriptedIO:
  """Text I/O of the scripted policy: token t of a completion decodes to ``TEXTS[t]``."""

  eos_ids, pad_id = (0,), 0

  def __init__(self, texts):
    self.texts = texts

  def prompts(self, examples):
    n = len(examples)
    return np.ones((n, 2), np.int32), np.ones((n, 2), bool), np.ones((n,), bool)

  def decode(self, tokens, mask):
    return [self.texts[int(row[0])] for row in tokens]


@pytest.fixture
def scripted_policy(monkeypatch):
  """A policy whose greedy pass answers ``GREEDY`` and whose sampled pass ``SAMPLED``: the
  decode engine is replaced by the script (one token per completion, the index of its text)
  and the fresh-sample entropy by a constant."""
  texts = GREEDY + SAMPLED

  class Gen:
    def __init__(self, tokens):
      self.tokens = tokens
      self.mask = np.ones(tokens.shape, bool)
      self.length = np.ones((tokens.shape[0],), np.int32)

  def scripted(graphdef, params, toks, mask, key, *, temperature, group_size=1, **kw):
    first = 0 if temperature == 0 else len(GREEDY)
    n = toks.shape[0] * group_size
    assert n == (len(GREEDY) if temperature == 0 else len(SAMPLED))
    return Gen(np.arange(first, first + n, dtype=np.int32)[:, None])

  monkeypatch.setattr(evaluate_lib, "generate", scripted)
  monkeypatch.setattr(evaluate_lib, "_entropy_sum",
                      lambda *a, **k: (np.float32(0.5), np.int32(1)))
  return _ScriptedIO(texts)


class _Task:
  def __init__(self, extraction, scorer):
    self.answer_extraction, self.scorer = extraction, scorer


def _evaluate(io, task, record=()):
  return evaluate_lib.evaluate(None, None, io, task, [_example(g) for g in GOLDS],
                               jax.random.key(0), max_new_tokens=1, temperature=1.0,
                               samples_per_example=S, record=record)


def test_evaluate_grades_both_passes_strictly_and_leniently_in_a_worker(scripted_policy):
  scorer = Scorer(MathReward(), workers=1, timeout_s=30.0)
  try:
    out = _evaluate(scripted_policy, _Task("math", scorer), record=[1])
  finally:
    scorer.close()
  recs = out.pop("samples")
  assert set(out) == BARE_KEYS | set(EXPECTED) | {"grade_failures"}
  assert {k: out[k] for k in EXPECTED} == EXPECTED
  assert out["reward_failures"] == 0 and out["grade_failures"] == 0
  # pass@k counts the reward: example 0 has 0 of 2 right, example 1 has 2 of 2
  assert out["pass@1"] == 0.5 and out["pass@2"] == 0.5
  # the records of question 1 carry each grade: greedy, then its two samples
  assert [(r["mode"], r["reward"], r["strict"], r["lenient"]) for r in recs] == [
      ("greedy", 1.0, 0.0, 1.0), ("sampled", 1.0, 0.0, 1.0), ("sampled", 1.0, 1.0, 0.0)]
  assert set(recs[0]) == set(samples.EVAL_FIELDS) - {"step"} | {"strict", "lenient"}


def test_a_grading_failure_in_evaluation_scores_zero_and_is_counted(scripted_policy,
                                                                    monkeypatch):
  monkeypatch.setattr(scripted_policy, "texts",
                      ["\\boxed{12} crash", "so it is -3 raise"] + SAMPLED)
  scorer = Scorer(FaultyGrades(), workers=1, timeout_s=30.0)
  try:
    out = _evaluate(scripted_policy, _Task("math", scorer))
  finally:
    scorer.close()
  # greedy: the strict call of completion 0 lost its worker, the lenient one of 1 raised
  assert out["acc_greedy"] == 1.0 and out["reward_failures"] == 0
  assert out["acc_greedy_strict"] == 0.0 and out["acc_greedy_lenient"] == 0.5
  assert out["grade_failures"] == 2 and scorer.stats.crashes == 1


class _Counting(BoxedReward):
  """``BoxedReward`` that counts its calls (in this process: a scorer with 0 workers)."""

  calls = None

  def __call__(self, completion, example):
    self.calls["reward"] += 1
    return super().__call__(completion, example)

  def strict(self, completion, example):
    self.calls["strict"] += 1
    return super().strict(completion, example)

  def lenient(self, completion, example):
    self.calls["lenient"] += 1
    return super().lenient(completion, example)


def test_a_boxed_task_reuses_its_rewards_as_the_strict_grade(scripted_policy):
  fn = _Counting()
  fn.calls = {"reward": 0, "strict": 0, "lenient": 0}
  out = _evaluate(scripted_policy, _Task("boxed", Scorer(fn, workers=0, timeout_s=None)))
  n = len(GREEDY) + len(SAMPLED)
  assert fn.calls == {"reward": n, "strict": 0, "lenient": n}
  # the reward is the strict grade
  assert out["acc_greedy"] == out["acc_greedy_strict"] == EXPECTED["acc_greedy_strict"]
  assert out["acc_sampled"] == out["acc_sampled_strict"] == EXPECTED["acc_sampled_strict"]
  assert out["acc_sampled_lenient"] == EXPECTED["acc_sampled_lenient"]
  assert out["pass@2"] == 0.5  # only example 1 has a boxed right answer


class _CountingScorer(Scorer):
  def __init__(self, *a, **k):
    super().__init__(*a, **k)
    self.calls = []

  def __call__(self, texts, examples, grader=None):
    self.calls.append(grader)
    return super().__call__(texts, examples, grader=grader)


def test_a_bare_task_is_evaluated_as_before_with_no_grading(scripted_policy, monkeypatch):
  monkeypatch.setattr(scripted_policy, "texts", ["12", "-3", "12", "1", "-3", "-3"])
  scorer = _CountingScorer(ExactMatchReward(), workers=0, timeout_s=None)
  out = _evaluate(scripted_policy, _Task("bare", scorer))
  assert set(out) == BARE_KEYS and scorer.calls == [None, None]  # one call per pass
  assert out["acc_greedy"] == 1.0 and out["acc_sampled"] == 0.75
  assert evaluate_lib.grader_names(_Task("bare", scorer)) == ()
  # a math task whose reward function was swapped for one without graders: none either
  assert evaluate_lib.grader_names(_Task("math", scorer)) == ()
  assert evaluate_lib.grader_names(_Task("boxed", Scorer(BoxedReward()))) == ("strict",
                                                                             "lenient")


def test_the_summary_prints_strict_and_lenient_before_and_after():
  s = dict(acc_sampled_before=0.25, acc_sampled_after=0.5, acc_greedy_before=0.0,
           acc_greedy_after=0.75, generated_tokens=10, trained_tokens=20, generated_rollouts=4,
           ledger={}, generate_s=1.0, train_s=1.0, eval_s=1.0, wall_seconds=60.0,
           checkpoints="c", base_policy="b")
  assert not any("strict" in line or "lenient" in line for line in summary_lines(s, 1.0))
  for g, before, after in (("strict", 0.125, 0.625), ("lenient", 0.375, 0.5)):
    s.update({f"acc_sampled_{g}_before": before, f"acc_sampled_{g}_after": after,
              f"acc_greedy_{g}_before": before / 2, f"acc_greedy_{g}_after": after / 2})
  lines = summary_lines(s, 1.0)
  assert lines[3] == ("held-out accuracy, strict (last \\boxed{} only), sampled: 0.125 -> "
                      "0.625, greedy: 0.062 -> 0.312")
  assert lines[4] == ("held-out accuracy, lenient (last number, any format), sampled: 0.375 -> "
                      "0.500, greedy: 0.188 -> 0.250")
