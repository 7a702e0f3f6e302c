"""Math answers: the final answer a completion states, the gold answer of a dataset row, and
their equivalence by math-verify.

Text only, no networks. The pieces:

* ``extract_answer_text(completion)``: the answer a chain-of-thought completion states, by
  the first rule that applies, in this order — the last closed ``<answer>...</answer>`` tag
  (a ``\\boxed{}`` inside it is unwrapped), the last ``\\boxed{...}`` / ``\\fbox{...}`` (a
  balanced-brace scan, so ``\\boxed{\\frac{1}{2}}`` keeps both braces; **the last box wins**,
  so a completion that corrects itself is graded on its correction; an unclosed last box is
  no answer), the last ``#### N`` line (GSM8K's own convention), the last number. Text after
  the last ``</think>`` is read; a ``<think>`` that is never closed means the completion
  stopped while reasoning: no answer.
* ``gsm8k_gold`` / ``math_gold``: the gold answer text of a GSM8K row (after ``####``) or of
  a MATH / OpenR1-Math row (its ``answer`` column, else the last ``\\boxed{}`` of its
  ``solution``).
* ``parse_gold``: math-verify's parse of a gold answer, done once per example when a task is
  built; ``None`` when the gold cannot be parsed (empty, prose such as ``"see figure"``, or
  nothing math-verify can read). Such an example is invalid: counted and excluded, never
  scored, and ``verify_answer`` gives 0.0 for it — never a free reward.
* ``verify_answer(gold, completion)``: 1.0 if the extracted answer is equivalent to the gold
  by ``math_verify.verify(gold, prediction)`` (gold first: math-verify's documented order),
  else 0.0.

Equivalence is math-verify's: fractions and decimals (``\\frac{1}{2}`` = ``0.5``, 6-digit
rounding), LaTeX forms (``\\dfrac``, ``\\tfrac``, ``\\sqrt{18}`` = ``3\\sqrt{2}``), symbolic
expressions, sets and intervals. Before parsing, a numeric answer loses its thousands
separators (``1,000``, ``1{,}000``, ``1\\,000``), a leading currency sign and trailing
unit words (``18 dollars``, ``18\\text{ eggs}``). Percentages follow math-verify's
convention, which is the GSM8K datasets' (gold ``25`` for "what percent ..."): ``50\\%``
equals both ``50`` and ``0.5``; without the ``%`` sign ``0.5`` does not equal ``50``.

math-verify's own timeouts use ``signal.alarm``, which only works on a process's main
thread and cannot interrupt long C-level arithmetic (``9^{9^{9^{9}}}`` hangs in integer
power), so they are disabled here; the caller bounds each call by running it in a worker
process it can kill (``jaxreplay.tasks.scoring``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*([^\n]*)")
# A number: optional sign, digits with optional thousands groups, optional decimals, or a
# plain fraction a/b. The sign is kept only when it is not a binary minus (see _last_number).
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\}|\\,|\\ )(?=\d{3}(?!\d))")
_UNIT_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$")
_LEADING_NUMBER = re.compile(r"^\s*(-?(?:\\\$|\$)?\s*-?[\d.,/]+(?:\\%|%)?)\s+[A-Za-z][A-Za-z .]*$")
# LaTeX commands and the contents of text-like groups are not prose.
_LATEX_TEXT = re.compile(r"\\(?:text|mbox|mathrm|textbf|mathbf|operatorname)\s*\{[^{}]*\}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_PROSE = re.compile(r"[A-Za-z]{3,}")


def _quiet_math_verify():
  # math-verify logs a warning on every call with its timeouts disabled, which is by design
  # here (see the module docstring).
  logging.getLogger("math_verify").setLevel(logging.ERROR)


def find_boxed(text: str) -> str | None:
  """Contents of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

  A balanced-brace scan (not a ``[^}]*`` regex, which stops at the first ``}`` and turns
  ``\\boxed{\\frac{1}{2}}`` into ``\\frac{1``). The last opening command decides: if its
  braces never close (a completion cut off mid-answer), the result is ``None``, not a
  truncated string or an earlier box.

  Args:
    text: any string.

  Returns:
    The stripped contents of the last box, ``None`` if there is no box or it is unclosed.
  """
  start = max(text.rfind(c) for c in _BOX_COMMANDS)
  if start < 0:
    return None
  i = start + (5 if text.startswith("\\fbox", start) else 6)
  while i < len(text) and text[i] == " ":
    i += 1
  if i >= len(text) or text[i] != "{":
    return None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j].strip()
  return None


def _last_number(text: str) -> str | None:
  """The last number in ``text``; a ``-`` right after a digit, ``)`` or letter is an
  operator (``5-3`` ends in 3, not -3)."""
  last = None
  for m in _NUMBER.finditer(text):
    s, start = m.group(0), m.start()
    if s.startswith("-") and start > 0 and (text[start - 1].isalnum() or text[start - 1] in ")]}"):
      s = s[1:]
    last = s
  return last.rstrip(".") if last else None


def extract_answer_text(completion: str) -> str | None:
  """The final answer a completion states (see the module docstring for the rules' order).

  Args:
    completion: decoded completion text (any length; a 10,000-character string of garbage
      is read in linear time).

  Returns:
    The answer text (e.g. ``"\\frac{1}{2}"``, ``"42"``, ``"1,000"``), or ``None`` when the
    completion states none: empty, an unclosed ``<think>``, or an unclosed last box.
  """
  text = completion
  if _THINK_CLOSE in text:
    text = text.rsplit(_THINK_CLOSE, 1)[1]
  elif _THINK_OPEN in text:
    return None
  tags = _ANSWER_TAG.findall(text)
  if tags:
    inner = tags[-1]
    if any(c in inner for c in _BOX_COMMANDS):
      return find_boxed(inner)
    return inner.strip() or None
  if any(c in text for c in _BOX_COMMANDS):
    return find_boxed(text)
  hashes = _HASHES.findall(text)
  if hashes and hashes[-1].strip():
    return hashes[-1].strip()
  return _last_number(text)


def normalize_answer(answer: str) -> str:
  """Removes what math-verify would misread in a numeric answer: thousands separators
  between digit groups (``1,000``, ``1{,}000``, ``1\\,000``), a trailing ``\\text{...}``
  unit, trailing unit words after a number (``18 dollars``) and a final period.

  Args:
    answer: an extracted answer.

  Returns:
    The answer with those parts removed (other text unchanged: ``\\frac{1}{23}`` stays).
  """
  a = answer.strip().rstrip(".").strip()
  m = _LEADING_NUMBER.match(a)
  if m:
    a = m.group(1)
  if _UNIT_TEXT.search(a) and _UNIT_TEXT.sub("", a).strip():
    a = _UNIT_TEXT.sub("", a).strip()
  return _THOUSANDS.sub("", a)


def gsm8k_gold(answer_field: str) -> str | None:
  """The gold answer of a GSM8K row: the text after the last ``####`` of its ``answer``
  field, thousands separators removed (``"... #### 1,200"`` → ``"1200"``).

  Args:
    answer_field: the row's worked solution ending in ``#### N``.

  Returns:
    The answer text, or ``None`` when there is no ``####`` or nothing after it.
  """
  hashes = _HASHES.findall(answer_field)
  if not hashes or not hashes[-1].strip():
    return None
  return normalize_answer(hashes[-1])


def math_gold(answer: Any, solution: Any) -> str | None:
  """The gold answer of a MATH / OpenR1-Math row: its ``answer`` column when non-empty,
  else the last ``\\boxed{}`` of its ``solution``.

  Args:
    answer: the row's answer column (str, number or None when absent).
    solution: the row's worked solution (str or None when absent).

  Returns:
    The answer text, or ``None`` when neither gives one.
  """
  if answer is not None and str(answer).strip():
    return str(answer).strip()
  if isinstance(solution, str):
    return find_boxed(solution)
  return None


def is_prose(gold: str) -> bool:
  """True when ``gold`` holds words (a run of 3+ letters outside LaTeX commands and
  ``\\text{}``-like groups), e.g. ``"see figure"``: math-verify would read it as a product
  of single-letter symbols and match any completion that spells the same letters."""
  return bool(_PROSE.search(_LATEX_COMMAND.sub(" ", _LATEX_TEXT.sub(" ", gold))))


def parse_gold(gold: str | None) -> list | None:
  """math-verify's parse of a gold answer, once per example.

  Args:
    gold: gold answer text in LaTeX or plain form (``"\\frac{63}{400}"``, ``"72"``).

  Returns:
    math-verify's parse (a list: sympy object, then the matched string), or ``None`` when
    the gold cannot be parsed: empty, prose (``is_prose``) or unreadable by math-verify.
  """
  if gold is None or not gold.strip() or is_prose(gold):
    return None
  from math_verify import parse
  _quiet_math_verify()
  try:
    parsed = parse(f"${normalize_answer(gold)}$", parsing_timeout=None)
  except Exception:  # noqa: BLE001 - math-verify raising means "cannot parse"
    return None
  return parsed or None


def verify_answer(gold: list | None, completion: str) -> float:
  """Binary reward: 1.0 when the completion's final answer is equivalent to ``gold``.

  Args:
    gold: ``parse_gold``'s result for the example; ``None`` (invalid example) gives 0.0.
    completion: decoded completion text.

  Returns:
    0.0 or 1.0. No exception for any completion (empty, garbage, unclosed tags); a call
    may run long on a pathological one — bound it from outside (module docstring).
  """
  if gold is None:
    return 0.0
  answer = extract_answer_text(completion)
  if answer is None:
    return 0.0
  from math_verify import parse, verify
  _quiet_math_verify()
  try:
    found = parse(f"${normalize_answer(answer)}$", parsing_timeout=None)
    return 1.0 if found and verify(gold, found, timeout_seconds=None) else 0.0
  except Exception:  # noqa: BLE001 - an unreadable answer is a wrong answer
    return 0.0


def with_parsed_gold(examples: list) -> tuple[list, int]:
  """The examples with ``gold`` set to ``parse_gold(example.answer)``, those whose gold
  cannot be parsed dropped (invalid: never scored, so never a free reward).

  Args:
    examples: ``tasks.base.Example`` objects.

  Returns:
    (valid examples, number dropped).
  """
  out = []
  for e in examples:
    gold = parse_gold(e.answer)
    if gold is not None:
      out.append(dataclasses.replace(e, gold=gold))
  return out, len(examples) - len(out)


class MathReward:
  """The math reward as a small picklable callable ``(completion, example) -> float``: what
  a scoring worker process receives (``jaxreplay.tasks.scoring``), without the task's
  example lists. Reads the gold parsed once per example from ``example.gold``."""

  def __call__(self, completion: str, example) -> float:
    return verify_answer(example.gold, completion)

  def warm_up(self) -> None:
    """Imports math-verify and sympy and scores once (seconds on a loaded machine)."""
    verify_answer(parse_gold("\\frac{1}{2}"), "\\boxed{0.5}")
