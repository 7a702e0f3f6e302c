"""Host-side helpers that connect a task, the tokenizer and the sampler."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from jaxreplay.models.tokenizer import decode_completions, encode_prompts, special_ids
from jaxreplay.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class TextIO:
  """Tokenizer plus the prompt width and the stop ids.

  Attributes:
    tok: tokenizer. prompt_width: P. eos_ids: stop ids. pad_id: padding id.
    on_too_long: ``"truncate_left"`` or ``"skip"`` for prompts longer than P.
  """

  tok: Tokenizer
  prompt_width: int
  eos_ids: tuple[int, ...]
  pad_id: int
  on_too_long: str = "truncate_left"

  @classmethod
  def create(cls, tok: Tokenizer, prompt_width: int, on_too_long: str = "truncate_left"):
    """From a tokenizer with the jaxreplay specials; ``<eos>`` is the only stop id.

    Raises:
      KeyError: the tokenizer lacks ``<pad>``, ``<bos>`` or ``<eos>``.
    """
    pad, _, eos = special_ids(tok)
    return cls(tok=tok, prompt_width=prompt_width, eos_ids=(eos,), pad_id=pad,
               on_too_long=on_too_long)

  def prompts(self, examples: Sequence[Example]):
    """(tokens [B, P] int32, mask [B, P] bool, keep [B] bool) for the examples' prompts."""
    return encode_prompts(self.tok, [e.prompt for e in examples], self.prompt_width,
                          self.on_too_long)

  def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Completion texts of [B, M] token rows."""
    return decode_completions(self.tok, np.asarray(tokens), np.asarray(mask))


def score(task, texts: Sequence[str], examples: Sequence[Example]) -> tuple[np.ndarray, int]:
  """Rewards of decoded completions; a reward function that raises gives 0 and is counted.

  Returns:
    (rewards [B] float32, number of reward failures).
  """
  out = np.zeros((len(texts),), np.float32)
  failures = 0
  for i, (t, e) in enumerate(zip(texts, examples)):
    try:
      out[i] = float(task.reward(t, e))
    except Exception:  # noqa: BLE001 - a crashing scorer must not stop the run
      failures += 1
  return out, failures
