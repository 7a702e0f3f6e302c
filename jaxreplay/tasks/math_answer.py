"""Math answers: the final answer a completion states, the gold answer of a dataset row, and
their equivalence by math-verify.

Text only, no networks. The pieces:

* ``extract_answer_text(completion)``: the answer a chain-of-thought completion states, by
  the first rule that applies, in this order:

  1. the last closed ``<answer>...</answer>`` tag: a ``\\boxed{}`` inside it is unwrapped; a
     tag holding a sentence (R1-Zero style, ``<answer>The total is 18 eggs</answer>``) is
     read by math-verify's own extraction (``parse`` with its default configs), not parsed
     as a product of letters;
  2. the last ``\\boxed{...}`` / ``\\fbox{...}`` (also ``boxed{...}`` written without its
     backslash; a balanced-brace scan, so ``\\boxed{\\frac{1}{2}}`` keeps both braces;
     **the last box wins**, so a completion that corrects itself is graded on its
     correction; an unclosed last box is no answer);
  3. the last ``#### N`` line (GSM8K's own convention);
  4. the last "final answer is ... / answer: ..." clause (the Minerva sentence "The final
     answer is $\\frac{3}{8}$. I hope it is correct.", "The answer is 18 apples."): its
     first LaTeX math span, else its text after the last ``=``;
  5. the last LaTeX math span (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``), unless
     it is a computation (an ``=`` with digits on its left, ``$16 - 3 - 4 = 9$``) and a
     bare number follows it: then that number ("$16 - 3 - 4 = 9$ eggs, so she makes 18
     dollars" reads 18, "we get $\\frac{3}{8}$, to 2 places" reads 3/8); with no span, the
     last bare number. (math-verify takes whichever of its unanchored span and number
     matches ends later; a trailing remark's number then beats a stated value.) A ``$``
     pair that holds prose is currency, not math (``costs $5 and $6``).

  Spans joined only by ``,`` / ``and`` / ``or`` (``$1$, $2$ and $3$``) are one answer, a
  set, as math-verify reads them (rules 4 and 5).

  Text after the last ``</think>`` is read; a ``<think>`` that is never closed means the
  completion stopped while reasoning: no answer. Before any rule the text is made ASCII
  where it matters to numbers (``to_ascii_math``: the unicode minus U+2212 and full-width
  digits), so ``−5`` is -5, never 5.
* ``gsm8k_gold`` / ``math_gold``: the gold answer text of a GSM8K row (after ``####``) or of
  a MATH / OpenR1-Math row (its ``answer`` column, else the last ``\\boxed{}`` of its
  ``solution``).
* ``parse_gold``: math-verify's parse of a gold answer, done once per example when a task is
  built. Anything math-verify parses is a valid gold — numbers, expressions, vectors and
  matrices (``\\begin{pmatrix}``), sets, intervals, equations — except a parse that loses
  information: a repeating decimal is converted exactly first (``0.\\overline{27}`` =
  ``\\frac{3}{11}``: math-verify reads it as 0), one that cannot be converted makes the
  gold invalid, and so does prose (``"see figure"``: letters would parse as a commutative
  product, ``odd`` = ``dod``). An invalid example is counted and excluded, never scored,
  and ``verify_answer`` gives 0.0 for it — never a free reward.
* ``verify_boxed(gold, completion)`` (strict: only the last ``\\boxed{}`` counts; the reward
  of ``answer_extraction='boxed'``) and ``verify_last_number(gold, completion)`` (lenient:
  the last number anywhere, no format needed): the two grades of every evaluation of a
  math-graded task, so that a gain in format and a gain in correctness are told apart.
* ``verify_answer(gold, completion)``: 1.0 if the extracted answer is equivalent to the gold
  by ``math_verify.verify(gold, prediction)`` (gold first: math-verify's documented order),
  else 0.0. An answer whose own parse would lose information (a repeating decimal that
  cannot be converted) gets 0.0.

Equivalence is math-verify's: fractions and decimals (``\\frac{1}{2}`` = ``0.5``, 6-digit
rounding), LaTeX forms (``\\dfrac``, ``\\tfrac``, ``\\sqrt{18}`` = ``3\\sqrt{2}``), symbolic
expressions, matrices, sets and intervals. Before parsing, a numeric answer loses its
thousands separators (``1,000``, ``1{,}000``, ``10,\\!000``, ``1\\,000``, thin spaces), a
leading currency sign and trailing unit words (``18 dollars``, ``18\\text{ eggs}``).
Percentages follow math-verify's convention, which is the GSM8K datasets' (gold ``25`` for
"what percent ..."): ``50\\%`` equals both ``50`` and ``0.5``; without the ``%`` sign
``0.5`` does not equal ``50``.

How the rules compare with math-verify's ``parse`` + ``verify`` on the raw completion and
with lm-eval's Minerva-math rules is measured by ``python bench/grading_agreement.py``.

math-verify's own timeouts use ``signal.alarm``, which only works on a process's main
thread and cannot interrupt long C-level arithmetic (``9^{9^{9^{9}}}`` hangs in integer
power), so they are disabled here; the caller bounds each call by running it in a worker
process it can kill (``jaxreplay.tasks.scoring``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# The last box command: \boxed, \fbox, or "boxed" without its backslash when a brace
# follows (so the word "boxed" in prose is not a box).
_BOX = re.compile(r"\\boxed|\\fbox|(?<![\\A-Za-z])boxed(?=\s*\{)")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*([^\n]*)")
# A thousands separator between digit groups, in every form completions and golds use:
# 1,000  1{,}000  10,\!000  1\,000  1\ 000  1\;000, and the thin / no-break spaces.
_SEP = r"(?:,\\!|\{,\}|,|\\,|\\ |\\;|\u2009|\u202f|\u00a0)"
_THOUSANDS = re.compile(rf"(?<=\d){_SEP}(?=\d{{3}}(?!\d))")
# A number: optional sign, digits with optional thousands groups, optional decimals, or a
# plain fraction a/b, optionally a percentage. The sign is kept only when it is not a binary
# minus (see _last_number).
_NUMBER = re.compile(rf"-?(?:\d{{1,3}}(?:{_SEP}\d{{3}})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?"
                     r"(?:\s*\\?%)?|-?\.\d+")
_PERCENT = re.compile(r"-?\d+(?:\.\d+)?\s*\\?%")
_UNIT_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$")
_LEADING_NUMBER = re.compile(r"^\s*(-?(?:\\\$|\$)?\s*-?[\d.,/]+(?:\\%|%)?)\s+[A-Za-z][A-Za-z .]*$")
# LaTeX commands, environment names and the contents of text-like groups are not prose.
_LATEX_TEXT = re.compile(
    r"\\(?:text|mbox|mathrm|textbf|mathbf|operatorname|begin|end)\s*\{[^{}]*\}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_PROSE = re.compile(r"[A-Za-z]{3,}")
# LaTeX math spans, left to right: $$...$$, $...$ (one line; not after a backslash or a
# digit, as math-verify), \(...\), \[...\].
_MATH_SPAN = re.compile(
    r"(?<!\\)\$\$(?P<dd>.+?)(?<!\\)\$\$"
    r"|(?<![\\\d])\$(?P<d>(?:\\\$|[^\n$])+?)(?<!\\)\$"
    r"|\\\((?P<p>.+?)\\\)"
    r"|\\\[(?P<b>.+?)\\\]", re.DOTALL)
# "final answer is", "answer:", "the answer to part (a) is": the word answer, then "is" or
# ":" within the same sentence (no period, newline or math between them).
_ANSWER_CLAUSE = re.compile(r"(?i)\banswer\b[^\n.$]{0,40}?(?:\bis\b|:)")
# Between two math spans of one answer: "$1$, $2$ and $3$", "$2$ or $-2$".
_SPAN_JOIN = re.compile(r"\s*(?:,?\s*and|,?\s*or|,)\s*")
# Clauses tried, last first, and the characters read after each: bounded work on any text.
_MAX_CLAUSES, _CLAUSE_CHARS = 4, 2000
_SENTENCE_END = re.compile(r"(?<!\d)\.(?!\d)|\bI hope\b|\n")
# Repeating decimals: 0.\overline{27}, 1.2\overline{3}, .\overline{6}, 0.\overline 3.
_REPEATING = re.compile(r"(\d*)\.(\d*)\\overline\s*(?:\{\s*(\d+)\s*\}|(\d))")
# An \overline over digits that is not a convertible repeating decimal: math-verify would
# drop or mangle it (0.\overline{3} parses to 0), so the parse would lose information.
_LOSSY = re.compile(r"\\overline\s*\{?\s*\d")
_UNICODE = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-", "\uff0e": ".",
                          **{chr(0xFF10 + i): str(i) for i in range(10)}})


def _quiet_math_verify():
  # math-verify logs a warning on every call with its timeouts disabled, which is by design
  # here (see the module docstring).
  logging.getLogger("math_verify").setLevel(logging.ERROR)


def to_ascii_math(text: str) -> str:
  """``text`` with the unicode characters that change a number's meaning made ASCII.

  The minus sign U+2212 (and the small / full-width hyphen-minus U+FE63, U+FF0D) becomes
  ``-``; full-width digits U+FF10-U+FF19 and the full-width full stop U+FF0E become ASCII.
  Without this, ``−5`` reads as ``5`` on the bare-number path (a wrong answer scoring 1 for
  gold 5). Other characters are unchanged (``x²`` is not turned into ``x2``, as NFKC would).

  Args:
    text: any string.

  Returns:
    The translated string (same length).
  """
  return text.translate(_UNICODE)


def _repeating_fraction(m: re.Match) -> str:
  whole, fixed, block = m.group(1), m.group(2), m.group(3) or m.group(4)
  # x = W.F(B)(B)... : x = W + (FB - F) / (10^|F| (10^|B| - 1)).
  value = Fraction(int(whole or "0")) + Fraction(int(fixed + block) - int(fixed or "0"),
                                                 10 ** len(fixed) * (10 ** len(block) - 1))
  if value.denominator == 1:
    return str(value.numerator)
  return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def expand_repeating_decimals(text: str) -> str | None:
  """``text`` with every repeating decimal written exactly as a fraction.

  math-verify reads ``0.\\overline{27}`` as 0 (it drops the ``\\overline`` block), so a gold
  of that form would accept a completion of 0 or of any wrong repeating block. The standard
  conversion: ``W.F\\overline{B}`` = W + (FB - F) / (10^len(F) (10^len(B) - 1)), e.g.
  ``0.\\overline{27}`` = 27/99 = ``\\frac{3}{11}``, ``0.1\\overline{6}`` = 15/90 =
  ``\\frac{1}{6}``, ``0.\\overline{9}`` = ``1``.

  Args:
    text: LaTeX answer text.

  Returns:
    The converted text, or ``None`` when an ``\\overline`` over digits is left that is not a
    repeating decimal (``12\\overline{3}``): its parse would lose information. An
    ``\\overline`` over letters (a segment, ``\\overline{AB}``) is kept.
  """
  out = _REPEATING.sub(_repeating_fraction, text)
  return None if _LOSSY.search(out) else out


def find_boxed(text: str) -> str | None:
  """Contents of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (also
  ``boxed{...}`` without its backslash, as models sometimes write it).

  A balanced-brace scan (not a ``[^}]*`` regex, which stops at the first ``}`` and turns
  ``\\boxed{\\frac{1}{2}}`` into ``\\frac{1``). The last opening command decides: if its
  braces never close (a completion cut off mid-answer), the result is ``None``, not a
  truncated string or an earlier box.

  Args:
    text: any string.

  Returns:
    The stripped contents of the last box, ``None`` if there is no box or it is unclosed.
  """
  last = None
  for last in _BOX.finditer(text):
    pass
  if last is None:
    return None
  i = last.end()
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


def _has_box(text: str) -> bool:
  return _BOX.search(text) is not None


def _last_number(text: str) -> tuple[str, int] | None:
  """The last number in ``text`` and where it ends; a ``-`` right after a digit, ``)`` or
  letter is an operator (``5-3`` ends in 3, not -3)."""
  last = None
  for m in _NUMBER.finditer(text):
    s, start = m.group(0), m.start()
    if s.startswith("-") and start > 0 and (text[start - 1].isalnum() or text[start - 1] in ")]}"):
      s = s[1:]
    last = (s.rstrip("."), m.end())
  return last


def _math_spans(text: str) -> list[tuple[str, int, int]]:
  """(content, start, end) of each LaTeX math span holding math, left to right; a ``$``
  pair around prose (``costs $5 and $6``) is currency and left out."""
  spans = []
  for m in _MATH_SPAN.finditer(text):
    content = next(g for g in m.groups() if g is not None).strip()
    if content and not is_prose(content):
      spans.append((content, m.start(), m.end()))
  return spans


def _span_run(text: str, spans: list, k: int, forward: bool) -> str:
  """The content of span ``k`` joined (``", "``) with its neighbours that are separated
  from it only by ``,`` / ``and`` / ``or``: several values given as one answer, read as a
  set as math-verify reads them (``$1$, $2$ and $3$`` -> ``1, 2, 3``)."""
  i = j = k
  if forward:
    while j + 1 < len(spans) and _SPAN_JOIN.fullmatch(text[spans[j][2]:spans[j + 1][1]]):
      j += 1
  else:
    while i > 0 and _SPAN_JOIN.fullmatch(text[spans[i - 1][2]:spans[i][1]]):
      i -= 1
  return ", ".join(c for c, _, _ in spans[i:j + 1])


def _is_working(span: str) -> bool:
  """A span that is a computation (``3 \\cdot 4 = 12``: an ``=`` with digits on its left),
  not a stated value (``\\frac{3}{8}``) or answer (``x = 5``, ``y = 2x + 3``)."""
  return "=" in span and bool(re.search(r"\d", span.rsplit("=", 1)[0]))


def _clause_answer(text: str) -> str | None:
  """The answer of the last "answer is / answer:" clause: its first math span when one
  starts within the clause's sentence, else the sentence's text after its last ``=``, read
  as a number with units (``18 apples``) or as a short math expression."""
  clauses = list(_ANSWER_CLAUSE.finditer(text))
  for clause in clauses[:-_MAX_CLAUSES - 1:-1]:
    rest = text[clause.end():clause.end() + _CLAUSE_CHARS].lstrip(" \t*:")
    if rest.startswith("\n"):  # "Answer:\n$5$"
      rest = rest.lstrip()
    end = _SENTENCE_END.search(rest)
    sentence = rest[:end.start()] if end else rest
    spans = _math_spans(rest)
    if spans and (end is None or spans[0][1] < end.start()):
      return _span_run(rest, spans, 0, forward=True)
    sentence = sentence.rsplit("=", 1)[-1].strip().strip("*").strip()
    if not sentence:
      continue
    if not is_prose(sentence) or _LEADING_NUMBER.match(sentence):
      return sentence.rstrip(",;:")
    number = _NUMBER.search(sentence)
    if number:
      return number.group(0)
  return None


def _extract(completion: str) -> tuple[str, bool] | None:
  """(answer text, raw) by the rules of the module docstring; ``raw`` marks a sentence from
  an answer tag, for math-verify's own extraction rather than a LaTeX parse."""
  text = to_ascii_math(completion)
  if _THINK_CLOSE in text:
    text = text.rsplit(_THINK_CLOSE, 1)[1]
  elif _THINK_OPEN in text:
    return None
  tags = _ANSWER_TAG.findall(text)
  if tags:
    inner = tags[-1].strip()
    if _has_box(inner):
      boxed = find_boxed(inner)
      return (boxed, False) if boxed else None
    spans = _math_spans(inner)
    if len(spans) == 1 and not inner[:spans[0][1]].strip() and not inner[spans[0][2]:].strip(" ."):
      return spans[0][0], False  # <answer>$\frac{1}{2}$</answer>
    if not inner:
      return None
    if is_prose(normalize_answer(inner)):
      return inner, True
    return inner, False
  if _has_box(text):
    boxed = find_boxed(text)
    return (boxed, False) if boxed else None
  hashes = _HASHES.findall(text)
  if hashes and hashes[-1].strip():
    return hashes[-1].strip(), False
  clause = _clause_answer(text)
  if clause:
    return clause, False
  spans = _math_spans(text)
  if spans:
    number = _last_number(text[spans[-1][2]:])
    if number and _is_working(spans[-1][0]):
      return number[0], False
    return _span_run(text, spans, len(spans) - 1, forward=False), False
  number = _last_number(text)
  return (number[0], False) if number else None


def extract_answer_text(completion: str) -> str | None:
  """The final answer a completion states (see the module docstring for the rules' order).

  Args:
    completion: decoded completion text (any length; a 10,000-character string of garbage
      or of repeated delimiters is read in well under a second).

  Returns:
    The answer text (e.g. ``"\\frac{1}{2}"``, ``"42"``, ``"1,000"``; for an answer tag
    holding a sentence, the sentence), or ``None`` when the completion states none: empty,
    an unclosed ``<think>``, an empty or unclosed last box.
  """
  found = _extract(completion)
  return found[0] if found else None


def normalize_answer(answer: str) -> str:
  """Removes what math-verify would misread in a numeric answer: thousands separators
  between digit groups (every form of ``_SEP``: ``1,000``, ``1{,}000``, ``10,\\!000``,
  ``1\\,000``), a trailing ``\\text{...}`` unit, trailing unit words after a number
  (``18 dollars``) and a final period.

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
  """True when ``gold`` holds words: a run of 3+ letters outside LaTeX commands,
  environment names (``\\begin{pmatrix}``) and ``\\text{}``-like groups, e.g. ``"see
  figure"``. math-verify would read it as a product of single-letter symbols, which loses
  the word (``odd`` = ``dod``) and matches any completion that spells the same letters.

  Args:
    gold: answer text.

  Returns:
    Whether it is prose.
  """
  return bool(_PROSE.search(_LATEX_COMMAND.sub(" ", _LATEX_TEXT.sub(" ", gold))))


def _strip_dollars(text: str) -> str:
  t = text.strip()
  while len(t) >= 2 and t.startswith("$") and t.endswith("$") and not t.startswith("\\$"):
    t = t[1:-1].strip()
  return t


def parse_gold(gold: str | None) -> list | None:
  """math-verify's parse of a gold answer, once per example.

  Args:
    gold: gold answer text in LaTeX or plain form (``"\\frac{63}{400}"``, ``"72"``,
      ``"$\\dfrac{242}{311}$"``, ``"\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"``).

  Returns:
    math-verify's parse (a list: sympy object, then the matched string), or ``None`` when
    the gold is invalid: empty, prose after units are removed (``is_prose``), a parse that
    would lose information (an ``\\overline`` over digits that is not a repeating decimal;
    repeating decimals are converted exactly by ``expand_repeating_decimals``), or
    unreadable by math-verify.
  """
  if gold is None or not gold.strip():
    return None
  text = expand_repeating_decimals(to_ascii_math(_strip_dollars(gold)))
  if text is None:
    return None
  text = normalize_answer(text)
  if not text or is_prose(text):
    return None
  from math_verify import parse
  _quiet_math_verify()
  try:
    parsed = parse(f"${text}$", parsing_timeout=None)
  except Exception:  # noqa: BLE001 - math-verify raising means "cannot parse"
    return None
  return parsed or None


def parse_answer(completion: str) -> list:
  """math-verify's parse of the answer a completion states (``extract_answer_text``).

  Args:
    completion: decoded completion text.

  Returns:
    The parse (a list as math-verify's ``parse`` returns; empty when the completion states
    no answer, its answer cannot be parsed, or its parse would lose information).

  Raises:
    Whatever math-verify raises on a pathological answer (``verify_answer`` catches it).
  """
  found = _extract(completion)
  if found is None:
    return []
  answer, raw = found
  answer = expand_repeating_decimals(answer)
  if answer is None:
    return []
  if raw:
    from math_verify import parse
    _quiet_math_verify()
    return parse(answer, parsing_timeout=None)
  return _parse_math(answer)


def _parse_math(answer: str) -> list:
  """math-verify's parse of an extracted answer read as LaTeX math (units, thousands
  separators and enclosing ``$`` removed first; a plain percentage read as math-verify
  reads one); empty for an empty answer."""
  from math_verify import parse
  _quiet_math_verify()
  answer = normalize_answer(_strip_dollars(answer))
  if _PERCENT.fullmatch(answer):  # "-5%": math-verify's own reading of a plain percentage
    return parse(answer.replace("\\%", "%"), parsing_timeout=None)
  return parse(f"${answer}$", parsing_timeout=None) if answer else []


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
  from math_verify import verify
  _quiet_math_verify()
  try:
    found = parse_answer(completion)
    return 1.0 if found and verify(gold, found, timeout_seconds=None) else 0.0
  except Exception:  # noqa: BLE001 - an unreadable answer is a wrong answer
    return 0.0


def boxed_answer(completion: str) -> str | None:
  """The content of a completion's last box, as ``verify_boxed`` reads it.

  Args:
    completion: decoded completion text.

  Returns:
    The box's stripped content, or ``None``: no box, an empty or unclosed last box, or an
    unclosed ``<think>`` (only text after the last ``</think>`` is read).
  """
  text = to_ascii_math(completion)
  if _THINK_CLOSE in text:
    text = text.rsplit(_THINK_CLOSE, 1)[1]
  elif _THINK_OPEN in text:
    return None
  return find_boxed(text) or None


def _verify_text(gold: list | None, answer: str | None) -> float:
  """1.0 when the answer text, read as LaTeX math (``_parse_math``), is equivalent to
  ``gold``; 0.0 for no answer, an invalid gold, an unreadable answer or any exception."""
  if gold is None or answer is None:
    return 0.0
  from math_verify import verify
  _quiet_math_verify()
  try:
    answer = expand_repeating_decimals(answer)
    found = _parse_math(answer) if answer is not None else []
    return 1.0 if found and verify(gold, found, timeout_seconds=None) else 0.0
  except Exception:  # noqa: BLE001 - an unreadable answer is a wrong answer
    return 0.0


def verify_boxed(gold: list | None, completion: str) -> float:
  """Strict grade: 1.0 only when the completion's last ``\\boxed{...}`` holds the gold.

  The answer is the content of the completion's last box (``find_boxed``, after
  ``to_ascii_math``: the last box wins, also ``\\fbox{}`` and ``boxed{}`` without its
  backslash), read as ``extract_answer_text`` reads text: after the last ``</think>``, and
  none in a completion whose ``<think>`` never closes (it stopped while reasoning). No other
  rule of ``extract_answer_text`` applies, so an answer given in any other form (``#### 5``,
  "the answer is 5", a bare ``5``, an ``<answer>`` tag without a box) scores 0.0, and so
  does an empty or unclosed last box. The content is compared with math-verify as
  ``verify_answer`` does (``\\boxed{0.5}`` equals gold ``\\frac{1}{2}``; thousands
  separators and units are dropped first: ``\\boxed{1,000}`` equals 1000).

  Args:
    gold: ``parse_gold``'s result for the example; ``None`` (invalid example) gives 0.0.
    completion: decoded completion text.

  Returns:
    0.0 or 1.0. No exception for any completion (empty, garbage, unbalanced braces); a call
    may run long on a pathological box — bound it from outside (module docstring).
  """
  try:
    return _verify_text(gold, boxed_answer(completion))
  except Exception:  # noqa: BLE001 - never raises, whatever the completion
    return 0.0


def verify_last_number(gold: list | None, completion: str) -> float:
  """Lenient grade: 1.0 when the last number written in the completion equals the gold.

  No format is needed: the number is the last match of the module's number pattern in the
  whole completion (after ``to_ascii_math``), wherever it stands (in a box, a sentence,
  a formula). How text reads as a number:

  * a ``-`` is the number's sign unless it follows a digit, a letter or a closing
    bracket, where it is the binary minus: ``"5-3"`` reads 3, ``"x = -5"`` reads -5;
  * a comma (or any of ``_SEP``'s thousands separators) joins digit groups only before
    exactly three digits: ``"1,200"`` reads 1200, but ``"1,2"`` is a list and reads 2;
  * decimals and plain fractions are numbers (``"12.0"`` equals gold 12, ``"3/4"`` is
    0.75); a final period is not a decimal point (``"is 12."`` reads 12); a percentage
    follows ``verify_answer``'s convention (``"50%"`` equals 50 and 0.5);
  * LaTeX is not read: ``"\\frac{1}{2}"`` reads 2 and ``"1e5"`` reads 5, so this grade is
    meant for tasks whose answers are integers or decimals.

  The number is compared with the gold by math-verify (6-digit rounding), as
  ``verify_answer`` compares.

  Args:
    gold: ``parse_gold``'s result for the example; ``None`` (invalid example) gives 0.0.
    completion: decoded completion text.

  Returns:
    0.0 or 1.0 (0.0 when the completion has no number). No exception for any completion.
  """
  try:
    found = _last_number(to_ascii_math(completion))
    return _verify_text(gold, found[0] if found else None)
  except Exception:  # noqa: BLE001 - never raises, whatever the completion
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
  example lists. Reads the gold parsed once per example from ``example.gold``.

  Its graders (``GRADERS``, called by name through the same scorer:
  ``Scorer(..)(texts, examples, grader="strict")``) grade an evaluation's completions
  besides the reward: ``strict`` (``verify_boxed``) and ``lenient``
  (``verify_last_number``). ``reward_grader`` names the grader the reward equals, if any
  (evaluation then reuses the rewards instead of grading again)."""

  GRADERS = ("strict", "lenient")
  reward_grader: str | None = None

  def __call__(self, completion: str, example) -> float:
    return verify_answer(example.gold, completion)

  def strict(self, completion: str, example) -> float:
    """``verify_boxed`` of ``completion`` against ``example.gold``: 0.0 or 1.0."""
    return verify_boxed(example.gold, completion)

  def lenient(self, completion: str, example) -> float:
    """``verify_last_number`` of ``completion`` against ``example.gold``: 0.0 or 1.0."""
    return verify_last_number(example.gold, completion)

  def warm_up(self) -> None:
    """Imports math-verify and sympy and scores once (seconds on a loaded machine)."""
    verify_answer(parse_gold("\\frac{1}{2}"), "\\boxed{0.5}")


class BoxedReward(MathReward):
  """``answer_extraction='boxed'``: the reward is the strict grade, ``verify_boxed`` (only
  the last ``\\boxed{}`` counts), as a picklable callable like ``MathReward``."""

  reward_grader = "strict"

  def __call__(self, completion: str, example) -> float:
    return verify_boxed(example.gold, completion)


def math_reward_fn(answer_extraction: str) -> MathReward | None:
  """The picklable reward of a math-graded task, by ``task.answer_extraction``.

  Args:
    answer_extraction: ``"math"`` (``verify_answer``), ``"boxed"`` (``verify_boxed``) or any
      other (``"bare"``).

  Returns:
    ``MathReward()`` / ``BoxedReward()``, or ``None`` for an extraction math-verify does not
    grade.
  """
  return {"math": MathReward, "boxed": BoxedReward}.get(answer_extraction, lambda: None)()
