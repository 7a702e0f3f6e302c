"""Host-side helpers that connect a task, the tokenizer and the sampler."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from tokenizers import Tokenizer

from jaxreplay.models.hf_tokenizer import HFTokenizer
from jaxreplay.models.tokenizer import decode_completions, encode_prompts, special_ids
from jaxreplay.sampling import generate
from jaxreplay.tasks.base import Example
from jaxreplay.tasks.scoring import score_in_process


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


@dataclasses.dataclass(frozen=True)
class HFTextIO(TextIO):
  """``TextIO`` for a Hugging Face checkpoint's tokenizer (``models.hf_tokenizer``).

  Prompts are wrapped in the checkpoint's chat template when ``chat`` is set (one user
  turn, after an optional system turn, with the assistant generation header), else
  encoded with the tokenizer's own special tokens. Stop ids: the checkpoint's
  ``eos_token_id`` list plus its ``eos_token``.

  Attributes:
    hf: the ``HFTokenizer``. chat: apply the chat template. system_prompt: text of a
    system turn ("" = none).
  """

  hf: Any = None
  chat: bool = False
  system_prompt: str = ""

  @classmethod
  def from_pretrained(cls, path: str, prompt_width: int, on_too_long: str = "truncate_left",
                      chat: bool = False, system_prompt: str = "") -> "HFTextIO":
    """Loads ``path/tokenizer.json`` and its configs.

    Raises:
      FileNotFoundError: no ``tokenizer.json``. ValueError: ``chat`` without a chat
      template, or no stop id.
    """
    return cls.from_tokenizer(HFTokenizer.from_pretrained(path), prompt_width, on_too_long,
                              chat, system_prompt, origin=path)

  @classmethod
  def from_tokenizer(cls, hf: HFTokenizer, prompt_width: int, on_too_long: str = "truncate_left",
                     chat: bool = False, system_prompt: str = "",
                     origin: str = "the checkpoint") -> "HFTextIO":
    """Wraps a loaded ``HFTokenizer`` (e.g. ``HFTokenizer.from_gguf``).

    Args:
      hf: the tokenizer. prompt_width: P, prompt tokens. on_too_long: ``task.on_too_long``.
      chat: apply the chat template. system_prompt: a system turn ("" = none).
      origin: where the tokenizer came from, for the error message.

    Raises:
      ValueError: ``chat`` without a chat template.
    """
    if chat and not hf.chat_template:
      raise ValueError(f"task.chat_template=True but {origin} has no chat_template")
    return cls(tok=hf.tokenizer, prompt_width=prompt_width, eos_ids=hf.stop_ids,
               pad_id=hf.pad_id, on_too_long=on_too_long, hf=hf, chat=chat,
               system_prompt=system_prompt)

  def prompts(self, examples: Sequence[Example]):
    """(tokens [B, P] int32, mask [B, P] bool, keep [B] bool), left-padded with ``pad_id``."""
    if not self.chat:
      return self.hf.encode_prompts([e.prompt for e in examples], self.prompt_width,
                                    on_too_long=self.on_too_long)
    sys_turn = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    chats = [sys_turn + [{"role": "user", "content": e.prompt}] for e in examples]
    return self.hf.encode_chats(chats, self.prompt_width, on_too_long=self.on_too_long)

  def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Completion texts of [B, M] token rows (special tokens dropped)."""
    return self.hf.decode_completions(tokens, mask)


def score(task, texts: Sequence[str], examples: Sequence[Example],
          timeout_s: float | None = None, grader: str | None = None) -> tuple[np.ndarray, int]:
  """Rewards of decoded completions. A reward function that raises, returns a non-finite
  value, or runs longer than its timeout gives reward 0 and is counted.

  A task built by ``make_task`` carries its ``scorer`` (``tasks.scoring.Scorer``: in this
  process or a pool of worker processes, with ``task.reward_timeout_s``), and training and
  evaluation both score through it; ``timeout_s`` is then unused. Any other object with a
  ``reward`` is scored in this process with ``timeout_s``.

  Args:
    task: has ``scorer``, or ``reward(text, example) -> float`` (and, for ``grader``, a
      ``reward_fn`` with that method).
    texts: B decoded completions. examples: the B matching examples.
    timeout_s: per-completion limit in seconds without a scorer (None: no limit, no thread).
    grader: None for the reward; a grader's name (``tasks.scoring.Scorer.graders``, e.g.
      ``"strict"``) to grade with it instead, the same way.

  Returns:
    (rewards [B] float32, number of reward failures).

  Raises:
    ValueError: a ``grader`` the task's reward function does not offer.
  """
  scorer = getattr(task, "scorer", None)
  if scorer is not None:
    return scorer(texts, examples, grader=grader)
  if grader is None:
    return score_in_process(task.reward, texts, examples, timeout_s)
  fn = getattr(getattr(task, "reward_fn", None), grader, None)
  if fn is None:
    raise ValueError(f"the task's reward function has no grader {grader!r}")
  return score_in_process(fn, texts, examples, timeout_s)


def sample_completions(graphdef, params, io: TextIO, task, examples: Sequence[Example],
                       key: jax.Array, *, max_new_tokens: int, temperature: float,
                       samples_per_example: int = 1, top_k: int = 0, top_p: float = 1.0,
                       timeout_s: float | None = None) -> tuple[list[list[str]], np.ndarray]:
  """What a policy answers: completions for a few examples, decoded and scored.

  One ``sampling.generate`` call over the E · S rows (each example repeated S times), so
  a different number of rows compiles again; for looking at a policy, not for evaluation
  at scale (``train.evaluate`` chunks its rows).

  Args:
    graphdef, params: the policy. io: ``TextIO`` (the run's ``Run.io``). task: gives
      ``reward``. examples: E >= 1 examples. key: PRNG key of the draw.
    max_new_tokens: M. temperature: >= 0 (0 is greedy). samples_per_example: S >= 1.
    top_k, top_p: truncation, as the sampler's. timeout_s: per-reward limit (``score``).

  Returns:
    (texts: E lists of S completion strings; rewards: [E, S] float32, a reward that
     fails counting 0).

  Raises:
    ValueError: no examples or S < 1; ``generate``'s errors for bad sampling settings.
  """
  if not examples or samples_per_example < 1:
    raise ValueError(f"need >= 1 example and samples_per_example >= 1; got {len(examples)} "
                     f"and {samples_per_example}")
  rows = [e for e in examples for _ in range(samples_per_example)]
  tokens, mask, _ = io.prompts(list(examples))
  g = generate(graphdef, params, tokens, mask, key, max_new_tokens=max_new_tokens,
               temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=io.eos_ids,
               pad_id=io.pad_id, group_size=samples_per_example)
  texts = io.decode(g.tokens, g.mask)
  rewards, _ = score(task, texts, rows, timeout_s)
  s = samples_per_example
  return ([texts[i * s:(i + 1) * s] for i in range(len(examples))],
          rewards.reshape(len(examples), s))
