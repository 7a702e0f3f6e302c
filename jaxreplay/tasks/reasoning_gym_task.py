"""Tasks from ``reasoning-gym``: procedurally generated, scored by the library itself."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import reasoning_gym

from jaxreplay.tasks.base import Example, binary_reward
from jaxreplay.tasks.math_answer import math_reward_fn, with_parsed_gold
from jaxreplay.tasks.spec import ANSWER_EXTRACTIONS, MATH_EXTRACTIONS

# reasoning-gym builds item i from a generator seeded with seed + i, so the held-out
# split uses a seed this far from the train seed, and is deduplicated by question text
# on top of that.
HELDOUT_SEED_OFFSET = 1_000_003


@dataclasses.dataclass
class ReasoningGymTask:
  """A reasoning-gym dataset with a train split and a disjoint held-out split.

  Attributes:
    name: reasoning-gym dataset name, e.g. ``"chain_sum"``.
    train: training examples (deterministic from ``seed``).
    heldout: held-out examples; no question text also appears in ``train``.
    duplicates_dropped: held-out items removed because their question was in train.
    answer_extraction: ``"bare"`` — the completion is the answer, scored by the dataset's
      own ``score_answer``; ``"math"`` — chain-of-thought completions, the final answer
      extracted and compared with the gold answer parsed once per example
      (``math_answer.verify_answer``); ``"boxed"`` — the same, but only the last
      ``\\boxed{}`` is read (``math_answer.verify_boxed``, the strict grade).
    invalid_gold: with ``"math"`` or ``"boxed"``, items per split whose gold answer
      math-verify cannot parse; they are excluded from the splits (never scored, never a
      free reward).
    scorer: the ``scoring.Scorer`` the loop uses (set by ``make_task``).
  """

  name: str
  train: list[Example]
  heldout: list[Example]
  duplicates_dropped: int
  _dataset: Any
  answer_extraction: str = "bare"
  invalid_gold: dict = dataclasses.field(default_factory=lambda: {"train": 0, "heldout": 0})
  scorer: Any = None

  def reward(self, completion: str, example: Example) -> float:
    """Binary reward: the dataset's own ``score_answer`` (see ``binary_reward``), or
    math-verify against ``example.gold`` when ``answer_extraction`` is ``'math'`` or
    ``'boxed'``."""
    if self.answer_extraction in MATH_EXTRACTIONS:
      return self.reward_fn(completion, example)
    return binary_reward(lambda a: self._dataset.score_answer(a, example.meta), completion)

  @property
  def reward_fn(self):
    """The picklable reward a scoring worker runs: ``MathReward`` for ``"math"``,
    ``BoxedReward`` for ``"boxed"`` (no example lists shipped), else ``reward`` with the
    dataset bound."""
    return math_reward_fn(self.answer_extraction) or self.reward


def _examples(dataset, template: str) -> list[Example]:
  return [Example(prompt=template.format(question=e["question"], **e["metadata"]),
                  answer=str(e["answer"]), meta=e) for e in dataset]


def make_reasoning_gym_task(name: str, seed: int, train_size: int, heldout_size: int,
                            kwargs: dict[str, Any], prompt_template: str = "{question}",
                            answer_extraction: str = "bare") -> ReasoningGymTask:
  """Builds train and held-out splits of a reasoning-gym dataset.

  Args:
    name: reasoning-gym dataset name (see ``reasoning_gym.factory.DATASETS``).
    seed: train seed; held-out uses ``seed + HELDOUT_SEED_OFFSET``.
    train_size: number of train items (> 0).
    heldout_size: number of held-out items generated before deduplication (> 0).
    kwargs: dataset options, e.g. ``{"min_terms": 2, "max_digits": 2}``.
    prompt_template: ``str.format`` template of the prompt over ``question`` and the
      item's metadata fields (chain_sum has ``expression``). ``"{question}"`` shows the
      full reasoning-gym question; ``"{expression} ="`` drops its constant instruction.
    answer_extraction: one of ``tasks.spec.ANSWER_EXTRACTIONS`` (see ``ReasoningGymTask``).

  Returns:
    A ``ReasoningGymTask``.

  Raises:
    ValueError: unknown dataset name (lists valid ones), non-positive sizes, a template
      naming a field the items lack, or a held-out split empty after deduplication.
  """
  from reasoning_gym.factory import DATASETS
  if name not in DATASETS:
    near = difflib.get_close_matches(name, list(DATASETS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"task.name={name!r} is not a reasoning-gym dataset{hint}; valid: "
                     f"{sorted(DATASETS)}")
  if answer_extraction not in ANSWER_EXTRACTIONS:
    raise ValueError(f"task.answer_extraction={answer_extraction!r} is not one of "
                     f"{ANSWER_EXTRACTIONS}")
  if train_size <= 0 or heldout_size <= 0:
    raise ValueError(f"task.train_size={train_size} and task.heldout_size={heldout_size} "
                     "must both be > 0")
  train_ds = reasoning_gym.create_dataset(name, size=train_size, seed=seed, **kwargs)
  held_ds = reasoning_gym.create_dataset(name, size=heldout_size,
                                         seed=seed + HELDOUT_SEED_OFFSET, **kwargs)
  try:
    train = _examples(train_ds, prompt_template)
  except KeyError as e:
    raise ValueError(f"task.prompt_template={prompt_template!r} names field {e}; valid: "
                     f"question, {', '.join(sorted(train_ds[0]['metadata']))}") from None
  seen = {e.prompt for e in train}
  held_all = _examples(held_ds, prompt_template)
  heldout = [e for e in held_all if e.prompt not in seen]
  if not heldout:
    raise ValueError(f"task {name!r}: every held-out item also appears in train; "
                     "raise task.heldout_size or widen the difficulty")
  dropped = len(held_all) - len(heldout)
  invalid = {"train": 0, "heldout": 0}
  if answer_extraction in MATH_EXTRACTIONS:
    train, invalid["train"] = with_parsed_gold(train)
    heldout, invalid["heldout"] = with_parsed_gold(heldout)
    if not train or not heldout:
      raise ValueError(f"task {name!r}: no item's gold answer can be parsed by math-verify "
                       f"({invalid}); use task.answer_extraction='bare'")
  return ReasoningGymTask(name=name, train=train, heldout=heldout, duplicates_dropped=dropped,
                          _dataset=train_ds, answer_extraction=answer_extraction,
                          invalid_gold=invalid)
