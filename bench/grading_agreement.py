"""How the math reward grades next to the graders people compare against.

A corpus of (gold, completion) pairs is generated from the shipped GSM8K / MATH /
OpenR1-Math samples (``data/samples/*.jsonl``), reasoning-gym items of nine math datasets
and a short list of MATH-style gold forms the samples lack (vectors, matrices, intervals,
sets, equations, repeating decimals, mixed numbers, degrees, text answers, a gold written
with a thousands separator). Each gold is written into completions in many surface forms —
``\\boxed{}`` (with and without its backslash), unboxed LaTeX (``$...$``, ``\\(...\\)``,
``\\[...\\]``), the Minerva sentence, "Answer:" and "The answer is" clauses, ``#### N``,
``<answer>`` tags (bare, boxed, a sentence), think blocks (closed, with a decoy inside,
left open), self-corrections, a check or remark after the answer, equations, values joined
by "and", percentages, units and currency, thousands separators in every form, the unicode
minus, full-width digits, an equivalent rewrite — once with the
right answer and once with a wrong one made by perturbing it (an integer moved by 1, 10,
doubled or negated; the first integer literal of any other answer raised by 1, which
changes its value; a repeating decimal's block changed, and the 0 math-verify reads it
as; ``odd`` / ``even`` swapped). Whether a pair is right is known by construction.

Every pair is graded three ways:

* the reward: ``math_answer.verify_answer(parse_gold(gold), completion)``;
* math-verify on the raw completion: ``verify(parse(gold), parse(completion))`` with its
  default extraction configs and timeouts (``math_verify`` 0.9.0);
* the Minerva-math rules of lm-eval's ``minerva_math`` task, reimplemented here from their
  description (Lewkowycz et al. 2022, appendix D, and the task's documentation): the answer
  is the text between "Final Answer: The final answer is" and ". I hope it is correct." on
  one line; a completion without that sentence is read, as lm-eval reads the MATH golds,
  at its last ``\\boxed{}`` (``agree_minerva_strict`` below leaves that fallback out: such a
  completion has no answer). Both answers are normalised (the part after the last ``=``;
  the paper's substitutions and removed unit words; the content of a ``$...$`` span,
  ``\\text{}``, ``\\textbf{}``, ``\\overline{}`` and ``\\boxed{}`` unwrapped; ``\\fracab``
  and ``\\sqrta`` shorthand expanded; ``$`` removed; commas removed from a number) and
  equivalent when equal as strings or when both parse and ``simplify(a - b) == 0``.
  lm-eval parses with sympy's ``parse_latex``, which needs antlr 4.11; the installed antlr
  is 4.13, so latex2sympy2_extended (math-verify's parser) parses here.

Printed: the invalid golds per shipped sample file (math-verify cannot parse them or their
parse loses information; they are dropped from a task), the corpus by source and form,
accuracy against the truth and false positives (1 where the answer is wrong) of each grader,
the reward's agreement with each, its agreement with math-verify where math-verify and the
Minerva rules agree (and which of those disagreements the reward gets right by
construction), every disagreement class with its count, and a last line
``pairs=N agree_math_verify=F agree_minerva=F false_positive=F``.

Usage: python bench/grading_agreement.py [--rg-items 6] [--show 0]
About a minute on a quiet 2-core machine; one process.
"""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import re
import signal
import sys
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxreplay.tasks.math_answer import parse_gold, verify_answer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "data", "samples")
RG_DATASETS = ("chain_sum", "basic_arithmetic", "fraction_simplification", "decimal_chain_sum",
               "simple_equations", "lcm", "gcd", "polynomial_equations", "complex_arithmetic")
# MATH-style gold forms the shipped samples lack (MATH precalculus, algebra, number theory).
MATH_FORMS = (
    r"\begin{pmatrix} 1 \\ -2 \end{pmatrix}", r"\begin{pmatrix} 3 & 1 \\ 0 & 2 \end{pmatrix}",
    r"\begin{pmatrix} \frac{1}{2} \\ 4 \\ 7 \end{pmatrix}", r"(-\infty, 3]", r"[2, 5)",
    r"\{1, 2, 3\}", r"(1, 2)", r"y = 2x + 3", r"x = 5", r"0.\overline{27}", r"0.1\overline{6}",
    r"2\frac{1}{4}", r"\pm 2", r"\frac{\sqrt{3}}{2}", r"10^{10}", r"30^\circ", r"\text{odd}",
    r"\dfrac{5}{8}", r"-\frac{7}{2}", r"3\sqrt{5}", r"1.25", r"10,\!000", r"x^2 + 1", r"4 - 3i")
TEXT_SWAP = {r"\text{odd}": r"\text{even}"}
COT = (
    "Let me solve this step by step. First, 12 + 7 = 19, and then 19 - 4 = 15.",
    "We compute the pieces: $3 \\cdot 4 = 12$ and $12 - 5 = 7$.",
    "Working through it: the first part gives 8, the second gives 21, so we combine them.",
    "Step 1: 6 * 7 = 42. Step 2: 42 / 2 = 21. Step 3: check the units.",
)
_INT = re.compile(r"^-?\d+$")
_DEC = re.compile(r"^-?\d+\.\d+$")
_FRAC = re.compile(r"^-?\d+/\d+$")
_FIRST_INT = re.compile(r"\d+")


# --- golds ------------------------------------------------------------------------------------

def shipped_golds() -> tuple[list[tuple[str, str]], list[str]]:
  """(source, gold) of every row of the shipped JSONL samples, and report lines with the
  invalid golds (``parse_gold`` is None) of every sample file, JSONL and Parquet."""
  from jaxreplay.tasks.file_task import read_examples  # grain: imported only when run
  golds, lines = [], []
  for path in sorted(glob.glob(os.path.join(SAMPLES, "*.jsonl")) +
                     glob.glob(os.path.join(SAMPLES, "*.parquet"))):
    name = os.path.basename(path)
    fmt = "gsm8k" if name.startswith("gsm8k") else "math"
    exs, skipped = read_examples(path, name.rsplit(".", 1)[1], fmt)
    invalid = [e.answer for e in exs if parse_gold(e.answer) is None]
    lines.append(f"  {name:22s} rows={len(exs) + skipped:3d} golds={len(exs):3d} "
                 f"invalid={len(invalid)}" + (f" {invalid}" if invalid else ""))
    if name.endswith(".jsonl"):
      golds += [(fmt if fmt == "gsm8k" else name.split("_")[0], e.answer) for e in exs]
  return golds, lines


def reasoning_gym_golds(items: int) -> tuple[list[tuple[str, str]], int]:
  """(``rg:NAME``, gold) of ``items`` items of each of ``RG_DATASETS`` (seed 7), and how many
  of them have an invalid gold."""
  import reasoning_gym
  golds, invalid = [], 0
  for name in RG_DATASETS:
    ds = reasoning_gym.create_dataset(name, size=items, seed=7)
    for i in range(items):
      gold = str(ds[i]["answer"])
      if parse_gold(gold) is None:
        invalid += 1
      else:
        golds.append((f"rg:{name}", gold))
  return golds, invalid


# --- surface forms ----------------------------------------------------------------------------

def strip_dollars(text: str) -> str:
  """``text`` without the ``$`` pairs around it (reasoning-gym writes ``$244/607$``)."""
  t = text.strip()
  while len(t) >= 2 and t[0] == "$" and t[-1] == "$":
    t = t[1:-1].strip()
  return t


def kind_of(gold: str) -> str:
  """``int``, ``decimal``, ``fraction`` (a/b), ``text`` or ``latex``."""
  g = gold.replace(" ", "")
  if _INT.match(g):
    return "int"
  if _DEC.match(g):
    return "decimal"
  if _FRAC.match(g):
    return "fraction"
  return "text" if gold in TEXT_SWAP else "latex"


def wrong_answer(gold: str, kind: str, i: int) -> str:
  """A wrong answer made by perturbing ``gold`` (its value always changes)."""
  if kind == "int":
    n = int(gold)
    options = [n + 1, n - 1, n + 10, -n, 2 * n]
    return str(next(v for v in options[i % len(options):] + options if v != n))
  if kind == "text":
    return TEXT_SWAP[gold]
  m = _FIRST_INT.search(gold)
  return gold[:m.start()] + str(int(m.group()) + 1) + gold[m.end():]


def equivalent(gold: str, kind: str) -> str | None:
  """An equivalent rewrite: ``n.0`` for an integer, the terminating decimal of a fraction."""
  if kind == "int":
    return f"{gold}.0"
  frac = None
  if kind == "fraction":
    frac = Fraction(gold.replace(" ", ""))
  m = re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", gold.replace(" ", ""))
  if m:
    frac = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
  if frac is None:
    return None
  d = frac.denominator
  while d % 2 == 0:
    d //= 2
  while d % 5 == 0:
    d //= 5
  return str(float(frac)) if d == 1 else None


def thousands(n: str, sep: str) -> str:
  """Integer string ``n`` with ``sep`` between its groups of three digits (``1{,}250``)."""
  sign, digits = ("-", n[1:]) if n.startswith("-") else ("", n)
  groups = []
  while len(digits) > 3:
    groups.insert(0, digits[-3:])
    digits = digits[:-3]
  return sign + sep.join([digits] + groups)


def list_items(answer: str) -> list[str] | None:
  """The elements of a set or list answer (``\\{1, 2, 3\\}``, ``-3.625, 0.0``), else None."""
  a = answer.strip()
  if a.startswith("\\{") and a.endswith("\\}"):
    a = a[2:-2]
  elif "," not in a or a[0] in "([" or "\\!" in a:
    return None
  items = [x.strip() for x in a.split(",")]
  return items if len(items) > 1 and all(items) else None


def forms(value: str, decoy: str, kind: str, cot: str) -> list[tuple[str, str]]:
  """(form, completion) of ``value`` in every surface form that applies to its kind;
  ``decoy`` is the other answer (wrong when ``value`` is right), for forms that hold two."""
  v, d = value, decoy
  numeric = kind in ("int", "decimal", "fraction")
  out = [
      ("boxed", f"{cot}\nTherefore, the answer is $\\boxed{{{v}}}$."),
      ("boxed_no_backslash", f"{cot}\nSo the answer is boxed{{{v}}}."),
      ("minerva_sentence", f"{cot}\nFinal Answer: The final answer is ${v}$. I hope it is correct."),
      ("latex_inline_last", f"{cot}\nThus we get ${v}$."),
      ("answer_is_latex", f"{cot}\nThe answer is ${v}$."),
      ("latex_paren", f"{cot}\nHence the result is \\({v}\\)."),
      ("latex_display", f"{cot}\nHence\n\\[ {v} \\]"),
      ("answer_tag", f"<think>{cot}</think>\n<answer>{v}</answer>"),
      ("answer_tag_boxed", f"<think>{cot}</think>\n<answer>\\boxed{{{v}}}</answer>"),
      ("answer_tag_sentence", f"<think>{cot}</think>\n<answer>The final answer is ${v}$.</answer>"),
      ("think_decoy_plain", f"<think>{cot} Maybe it is {d}? Let me check again.</think>\n"
                            f"The answer is ${v}$."),
      ("think_decoy_boxed", f"<think>{cot} Maybe it is \\boxed{{{d}}}? Let me check again."
                            f"</think>\nThe answer is ${v}$."),
      ("self_correction", f"{cot}\nI first got \\boxed{{{d}}}, but fixing the arithmetic gives "
                          f"\\boxed{{{v}}}."),
      ("minerva_boxed", f"{cot}\nFinal Answer: The final answer is $\\boxed{{{v}}}$. I hope it is "
                        "correct."),
      ("qwen_final_answer", f"{cot}\n\n**Final Answer**\n\\[\n\\boxed{{{v}}}\n\\]"),
      ("answer_colon", f"{cot}\nAnswer: ${v}$"),
      ("answer_then_check", f"{cot}\nThe answer is ${v}$. Check: 2 + 3 = 5, fine."),
      ("equation_display", f"{cot}\nSo\n\\[ x = {v} \\]"),
      ("trailing_remark", f"{cot}\nThus we get ${v}$, which took 3 steps."),
      ("unclosed_think", f"<think>{cot} So it is \\boxed{{{v}}}"),
  ]
  items = list_items(v)
  if items:
    spans = ", ".join(f"${x}$" for x in items[:-1]) + f" and ${items[-1]}$"
    out += [("list_answer_is", f"{cot}\nThe answer is {spans}."),
            ("list_last_spans", f"{cot}\nSo the solutions are {spans}.")]
  if numeric:
    out += [
        ("hashes", f"{cot}\n#### {v}"),
        ("bare_last_number", f"{cot}\nAltogether that makes {v}."),
        ("answer_is_units", f"{cot}\nThe answer is {v} dollars."),
        ("boxed_text_units", f"{cot}\nSo she pays $\\boxed{{{v}\\text{{ dollars}}}}$."),
        ("currency", f"{cot}\nThe total cost is ${v}."),
        ("span_then_number", f"{cot}\nEach costs $\\frac{{1}}{{2}}$ dollar, so in total it is {v}."),
        ("answer_tag_units", f"<think>{cot}</think>\n<answer>There are {v} apples left.</answer>"),
    ]
  if kind == "int":
    out += [("percent_text", f"{cot}\nThe answer is {v}%."),
            ("percent_latex", f"{cot}\nThe answer is $\\boxed{{{v}\\%}}$.")]
    out.append(("fullwidth_digits", f"{cot}\nThe answer is "
                f"{v.translate({ord(c): 0xFF10 + int(c) for c in '0123456789'})}."))
    if v.startswith("-"):
      out += [("unicode_minus_text", f"{cot}\nThe answer is \u2212{v[1:]}."),
              ("unicode_minus_latex", f"{cot}\nThe answer is $\u2212{v[1:]}$."),
              ("unicode_minus_bare", f"{cot}\nSo the change is \u2212{v[1:]}.")]
    if abs(int(v)) >= 1000:
      bang, thin = thousands(v, ",\\!"), thousands(v, "\\,")
      out += [("sep_comma_text", f"{cot}\nIn total they paid {thousands(v, ',')} dollars."),
              ("sep_brace_text", f"{cot}\nIn total they paid {thousands(v, '{,}')} dollars."),
              ("sep_brace_boxed", f"{cot}\n$\\boxed{{{thousands(v, '{,}')}}}$"),
              ("sep_bang_latex", f"{cot}\nThe answer is ${bang}$."),
              ("sep_thin_latex", f"{cot}\nThe answer is ${thin}$.")]
  return out


def corpus(golds: list[tuple[str, str]]) -> list[dict]:
  """Every (gold, completion) pair with its source, form and truth (1 right, 0 wrong).

  Each form is written once with the right answer and once with a wrong one. The unicode
  minus forms take, as the wrong answer, the negation of a positive gold (``−5`` for gold 5:
  read without its sign it would score 1) and gold - 1 for a negative one."""
  unicode_forms = ("unicode_minus_text", "unicode_minus_latex", "unicode_minus_bare")
  pairs = []
  for gi, (source, gold) in enumerate(golds):
    g = strip_dollars(gold)
    kind = kind_of(g)
    cot = COT[gi % len(COT)]
    names = [f for f, _ in forms(g, g, kind, cot)]
    if kind == "int" and int(g) != 0:
      names += [f for f in unicode_forms if f not in names]
    for fi, form in enumerate(names):
      if form in unicode_forms:
        wrong = str(int(g) - 1) if int(g) < 0 else str(-int(g))
      else:
        wrong = wrong_answer(g, kind, gi + fi)
      for truth, value, decoy in ((1, g, wrong), (0, wrong, g)):
        text = dict(forms(value, decoy, kind, cot)).get(form)
        if text is not None:
          pairs.append(dict(source=source, gold=gold, form=form, truth=truth, text=text))
    eq = equivalent(g, kind)
    if eq is not None:
      pairs.append(dict(source=source, gold=gold, form="equivalent_rewrite", truth=1,
                        text=f"{cot}\nTherefore, the answer is $\\boxed{{{eq}}}$."))
    if "\\overline" in g:  # math-verify reads a repeating decimal as 0
      pairs.append(dict(source=source, gold=gold, form="repeating_as_zero", truth=0,
                        text=f"{cot}\nTherefore, the answer is $\\boxed{{0}}$."))
  return pairs


# --- math-verify on the raw completion --------------------------------------------------------

def math_verify_grade(gold: str, completion: str) -> int:
  """math-verify's own ``verify(parse(gold), parse(completion))`` with its default
  extraction configs and timeouts (SIGALRM: call from the main thread); 1 or 0, and 0 when
  math-verify raises."""
  from math_verify import parse, verify
  try:
    g = parse(f"${strip_dollars(gold)}$")
    p = parse(completion)
    return int(bool(g) and bool(p) and verify(g, p))
  except Exception:  # noqa: BLE001 - math-verify's own failure is a 0
    return 0


# --- the Minerva-math rules (lm-eval minerva_math), reimplemented -----------------------------

MINERVA_SENTENCE = re.compile(r"Final Answer: The final answer is([^\n]*?). I hope it is correct\.")
# Minerva appendix D: (before, after) substitutions, then expressions removed.
MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""),
                         (" ", ""), ("mbox", "text"), (",\\text{and}", ","),
                         ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
MINERVA_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km",
                   "units", "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents",
                   "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
                   "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                   "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}",
                   r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots")


def last_box(text: str) -> str | None:
  """Contents of the last ``\\boxed{...}`` (else ``\\fbox{...}``), by brace counting; the
  ``\\boxed x`` form (a space, no brace) runs to the next ``$``."""
  i = text.rfind("\\boxed")
  if "\\boxed " in text:
    return text.split("\\boxed ")[-1].split("$")[0]
  if i < 0:
    i = text.rfind("\\fbox")
    if i < 0:
      return None
  depth, open_at = 0, None
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
      open_at = j if open_at is None else open_at
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[open_at + 1:j]
  return None


def minerva_extract(completion: str, box_fallback: bool = True) -> str | None:
  """The Minerva answer of a completion (lm-eval minerva_math): the text after "Final
  Answer: The final answer is" up to the character before " I hope it is correct." on the
  same line (a completion that stops before that phrase ends at its end); else, with
  ``box_fallback``, its last ``\\boxed{}`` (how lm-eval reads the MATH golds); else None."""
  m = MINERVA_SENTENCE.search(completion + " I hope it is correct.")
  if m:
    return m.group(1).strip()
  return last_box(completion) if box_fallback else None


def minerva_normalize(answer: str) -> str:
  """Minerva's normalisation of a final answer (Lewkowycz et al. 2022, appendix D, as
  lm-eval's minerva_math applies it), step by step as described there.

  Args:
    answer: an extracted answer.

  Returns:
    The normalised string (e.g. ``"x = 10,000"`` -> ``"10000"``).
  """
  a = answer.split("=")[-1]
  for before, after in MINERVA_SUBSTITUTIONS:
    a = a.replace(before, after)
  for word in MINERVA_REMOVED:
    a = a.replace(word, "")
  a = re.sub(r"^.*?\$(.*?)\$.*$", r"$\1$", a)  # the first $...$ span, if any
  for command in ("text", "textbf", "overline"):
    a = re.sub(r"\\" + command + r"\{(.*?)\}", r"\1", a)
  a = re.sub(r"\\boxed\{(.*)\}", r"\1", a)
  a = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", a)
  a = re.sub(r"sqrt([^{])", r"sqrt{\1}", a)
  a = a.replace("$", "")
  if a.replace(",", "").isdigit():
    a = a.replace(",", "")
  return a


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout


def minerva_equivalent(a: str, b: str, seconds: int = 5) -> bool:
  """lm-eval's ``is_equiv`` for two normalised answers: equal strings, or both parse and
  ``sympy.simplify(a - b) == 0`` within ``seconds`` (SIGALRM: call from the main thread).
  Any parse error, a difference that cannot be taken (matrices, tuples) or the timeout
  means not equivalent."""
  if a == b:
    return True
  import sympy
  from latex2sympy2_extended import latex2sympy
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(seconds)
  try:
    x = latex2sympy(a, normalization_config=None)
    y = latex2sympy(b, normalization_config=None)
    return bool(sympy.simplify(x - y) == 0)
  except (Exception, _Timeout):  # noqa: BLE001 - unparseable or too slow: not equivalent
    return False
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def minerva_grade(gold: str, completion: str, box_fallback: bool = True) -> int:
  """1 when the Minerva answer of ``completion`` is equivalent to ``gold``, both normalised
  (``minerva_extract``, ``minerva_normalize``, ``minerva_equivalent``), else 0."""
  answer = minerva_extract(completion, box_fallback)
  if answer is None:
    return 0
  return int(minerva_equivalent(minerva_normalize(answer), minerva_normalize(strip_dollars(gold))))


# --- report -----------------------------------------------------------------------------------

def rate(xs) -> float:
  """The mean of booleans / 0-1 values; nan when there are none."""
  xs = list(xs)
  return sum(xs) / len(xs) if xs else float("nan")


def main(argv=None) -> None:
  """Builds the corpus, grades it three ways and prints the report (module docstring).

  Args:
    argv: command-line arguments (``--rg-items``, ``--show``); None reads ``sys.argv``.
  """
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rg-items", type=int, default=6, help="items per reasoning-gym dataset")
  ap.add_argument("--show", type=int, default=0, help="example completions per class")
  args = ap.parse_args(argv)
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
  t0 = time.time()

  shipped, lines = shipped_golds()
  rg, rg_invalid = reasoning_gym_golds(args.rg_items)
  extra_invalid = [g for g in MATH_FORMS if parse_gold(g) is None]
  golds = shipped + rg + [("math_forms", g) for g in MATH_FORMS if g not in extra_invalid]
  print("invalid golds (dropped from a task) in the shipped samples:")
  print("\n".join(lines))
  shipped_invalid = sum(int(line.split("invalid=")[1].split()[0]) for line in lines)
  print(f"shipped_invalid_golds={shipped_invalid}  reasoning_gym_invalid={rg_invalid}"
        f"/{len(RG_DATASETS) * args.rg_items}  math_forms_invalid={len(extra_invalid)}"
        f"/{len(MATH_FORMS)} {extra_invalid if extra_invalid else ''}")

  pairs = corpus(golds)
  for p in pairs:
    p["reward"] = int(verify_answer(parse_gold(p["gold"]), p["text"]))
    p["mv"] = math_verify_grade(p["gold"], p["text"])
    p["minerva"] = minerva_grade(p["gold"], p["text"])
    p["minerva_strict"] = minerva_grade(p["gold"], p["text"], box_fallback=False)

  by_source = collections.Counter(p["source"] for p in pairs)
  by_form = collections.Counter(p["form"] for p in pairs)
  print(f"\ncorpus: {len(pairs)} pairs from {len(golds)} golds, "
        f"{sum(1 - p['truth'] for p in pairs)} wrong answers")
  print("  by source: " + ", ".join(f"{k}={v}" for k, v in sorted(by_source.items())))
  print("  by form:   " + ", ".join(f"{k}={v}" for k, v in sorted(by_form.items())))

  n = len(pairs)
  agree_mv = rate(p["reward"] == p["mv"] for p in pairs)
  agree_mn = rate(p["reward"] == p["minerva"] for p in pairs)
  both = [p for p in pairs if p["mv"] == p["minerva"]]
  wrong = [p for p in pairs if p["truth"] == 0]
  print("\ngrader          accuracy  false_pos  agree_reward")
  for key, name in (("reward", "reward"), ("mv", "math-verify"), ("minerva", "minerva"),
                    ("minerva_strict", "minerva_strict")):
    print(f"  {name:14s} {rate(p[key] == p['truth'] for p in pairs):8.4f}  "
          f"{rate(p[key] for p in wrong):9.4f}  {rate(p[key] == p['reward'] for p in pairs):12.4f}")
  print(f"where math-verify and minerva agree ({len(both)} pairs): agree_math_verify="
        f"{rate(p['reward'] == p['mv'] for p in both):.4f}")
  split = collections.Counter((p["form"], "reward right" if p["reward"] == p["truth"] else
                               "consensus right") for p in both if p["reward"] != p["mv"])
  print(f"  its {sum(split.values())} disagreements: " + ", ".join(
      f"{form} ({who}) {c}" for (form, who), c in sorted(split.items(), key=lambda kv: -kv[1])))
  right = [p for p in both if p["mv"] == p["truth"]]
  print(f"where math-verify and minerva agree and are right by construction ({len(right)} "
        f"pairs): agree_math_verify={rate(p['reward'] == p['mv'] for p in right):.4f}")
  print(f"agree_minerva_strict={rate(p['reward'] == p['minerva_strict'] for p in pairs):.4f}")

  for key, name in (("mv", "math-verify"), ("minerva", "minerva")):
    classes = collections.Counter((p["form"], p["reward"], p[key], p["truth"])
                                  for p in pairs if p["reward"] != p[key])
    print(f"\ndisagreements with {name} (form: reward/{name}, truth): "
          f"{sum(classes.values())}")
    for (form, r, o, t), c in sorted(classes.items(), key=lambda kv: (-kv[1], kv[0])):
      print(f"  {form:22s} reward={r} {name}={o} truth={t}: {c}")
      for p in [p for p in pairs if (p["form"], p["reward"], p[key], p["truth"]) ==
                (form, r, o, t)][:args.show]:
        print(f"      gold={p['gold']!r} text={p['text'][-90:]!r}")

  false_positive = rate(p["reward"] for p in wrong)
  print(f"\n({time.time() - t0:.0f} s)")
  print(f"pairs={n} agree_math_verify={agree_mv:.4f} agree_minerva={agree_mn:.4f} "
        f"false_positive={false_positive:.4f}")


if __name__ == "__main__":
  main()
