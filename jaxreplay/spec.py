"""What every config section spec shares: typed fields, one-line errors, a field reference.

A section spec is a frozen dataclass that subclasses ``Spec`` and declares its fields with
``field(default, ...)``: the default is the embedded default run's value, and the keyword
arguments say what is allowed (``choices``, bounds). ``Spec.from_config`` builds it from its
config section (a ``ConfigDict`` or a dict; absent keys take the defaults, unknown keys are
refused with a near match), and construction checks every field — its type from the
annotation, its choices, its bounds — then the spec's own ``check`` (rules between fields
of the section). Errors are one-line ``ConfigError`` s:
``"SECTION.FIELD=VALUE is invalid: what is allowed"``.

Rules that read several sections live in ``jaxreplay.config.check_combinations``. The
field reference ``docs/configuration.md`` is generated from the specs (``describe``; the
one-line meaning of a field is the first sentence of its entry under ``Attributes:`` in the
spec's docstring).

This module imports nothing heavy, so validating a config loads neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import re
from typing import Any, ClassVar, Mapping


class ConfigError(ValueError):
  """A config field has an invalid value; the message names field, value and what is allowed."""


def fail(section: str, name: str, value: Any, allowed: str):
  """Raises ``ConfigError("SECTION.NAME=VALUE is invalid: ALLOWED")`` (one line)."""
  where = f"{section}.{name}" if section else name
  raise ConfigError(" ".join(f"{where}={show(value)} is invalid: {allowed}".split()))


def show(value: Any) -> str:
  """A one-line repr of a config value (a ``ConfigDict`` shown as a dict)."""
  to_dict = getattr(value, "to_dict", None)
  return repr(to_dict() if callable(to_dict) else value)


def near(value: Any, valid) -> str:
  """``" (did you mean 'x'?)"`` for the closest of ``valid`` to ``value``, else ``""``."""
  match = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
  return f" (did you mean {match[0]!r}?)" if match else ""


def field(default: Any, *, choices: tuple | None = None, ge: float | None = None,
          gt: float | None = None, le: float | None = None, lt: float | None = None,
          allowed: str = ""):
  """A spec field: its default and what values are allowed.

  Args:
    default: the default (the embedded default run's value); a list becomes a tuple.
    choices: the valid values of a string (or other) field.
    ge, gt, le, lt: bounds of a number field (``>=``, ``>``, ``<=``, ``<``).
    allowed: extra text for the reference, for rules ``check`` enforces (e.g. "(0 = off)").

  Returns:
    A ``dataclasses.field`` carrying these in its metadata.
  """
  if isinstance(default, list):
    default = tuple(default)
  meta = dict(choices=choices, ge=ge, gt=gt, le=le, lt=lt, allowed=allowed)
  if isinstance(default, dict):
    return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


_TYPE_WORDS = {"int": "an int", "float": "a number", "bool": "a bool", "str": "a string",
               "tuple": "a tuple", "dict": "a dict"}


def _kinds(annotation: str) -> tuple[list[str], bool]:
  """The base type names of an annotation string and whether None is allowed."""
  parts = [p.strip() for p in str(annotation).split("|")]
  return [p for p in parts if p != "None"], "None" in parts


def _type_ok(kind: str, value: Any) -> bool:
  if kind == "bool":
    return isinstance(value, bool)
  if kind == "int":
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
  if kind == "float":
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
  if kind == "str":
    return isinstance(value, str)
  if kind == "tuple":
    return isinstance(value, (tuple, list))
  if kind == "dict":
    return isinstance(value, Mapping) or callable(getattr(value, "to_dict", None))
  return True


def _bounds_text(meta: Mapping[str, Any]) -> str:
  ge, gt, le, lt = meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt")
  lo = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
  hi = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
  if lo and hi:
    return f"in {lo}, {hi}"
  if ge is not None:
    return f">= {ge:g}"
  if gt is not None:
    return f"> {gt:g}"
  if le is not None:
    return f"<= {le:g}"
  if lt is not None:
    return f"< {lt:g}"
  return ""


def _in_bounds(meta: Mapping[str, Any], v: float) -> bool:
  return ((meta.get("ge") is None or v >= meta["ge"]) and (meta.get("gt") is None or v > meta["gt"])
          and (meta.get("le") is None or v <= meta["le"])
          and (meta.get("lt") is None or v < meta["lt"]))


def allowed_text(f: dataclasses.Field) -> str:
  """What a field allows, as the reference and the error messages say it."""
  kinds, optional = _kinds(f.type)
  meta = f.metadata
  if meta.get("choices") is not None:
    text = "one of " + ", ".join(repr(c) for c in meta["choices"])
  else:
    word = " or ".join(_TYPE_WORDS.get(k, k) for k in kinds)
    bounds = _bounds_text(meta)
    text = f"{word} {bounds}".strip() if bounds else word
  if optional:
    text += ", or None"
  if meta.get("allowed"):
    text += " " + meta["allowed"]
  return text


@dataclasses.dataclass(frozen=True)
class Spec:
  """Base of the section specs: construction checks every field, then ``check``.

  Subclasses set ``SECTION`` (the config key) and declare fields with ``field``.
  """

  SECTION: ClassVar[str] = ""

  @classmethod
  def from_config(cls, node: Any = None):
    """The spec of a config section; absent keys take the defaults.

    Args:
      node: a mapping with ``keys()`` and ``[]`` (``ConfigDict``, dict), None (all
        defaults), or an instance of this spec (returned as is).

    Returns:
      The validated spec.

    Raises:
      ConfigError: a key that is not a field (named with a near match), or a bad value.
    """
    if isinstance(node, cls):
      return node
    if node is None:
      return cls()
    if not isinstance(node, Mapping) and not hasattr(node, "keys"):
      fail("", cls.SECTION, node, f"must be a section (a ConfigDict or dict of fields)")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in node.keys():
      if key not in names:
        match = difflib.get_close_matches(str(key), names, n=1)
        raise ConfigError(f"{cls.SECTION}.{key} is not a field of the {cls.SECTION} section"
                          + (f" (did you mean {cls.SECTION}.{match[0]}?)" if match else ""))
    return cls(**{key: node[key] for key in node.keys()})

  def __post_init__(self):
    for f in dataclasses.fields(self):
      self._check_field(f)
    self.check()

  def _check_field(self, f: dataclasses.Field) -> None:
    value = getattr(self, f.name)
    kinds, optional = _kinds(f.type)
    if value is None:
      if not optional:
        fail(self.SECTION, f.name, value, f"must be {allowed_text(f)}")
      return
    meta = f.metadata
    if kinds and not any(_type_ok(k, value) for k in kinds):
      fail(self.SECTION, f.name, value, f"must be {allowed_text(f)}")
    if meta.get("choices") is not None and value not in meta["choices"]:
      fail(self.SECTION, f.name, value,
           f"must be one of {tuple(meta['choices'])}{near(value, meta['choices'])}")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
      if value != value:  # NaN fails every bound, and would pass a field without one
        fail(self.SECTION, f.name, value, f"must be {_bounds_text(meta)}" if _bounds_text(meta)
             else "must be a number, not NaN")
      if not _in_bounds(meta, value):
        extra = f" {meta['allowed']}" if meta.get("allowed") else ""
        fail(self.SECTION, f.name, value, f"must be {_bounds_text(meta)}{extra}")
    if "tuple" in kinds and isinstance(value, list):
      object.__setattr__(self, f.name, tuple(value))
    if "dict" in kinds and not isinstance(value, dict):
      object.__setattr__(self, f.name, _to_dict(value))

  def check(self) -> None:
    """Rules between fields of this section; raises ``ConfigError`` (override)."""

  def fail(self, name: str, value: Any, allowed: str):
    """Raises ``ConfigError`` for ``SECTION.name``."""
    fail(self.SECTION, name, value, allowed)

  def to_dict(self) -> dict:
    """The fields as a plain dict (tuples stay tuples)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _to_dict(value) -> dict:
  to_dict = getattr(value, "to_dict", None)
  return dict(to_dict()) if callable(to_dict) else dict(value)


def attribute_docs(cls) -> dict[str, str]:
  """Each field's one-line meaning: the first sentence of its ``Attributes:`` entry.

  An entry may name several fields (``eps_low, eps_high: ...``); they share the sentence.

  Args:
    cls: a spec class whose docstring has a Google-style ``Attributes:`` section.

  Returns:
    {field name: sentence}; fields without an entry are absent.
  """
  doc = cls.__doc__ or ""
  lines = doc.split("Attributes:", 1)[1].splitlines() if "Attributes:" in doc else []
  entries: list[tuple[list[str], list[str]]] = []
  indent = None
  for line in lines:
    if not line.strip():
      continue
    ind = len(line) - len(line.lstrip())
    if indent is None:
      indent = ind
    if ind < indent:
      break
    m = re.match(r"^([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)\s*:\s*(.*)$", line.strip())
    if ind == indent and m:
      entries.append(([n.strip() for n in m.group(1).split(",")], [m.group(2)]))
    elif entries:
      entries[-1][1].append(line.strip())
  out = {}
  for names, text in entries:
    sentence = _first_sentence(" ".join(text))
    for n in names:
      out[n] = sentence
  return out


_NOT_AN_END = ("e.g.", "i.e.", "Dr.", "vs.", "etc.")


def _first_sentence(text: str) -> str:
  """Text up to the first period that ends a sentence (not ``e.g.``, ``Dr.`` ...)."""
  for m in re.finditer(r"\.(\s|$)", text):
    head = text[:m.start() + 1]
    if not head.endswith(_NOT_AN_END):
      return head.strip()
  return text.strip()
