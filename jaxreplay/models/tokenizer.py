"""Tokenizers (Hugging Face ``tokenizers``) and the padding conventions of jaxreplay.

Conventions used by every stage:
  * id 0 is ``<pad>``, id 1 ``<bos>``, id 2 ``<eos>`` for tokenizers trained here.
  * prompts are LEFT-padded to a fixed width P (pad id, mask False), so every prompt
    ends at column P-1 and completions start at column P.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE tokenizer that keeps every digit a separate token.

  Digits split individually so that arithmetic stays learnable digit by digit.

  Args:
    texts: training corpus (prompts and answers).
    vocab_size: target vocabulary size (>= 259: 256 bytes + 3 specials).

  Returns:
    A ``tokenizers.Tokenizer`` with ``<pad>``=0, ``<bos>``=1, ``<eos>``=2.

  Raises:
    ValueError: ``vocab_size`` < 259.
  """
  if vocab_size < 259:
    raise ValueError(f"model.vocab_size={vocab_size} must be >= 259 for a byte-level BPE")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def load_or_train_tokenizer(path: str, texts: Sequence[str], vocab_size: int) -> Tokenizer:
  """Loads ``path`` (a ``tokenizer.json``, local or a URL such as ``gs://...``) if it exists,
  else trains one on ``texts`` with ``vocab_size`` tokens and saves it there."""
  from jaxreplay import storage
  if storage.is_remote(path):
    from etils import epath
    p = epath.Path(path)
    if p.exists():
      return Tokenizer.from_str(p.read_text())
    tok = train_bpe_tokenizer(texts, vocab_size)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(tok.to_str())  # one object write: all or nothing
    return tok
  if os.path.exists(path):
    return Tokenizer.from_file(path)
  tok = train_bpe_tokenizer(texts, vocab_size)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  tok.save(tmp)  # then renamed: a crash never leaves a truncated tokenizer.json
  os.replace(tmp, path)
  return tok


def special_ids(tok: Tokenizer) -> tuple[int, int, int]:
  """(pad_id, bos_id, eos_id) of ``tok``; raises ``KeyError`` if one is missing."""
  ids = tuple(tok.token_to_id(t) for t in SPECIAL_TOKENS)
  if any(i is None for i in ids):
    raise KeyError(f"tokenizer lacks one of {SPECIAL_TOKENS}")
  return ids  # type: ignore[return-value]


def encode_prompts(tok: Tokenizer, prompts: Sequence[str], width: int,
                   on_too_long: str = "truncate_left") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Encodes prompts as ``<bos> + ids``, left-padded to ``width``.

  Args:
    tok: tokenizer with the jaxreplay specials.
    prompts: B prompt strings.
    width: P, the padded prompt width in tokens.
    on_too_long: ``"truncate_left"`` keeps the last ``width`` tokens (the question end
      and the ``=`` survive); ``"skip"`` marks the row invalid instead.

  Returns:
    (tokens [B, P] int32, mask [B, P] bool, keep [B] bool). Rows with ``keep`` False
    (only with ``"skip"``) hold padding only.

  Raises:
    ValueError: unknown ``on_too_long``.
  """
  if on_too_long not in ("truncate_left", "skip"):
    raise ValueError(f"data.on_too_long={on_too_long!r}; valid: 'truncate_left', 'skip'")
  pad, bos, _ = special_ids(tok)
  out = np.full((len(prompts), width), pad, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  keep = np.ones((len(prompts),), bool)
  for i, enc in enumerate(tok.encode_batch(list(prompts), add_special_tokens=False)):
    ids = [bos] + enc.ids
    if len(ids) > width:
      if on_too_long == "skip":
        keep[i] = False
        continue
      ids = ids[-width:]
    out[i, width - len(ids):] = ids
    mask[i, width - len(ids):] = True
  return out, mask, keep


def encode_answers(tok: Tokenizer, answers: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Encodes supervised completions ``" " + answer + <eos>``, right-padded to ``width``.

  Returns:
    (tokens [B, width] int32, mask [B, width] bool); over-long answers are cut (their
    EOS is lost, so they count as truncated).
  """
  pad, _, eos = special_ids(tok)
  out = np.full((len(answers), width), pad, np.int32)
  mask = np.zeros((len(answers), width), bool)
  for i, enc in enumerate(tok.encode_batch([" " + a for a in answers], add_special_tokens=False)):
    ids = (enc.ids + [eos])[:width]
    out[i, :len(ids)] = ids
    mask[i, :len(ids)] = True
  return out, mask


def decode_completions(tok: Tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
  """Decodes completion rows, dropping masked positions and special tokens.

  Args:
    tokens: [B, M] int completion ids.
    mask: [B, M] bool completion mask.

  Returns:
    B strings.
  """
  rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(np.asarray(tokens), np.asarray(mask))]
  return tok.decode_batch(rows, skip_special_tokens=True)
