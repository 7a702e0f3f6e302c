"""Prompt batches from a task split via grain: shuffled, repeated, indexable by position.

The data position is one integer (examples consumed), so a checkpoint stores it and
resumes exactly.
"""

from __future__ import annotations

from typing import Sequence

import grain

from jaxreplay.tasks.base import Example


class PromptStream:
  """Deterministic infinite stream of examples: ``grain.MapDataset`` shuffle + repeat.

  Attributes:
    position: number of examples consumed so far.
  """

  def __init__(self, examples: Sequence[Example], seed: int, position: int = 0):
    if not examples:
      raise ValueError("the task's train split is empty")
    self._ds = grain.MapDataset.source(list(examples)).shuffle(seed=seed).repeat()
    self.position = position

  def next(self, n: int) -> list[Example]:
    """The next ``n`` examples; advances ``position`` by ``n``."""
    out = [self._ds[self.position + i] for i in range(n)]
    self.position += n
    return out
