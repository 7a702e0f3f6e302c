"""Prompt batches from a task split via grain: shuffled, repeated, indexable by position.

The data position is one integer (examples consumed), carried by the loop and stored in
each checkpoint, so a resumed run reads exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

from typing import Sequence

import grain

from jaxreplay.tasks.base import Example


class PromptStream:
  """Deterministic infinite sequence of examples: ``grain.MapDataset`` shuffle + repeat.

  Stateless: the caller holds the data position and passes it to ``take``.
  """

  def __init__(self, examples: Sequence[Example], seed: int):
    if not examples:
      raise ValueError("the task's train split is empty")
    self._ds = grain.MapDataset.source(list(examples)).shuffle(seed=seed).repeat()

  def take(self, position: int, n: int) -> list[Example]:
    """The ``n`` examples at data positions ``position .. position + n − 1``."""
    return [self._ds[position + i] for i in range(n)]
