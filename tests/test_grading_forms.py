"""The math reward on completions written the way Qwen-, DeepSeek- and Minerva-style models
write them (issue 26), and every class where it departs from math-verify's parse + verify on
the raw completion or from lm-eval's Minerva-math rules (bench/grading_agreement.py), each
with the reason it is decided the project's way. Expected rewards are worked out by hand."""

import os
import sys

import pytest

from jaxreplay.tasks.base import Example
from jaxreplay.tasks.math_answer import (expand_repeating_decimals, extract_answer_text, is_prose,
                                         parse_gold, to_ascii_math, verify_answer,
                                         with_parsed_gold)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

VECTOR = r"\begin{pmatrix} 1 \\ -2 \end{pmatrix}"
MATRIX = r"\begin{pmatrix} 3 & 1 \\ 0 & 2 \end{pmatrix}"


def reward(gold, completion):
  return verify_answer(parse_gold(gold), completion)


# (gold, completion, expected reward, why)
FORMS = [
    # Vectors and matrices are golds (MATH precalculus / linear algebra), not prose.
    (VECTOR, rf"so $\boxed{{{VECTOR}}}$.", 1.0, "column vector, same entries"),
    (VECTOR, r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", 0.0, "second entry 2, not -2"),
    (MATRIX, rf"\boxed{{{MATRIX}}}", 1.0, "2x2 matrix, same entries"),
    (MATRIX, r"\boxed{\begin{pmatrix} 3 & 1 \\ 0 & 3 \end{pmatrix}}", 0.0, "entry (2,2) is 3"),
    # Unboxed LaTeX: the Minerva sentence and "The answer is $...$" read the math span, not
    # the last digit in it (the old last-number rule read 8 and 2 here).
    (r"\frac{3}{8}", "Final Answer: The final answer is $\\frac{3}{8}$. I hope it is correct.", 1.0,
     "Minerva sentence"),
    ("8", "Final Answer: The final answer is $\\frac{3}{8}$. I hope it is correct.", 0.0,
     "3/8 is not 8"),
    (r"-\frac{7}{2}", "So 2x = -7. The answer is $-\\frac{7}{2}$.", 1.0, "answer clause span"),
    ("2", "So 2x = -7. The answer is $-\\frac{7}{2}$.", 0.0, "-7/2 is not 2"),
    ("5", "Hence the result is \\(5\\).", 1.0, "\\( \\) span"),
    ("5", "Hence\n\\[ x = 5 \\]", 1.0, "\\[ \\] span holding x = 5"),
    ("7", "Answer: $7$", 1.0, "answer: clause"),
    ("18", "The answer is 18 apples.", 1.0, "clause with a unit word"),
    # Thousands separators in every form on every path.
    ("1000", "They paid 1{,}000 dollars.", 1.0, "{,} outside a box"),
    ("0", "They paid 1{,}000 dollars.", 0.0, "1{,}000 is 1000, not the group 000"),
    ("10000", "The answer is $10,\\!000$.", 1.0, "MATH's ,\\! separator"),
    ("1250", "The answer is $1\\,250$.", 1.0, "thin space \\,"),
    ("1250", "In total 1\u2009250 people came.", 1.0, "unicode thin space"),
    ("10000", r"10,\!000", 1.0, "separator on the last-number path"),
    # The unicode minus and full-width digits.
    ("5", "The answer is \u22125.", 0.0, "−5 is -5: dropping the sign would score 1"),
    ("-5", "The answer is \u22125.", 1.0, "−5 is -5"),
    ("-5", "So the change is \u22125.", 1.0, "unicode minus on the bare-number path"),
    ("18", "The answer is \uff11\uff18.", 1.0, "full-width digits"),
    # boxed{...} written without its backslash.
    ("7", "So the answer is boxed{7}.", 1.0, "box without backslash"),
    ("6", "So the answer is boxed{7}.", 0.0, "box without backslash, other value"),
    ("7", "I boxed the result: 7", 1.0, "the word boxed with no brace is prose"),
    # An answer tag holding a sentence goes through math-verify's extraction.
    ("18", "<think>9 * 2 = 18</think><answer>The total is 18 eggs</answer>", 1.0, "prose tag"),
    ("17", "<think>9 * 2 = 18</think><answer>The total is 18 eggs</answer>", 0.0,
     "prose tag, other value (not a product of letters)"),
    ("x^2+1", "<answer>The answer is $x^2 + 1$.</answer>", 1.0, "prose tag with a span"),
    (r"\frac{1}{2}", "<answer>$\\frac{1}{2}$</answer>", 1.0, "tag holding one span"),
    # Repeating decimals are converted exactly: 0.\overline{27} = 27/99 = 3/11.
    (r"0.\overline{27}", r"\boxed{\frac{3}{11}}", 1.0, "27/99 = 3/11"),
    (r"0.\overline{27}", r"\boxed{0.\overline{27}}", 1.0, "same repeating decimal"),
    (r"0.\overline{27}", r"\boxed{0}", 0.0, "math-verify alone reads the gold as 0"),
    (r"0.\overline{27}", r"\boxed{0.\overline{28}}", 0.0, "28/99 is another number"),
    (r"0.1\overline{6}", r"\boxed{\frac{1}{6}}", 1.0, "(16 - 1)/90 = 1/6"),
    (r"\frac{1}{3}", r"\boxed{0.\overline{3}}", 1.0, "3/9 = 1/3"),
    # Sets, intervals, equations and values joined by "and" / "or".
    (r"\{1, 2, 3\}", "So we get $1$, $2$, and $3$.", 1.0, "three spans are one set"),
    (r"\{1, 2, 3\}", "So we get $1$, $2$, and $4$.", 0.0, "{1, 2, 4}"),
    (r"\pm 2", "The answer is $2$ or $-2$.", 1.0, "± 2 = {2, -2}"),
    (r"(-\infty, 3]", r"\boxed{(-\infty, 3]}", 1.0, "interval"),
    (r"(-\infty, 3]", r"\boxed{(-\infty, 3)}", 0.0, "open at 3"),
    ("y = 2x + 3", "So the line is $y = 2x + 3$.", 1.0, "equation"),
    ("-5", "The answer is -5%.", 1.0, "a plain percentage as math-verify reads it"),
]


@pytest.mark.parametrize("gold,completion,expected,why", FORMS,
                         ids=[f"{i}:{w}" for i, (_, _, _, w) in enumerate(FORMS)])
def test_completion_forms(gold, completion, expected, why):
  assert reward(gold, completion) == expected, why


# Classes where the reward departs from math-verify on the raw completion and/or the Minerva
# rules (bench/grading_agreement.py), decided the project's way: (gold, completion, reward,
# what math-verify's parse + verify gives, reason).
DECIDED = [
    ("6", "<think>Maybe it is \\boxed{7}? Let me check.</think>\nThe answer is $6$.", 1.0, 0,
     "think_decoy_boxed: a box inside the reasoning is not the answer; the text after "
     "</think> is (math-verify and the Minerva box rule read the box in the think block)"),
    ("7", "<think>Maybe it is \\boxed{7}? Let me check.</think>\nThe answer is $6$.", 0.0, 1,
     "think_decoy_boxed: the stated answer 6 is wrong; the right value only in the reasoning"),
    ("7", "<think>12 + 7 = 19 and 19 - 4 = 15. So it is \\boxed{7}", 0.0, 1,
     "unclosed_think: a completion cut off while reasoning states no answer (rewarding it "
     "would teach the policy to leave <think> open)"),
    ("7", "I first got \\boxed{17}, but fixing the arithmetic gives \\boxed{7}.", 1.0, 0,
     "self_correction: the last box is the answer (math-verify's greedy box pattern does not "
     "read the last box)"),
    ("5", "The answer is $-5$. Check: 2 + 3 = 5, fine.", 0.0, 1,
     "answer_then_check: the answer clause's own sentence holds the answer; math-verify's "
     "'answer ... = N' pattern runs on into the check"),
    ("3", "We compute $12 - 5 = 7$.\nThus we get $13$, which took 3 steps.", 0.0, 1,
     "trailing_remark: a stated value span beats a later count in a remark (math-verify takes "
     "the rightmost of span and number: a false positive here)"),
    ("7", "<think>19 - 4 = 15.</think>\n<answer>7</answer>", 1.0, 0,
     "answer_tag: math-verify's numbers need a space before them, so >7< is not read"),
    ("7", "So the answer is boxed{7}.", 1.0, 0, "boxed_no_backslash: a box is a box"),
    ("72", "The answer is \uff17\uff12.", 1.0, 0, "fullwidth_digits: ７２ is 72"),
    ("1250", "In total they paid 1{,}250 dollars.", 1.0, 0, "sep_brace_text: 1{,}250 = 1250"),
    ("1250", "The answer is $1\\,250$.", 1.0, 0, "sep_thin_latex: 1\\,250 = 1250"),
    ("-5", "The answer is \u22125.", 1.0, 0, "unicode_minus_text: −5 = -5"),
    ("15", "19 - 4 = 15.\nThe answer is \u221215.", 0.0, 1,
     "unicode_minus_text: −15 is not 15 (math-verify drops the sign and the working's 15 "
     "scores)"),
    (r"0.\overline{27}", "Therefore, the answer is $\\boxed{0}$.", 0.0, 1,
     "repeating_as_zero: math-verify parses the gold 0.\\overline{27} as 0"),
]


@pytest.mark.parametrize("gold,completion,expected,mv,why", DECIDED,
                         ids=[w.split(":")[0] + f"-{i}" for i, (*_, w) in enumerate(DECIDED)])
def test_disagreement_classes_decided_for_the_project(gold, completion, expected, mv, why):
  from math_verify import parse, verify
  assert reward(gold, completion) == expected, why
  # ... and math-verify on the raw completion does give the other answer (the class exists).
  assert int(verify(parse(f"${gold}$"), parse(completion))) == mv


def test_span_rule_trade_off_a_value_span_beats_a_later_number():
  # Step 5 of the extraction: the last span wins unless it is a computation and a number
  # follows. A value span followed by the answer in words is therefore misread (the bench's
  # span_then_number class: reward 0 where the answer is right, never a free reward).
  assert extract_answer_text("She has $16 - 3 - 4 = 9$ eggs, so she makes 18 dollars.") == "18"
  assert extract_answer_text("Each costs $\\frac{1}{2}$ dollar, so in total it is 18.") == \
      "\\frac{1}{2}"
  assert extract_answer_text("He pays $5 and $6, so 11 in all.") == "11"  # currency, not math
  assert extract_answer_text("He pays $5 and $6.") == "6"


def test_golds_math_verify_parses_are_valid_and_lossy_ones_are_not():
  for gold in (VECTOR, MATRIX, r"(-\infty, 3]", r"\{1, 2, 3\}", "y = 2x + 3", r"x \in [1,2]",
               r"\text{odd}", r"2\frac{1}{4}", "18 dollars", r"10,\!000", "$\\dfrac{242}{311}$",
               r"0.\overline{27}"):
    assert parse_gold(gold) is not None, gold
  assert str(parse_gold(r"0.\overline{27}")[0]) == "3/11"
  assert str(parse_gold(r"2\frac{1}{4}")[0]) == "9/4"  # a mixed number
  assert str(parse_gold(r"10,\!000")[0]) == "10000"
  assert not is_prose(VECTOR) and is_prose("see figure")
  # Lossy: letters commute (odd = dod); an \overline over digits that is no repeating decimal.
  for gold in ("odd", "see figure", r"12\overline{3}"):
    assert parse_gold(gold) is None, gold
  exs = [Example("q", g) for g in (VECTOR, MATRIX, "odd", "7")]
  kept, dropped = with_parsed_gold(exs)
  assert [e.answer for e in kept] == [VECTOR, MATRIX, "7"] and dropped == 1


def test_repeating_decimals_and_ascii_by_hand():
  assert expand_repeating_decimals(r"0.\overline{27}") == r"\frac{3}{11}"  # 27/99
  assert expand_repeating_decimals(r"1.2\overline{3}") == r"\frac{37}{30}"  # 1 + 21/90
  assert expand_repeating_decimals(r"0.\overline{9}") == "1"
  assert expand_repeating_decimals(r".\overline 6") == r"\frac{2}{3}"
  assert expand_repeating_decimals(r"\overline{AB}") == r"\overline{AB}"  # a segment
  assert expand_repeating_decimals(r"12\overline{3}") is None
  assert to_ascii_math("\u22125 and \uff11\uff18") == "-5 and 18"
  assert to_ascii_math("x\u00b2") == "x\u00b2"  # not NFKC: x² stays


def test_the_bench_minerva_rules_by_hand():
  from grading_agreement import minerva_extract, minerva_grade, minerva_normalize
  assert minerva_extract("Final Answer: The final answer is $\\frac{3}{8}$. I hope it is "
                         "correct.") == "$\\frac{3}{8}$"
  assert minerva_extract("so \\boxed{7}.") == "7"
  assert minerva_extract("so \\boxed{7}.", box_fallback=False) is None
  assert minerva_normalize("x = 10,000") == "10000"
  assert minerva_normalize("$\\frac{3}{8}$") == "\\frac{3}{8}"
  assert minerva_normalize("5 inches") == "5"
  assert minerva_normalize("\\text{odd}") == "odd"
  assert minerva_normalize("\\frac12") == "\\frac{1}{2}"
  assert minerva_grade("0.5", "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is "
                              "correct.") == 1  # sympy: 1/2 - 0.5 simplifies to 0
  assert minerva_grade("7", "The answer is $7$.") == 0  # no sentence, no box
