"""The math reward: answer extraction, math-verify equivalence against a gold parsed once,
invalid gold answers, and scoring in worker processes that are killed at the timeout or
replaced when they die (cases 11 and 12 of ../shared/cases/CASES.md)."""

import os
import random
import time

import numpy as np
import pytest

from jaxreplay.tasks.base import Example, math_reward
from jaxreplay.tasks.math_answer import (MathReward, extract_answer_text, find_boxed, gsm8k_gold,
                                         math_gold, normalize_answer, parse_gold, verify_answer)
from jaxreplay.tasks.scoring import Scorer
from scoring_faults import FaultyReward, GatedReward

random.seed(0)
GARBAGE = "".join(random.choice("ab{}\\^_ 0123456789+-*/()[]$xyz") for _ in range(10_000))
# A completion whose answer makes sympy evaluate 9^(9^(9^9)): integer power in C that no
# signal interrupts (math-verify's own timeout cannot stop it); only killing the process can.
PATHOLOGICAL = "so the answer is \\boxed{9^{9^{9^{9}}}}"

# (gold, completion, expected reward)
FORMS = [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}.", 1.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("1000", "In total they paid 1,000 dollars.", 1.0),
    ("1000000", "\\boxed{1{,}000{,}000}", 1.0),
    ("1000", "\\boxed{1\\,000}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\tfrac34}", 1.0),
    ("\\frac{\\sqrt{3}}{2}", "so \\boxed{\\frac{\\sqrt{3}}{2}}", 1.0),  # nested braces
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{3}}", 0.0),
    ("7", "\\boxed{5}, no wait, corrected: \\boxed{7}", 1.0),  # the last box counts
    ("5", "\\boxed{5}, no wait, corrected: \\boxed{7}", 0.0),
    # Percent, math-verify's convention (GSM8K's golds for percent questions are the number):
    # "50\%" equals both 50 and 0.5; a bare 0.5 does not equal 50.
    ("0.5", "\\boxed{50\\%}", 1.0),
    ("50", "\\boxed{50\\%}", 1.0),
    ("50\\%", "\\boxed{0.5}", 1.0),
    ("50", "\\boxed{0.5}", 0.0),
    ("-3", "\\boxed{-3}", 1.0),
    ("-3", "\\boxed{3}", 0.0),
    ("-5", "It drops to 4 - 9 = -5 degrees.", 1.0),
    ("2", "5-3 = 2", 1.0),  # a binary minus is not a sign
    ("18", "", 0.0),  # missing answer
    ("18", "I am not sure.", 0.0),
    ("18", GARBAGE, 0.0),  # 10,000 characters of garbage
    ("18", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18", 1.0),
    ("18", "<answer>18</answer>", 1.0),
    ("18", "<answer>\\boxed{18}</answer>", 1.0),
    ("42", "\\fbox{42}", 1.0),
    ("18", "\\boxed{18 \\text{ dollars}}", 1.0),  # units stripped
    ("18", "\\boxed{\\$18}", 1.0),
    ("18.5", "\\boxed{18.50}", 1.0),
    ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}", 1.0),
    ("x^2+1", "\\boxed{1+x^2}", 1.0),
    ("(1,2)", "\\boxed{(1, 2)}", 1.0),
    ("9\\pi", "The area is \\boxed{9\\pi}", 1.0),
    ("18", "<think>so it is 18", 0.0),  # still thinking: no answer
    ("18", "<think>maybe 17</think> The answer is 18", 1.0),
    ("2", "\\boxed{2} and then \\boxed{", 0.0),  # unclosed last box: no answer
]


@pytest.mark.parametrize("gold,completion,expected", FORMS,
                         ids=[f"{i}:{g}" for i, (g, _, _) in enumerate(FORMS)])
def test_answer_forms(gold, completion, expected):
  assert verify_answer(parse_gold(gold), completion) == expected


def test_there_are_at_least_30_forms_with_both_outcomes():
  assert len(FORMS) >= 30
  assert {e for _, _, e in FORMS} == {0.0, 1.0}


def test_case_11_unparseable_gold_and_argument_order():
  gold = parse_gold("\\frac{63}{400}")
  assert verify_answer(gold, "... \\boxed{\\frac{64}{400}}") == 0.0
  assert verify_answer(gold, "\\boxed{\\frac{63}{400}}") == 1.0
  assert verify_answer(gold, "\\boxed{0.1575}") == 1.0  # numeric equivalence is supported
  for bad in ("", "see figure"):
    assert parse_gold(bad) is None  # the example is invalid (tasks exclude it) ...
    for completion in ("\\boxed{\\frac{63}{400}}", "see figure", "", "\\boxed{0}"):
      assert verify_answer(None, completion) == 0.0  # ... and never a free reward
      assert math_reward(bad, completion) == 0.0
  assert verify_answer(gold, "") == 0.0
  assert verify_answer(gold, "<think>let me consider 63/400 and") == 0.0


def test_case_11_verify_gets_the_gold_first(monkeypatch):
  import math_verify
  calls, real = [], math_verify.verify
  monkeypatch.setattr(math_verify, "verify", lambda g, t, **kw: calls.append((g, t)) or real(g, t, **kw))
  gold = parse_gold("\\frac{63}{400}")
  assert verify_answer(gold, "so \\boxed{0.1575}") == 1.0
  assert calls[0][0] is gold and calls[0][1][1] == "0.1575"  # verify(gold, prediction)


def test_case_11_a_batch_with_a_malformed_completion_gets_one_finite_reward_each():
  ex = Example("q", "\\frac{63}{400}", gold=parse_gold("\\frac{63}{400}"))
  texts = ["\\boxed{\\frac{63}{400}}", "\\boxed{\\frac{63}{400", "<think>...", "", GARBAGE]
  rewards, failures = Scorer(MathReward())(texts, [ex] * len(texts))
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0])
  assert rewards.dtype == np.float32 and failures == 0


def test_case_12_boxed_extraction():
  assert extract_answer_text("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
  assert verify_answer(parse_gold("\\frac{1}{2}"), "\\boxed{\\frac{1}{3}}") == 0.0
  assert normalize_answer("\\frac{1}{23}") == "\\frac{1}{23}"
  assert normalize_answer("\\frac{12}{3}") == "\\frac{12}{3}"
  assert verify_answer(parse_gold("\\frac{1}{23}"), "\\boxed{\\frac{12}{3}}") == 0.0
  assert verify_answer(parse_gold("42"), "<answer>\\boxed{42}</answer>") == 1.0
  assert extract_answer_text("\\boxed{5}... corrected: \\boxed{7}") == "7"
  assert extract_answer_text("\\boxed{\\frac{1}{2}") is None
  assert extract_answer_text("\\fbox{42}") == "42"
  assert verify_answer(parse_gold("42"), "\\boxed{42}.") == 1.0
  assert verify_answer(parse_gold("42"), "The answer is 42.") == 1.0


@pytest.mark.parametrize("text,expected", [
    ("a \\boxed{x^{2}} b", "x^{2}"), ("\\boxed {3}", "3"), ("no box", None), ("\\boxed", None),
    ("\\boxed{1} \\fbox{2}", "2"), ("\\fbox{1} \\boxed{\\{1,2\\}}", "\\{1,2\\}")])
def test_find_boxed(text, expected):
  assert find_boxed(text) == expected


def test_extraction_order_answer_tag_then_box_then_hashes_then_last_number():
  assert extract_answer_text("\\boxed{3} <answer>4</answer>") == "4"
  assert extract_answer_text("#### 5 then \\boxed{6}") == "6"
  assert extract_answer_text("1 and 2\n#### 7\nbye 9") == "7"
  assert extract_answer_text("from 1,200 to 1,350.") == "1,350"
  assert extract_answer_text("x = 5-3") == "3"
  assert extract_answer_text("it is -0.25") == "-0.25"
  assert extract_answer_text("<think>a</think> nothing") is None


def test_gold_of_each_format():
  assert gsm8k_gold("2 * 7 = <<2*7=14>>14 days.\n#### 14") == "14"
  assert gsm8k_gold("250 * 5 = 1,250\n#### 1,250") == "1250"
  assert gsm8k_gold("no final line 14") is None
  assert gsm8k_gold("####   ") is None
  assert math_gold(None, "so $x = \\boxed{\\frac{7}{8}}$.") == "\\frac{7}{8}"
  assert math_gold("\\frac{3}{2}", "boxed elsewhere \\boxed{9}") == "\\frac{3}{2}"  # answer wins
  assert math_gold("", "\\boxed{55}") == "55"
  assert math_gold(12, None) == "12"
  assert math_gold(None, "no box") is None
  assert parse_gold("\\text{Monday}") is not None  # text inside \text{} is an answer
  assert parse_gold("none of these") is None


# --- scoring in worker processes -------------------------------------------------------------

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def math_pool():
  pool = Scorer(MathReward(), workers=2, timeout_s=TIMEOUT_S)
  yield pool
  pool.close()


@pytest.fixture(scope="module")
def faulty_pool():
  pool = Scorer(FaultyReward(), workers=2, timeout_s=TIMEOUT_S)
  yield pool
  pool.close()


def test_a_completion_past_the_timeout_scores_zero_is_counted_and_its_worker_replaced(math_pool):
  ex = Example("q", "5", gold=parse_gold("5"))
  math_pool(["\\boxed{5}"], [ex])  # workers started and warm
  before = list(math_pool.pids)
  texts = ["\\boxed{5}", PATHOLOGICAL, "5", "\\boxed{6}", "#### 5"]
  t0 = time.monotonic()
  rewards, failures = math_pool(texts, [ex] * len(texts))
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(rewards, [1, 0, 1, 0, 1])
  assert failures == 1 and math_pool.stats.timeouts == 1 and math_pool.stats.restarts == 1
  assert elapsed >= TIMEOUT_S  # killed at its deadline, not before; the others then scored
  assert len(set(before) - set(math_pool.pids)) == 1  # the stuck worker was replaced
  # The same rewards as in-process scoring for every call that finished in time.
  rewards2, failures2 = math_pool(texts[:1] + texts[2:], [ex] * 4)
  np.testing.assert_array_equal(rewards2, [1, 1, 0, 1])
  assert failures2 == 0


def test_a_worker_that_dies_or_hangs_mid_call_costs_that_reward_only(faulty_pool):
  texts = ["ok", "crash", "no", "hang", "raise", "nan", "ok", "ok"]
  rewards, failures = faulty_pool(texts, [None] * len(texts))
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 0, 1, 1])
  assert failures == 4  # crash, hang, raise, nan
  s = faulty_pool.stats
  assert (s.crashes, s.timeouts, s.restarts) == (1, 1, 2)
  # A worker killed from outside while idle is replaced before it is given work.
  pid = faulty_pool.kill_worker(0)
  rewards, failures = faulty_pool(["ok", "no", "ok"], [None] * 3)
  np.testing.assert_array_equal(rewards, [1, 0, 1])
  assert failures == 0 and pid not in faulty_pool.pids
  assert faulty_pool.stats.restarts == 3


def test_a_worker_killed_while_starting_is_replaced(tmp_path):
  pool = Scorer(GatedReward(str(tmp_path)), workers=1, timeout_s=TIMEOUT_S)
  try:
    pool._pool.append(pool._start_worker())  # starting until tmp_path/go exists
    pid = pool.kill_worker(0)
    (tmp_path / "go").touch()  # its replacement starts
    rewards, failures = pool(["ok", "no", "ok"], [None] * 3)
    np.testing.assert_array_equal(rewards, [1, 0, 1])
    assert failures == 0 and pid not in pool.pids and pool.stats.restarts == 1
  finally:
    pool.close()


def test_in_process_scoring_matches_the_pool_and_refuses_a_pool_without_timeout(math_pool):
  ex = Example("q", "\\frac{1}{2}", gold=parse_gold("\\frac{1}{2}"))
  texts = [c for _, c, _ in FORMS[:12]]
  pooled, f1 = math_pool(texts, [ex] * len(texts))
  local, f2 = Scorer(MathReward(), workers=0, timeout_s=TIMEOUT_S)(texts, [ex] * len(texts))
  np.testing.assert_array_equal(pooled, local)
  assert f1 == f2 == 0 and pooled.sum() == 2  # 0.5 and \frac{1}{2}
  with pytest.raises(ValueError, match="timeout_s > 0"):
    Scorer(MathReward(), workers=2, timeout_s=0)
  with pytest.raises(ValueError, match="2 completions but 1 examples"):
    math_pool(["a", "b"], [ex])


def test_workers_exit_when_the_parent_closes_the_pool():
  pool = Scorer(FaultyReward(), workers=1, timeout_s=TIMEOUT_S)
  assert pool(["ok"], [None])[0][0] == 1.0
  (pid,) = pool.pids
  pool.close()
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)
