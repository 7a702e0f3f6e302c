"""The task interface: a train split, a held-out split and a reward function.

A task knows text, not networks. The loop turns ``Example.prompt`` into tokens,
generates a completion, decodes it, and calls ``Task.reward(completion, example)``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class Example:
  """One verifiable problem.

  Attributes:
    prompt: text shown to the policy (the question).
    answer: the gold answer as text.
    meta: task-specific data its scorer needs (e.g. a reasoning-gym entry).
  """

  prompt: str
  answer: str
  meta: Any = None


class Task(Protocol):
  """A prompt source plus a reward function."""

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


ANSWER_EXTRACTIONS = ("bare", "math")


def math_reward(gold: str, completion: str) -> float:
  """Binary reward by ``math-verify``: 1.0 when the completion's final answer equals ``gold``.

  For chain-of-thought completions (GSM8K style): math-verify extracts the answer the
  completion states — ``\\boxed{...}``, a final "the answer is ...", else the last
  number — and compares it with ``gold`` symbolically (``18`` = ``18.0`` = ``\\frac{36}{2}``).
  math-verify's own signal-based timeouts are disabled (they only work on the main
  thread); the caller's ``task.reward_timeout_s`` bounds the call instead.

  Args:
    gold: the reference answer text, e.g. ``"18"``.
    completion: decoded completion text.

  Returns:
    0.0 or 1.0.
  """
  from math_verify import parse, verify
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" notes
  target = parse(f"${gold}$", parsing_timeout=None)
  found = parse(completion, parsing_timeout=None)
  if not target or not found:
    return 0.0
  return 1.0 if verify(target, found, timeout_seconds=None) else 0.0
