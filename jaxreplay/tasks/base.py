"""The task interface: a train split, a held-out split and a reward function.

A task knows text, not networks. The loop turns ``Example.prompt`` into tokens,
generates a completion, decodes it, and calls ``Task.reward(completion, example)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Example:
  """One verifiable problem.

  Attributes:
    prompt: text shown to the policy (the question).
    answer: the gold answer as text.
    meta: task-specific data its scorer needs (e.g. a reasoning-gym entry).
    gold: the gold answer parsed once by math-verify (``math_answer.parse_gold``) for
      ``answer_extraction='math'``; ``None`` otherwise.
  """

  prompt: str
  answer: str
  meta: Any = None
  gold: Any = None


class Task(Protocol):
  """A prompt source plus a reward function.

  Tasks built by ``make_task`` also carry ``scorer``: the ``tasks.scoring.Scorer`` the loop
  scores batches with (in-process or a process pool, with the configured timeout).
  """

  name: str
  train: Sequence[Example]
  heldout: Sequence[Example]

  def reward(self, completion: str, example: Example) -> float:
    """Reward in [0, 1] of ``completion`` (decoded text) for ``example``."""
    ...


def extract_answer(completion: str) -> str | None:
  """The answer a completion states: its text, stripped; ``None`` if empty.

  The embedded tasks train the policy to answer with the bare value right after
  the prompt (``"... 98 + 93 - 77 = 114"``), so the whole completion is the answer.
  If the completion still carries an ``=``, the text after the last one wins.

  Args:
    completion: decoded completion text (EOS and padding already removed).

  Returns:
    The stripped answer string, or ``None`` when nothing is left.
  """
  text = completion.strip()
  if "=" in text:
    text = text.rsplit("=", 1)[1].strip()
  return text or None


def binary_reward(score: Callable[[str | None], float], completion: str) -> float:
  """Binary reward: 1.0 only when ``score`` gives full credit, else 0.0.

  reasoning-gym scorers give partial credit to near misses (0.67 for ``-41`` when
  the answer is ``-4``); RL on those would reward wrong answers, so jaxreplay's
  reward is ``1.0 if score(answer) == 1.0 else 0.0``. A scorer that raises
  gives 0.0 (the caller counts failures).

  Args:
    score: maps the extracted answer (or ``None``) to a score in [0, 1].
    completion: decoded completion text.

  Returns:
    0.0 or 1.0.
  """
  return 1.0 if score(extract_answer(completion)) >= 1.0 else 0.0


def math_reward(gold: str, completion: str) -> float:
  """Binary reward by math-verify for a gold answer given as text (parsed on each call).

  Tasks parse each example's gold once (``math_answer.parse_gold``) and call
  ``math_answer.verify_answer``; this is the same check for one-off use.

  Args:
    gold: the reference answer text, e.g. ``"18"`` or ``"\\frac{1}{2}"``.
    completion: decoded completion text.

  Returns:
    0.0 or 1.0 (0.0 when ``gold`` cannot be parsed).
  """
  from jaxreplay.tasks.math_answer import parse_gold, verify_answer
  return verify_answer(parse_gold(gold), completion)
