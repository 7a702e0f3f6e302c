"""Tasks from files: JSONL or Parquet rows in the plain, GSM8K or MATH / OpenR1-Math format.

Formats (``task.format``; column names from ``tasks.spec.field_names``, configurable):

* ``plain``: ``question``, ``answer`` — the answer column is the gold answer as is.
* ``gsm8k``: ``question``, ``answer`` ending in ``#### N`` — the gold is ``N``
  (``math_answer.gsm8k_gold``).
* ``math``: ``problem``, plus ``answer`` (OpenR1-Math) or ``solution`` with a final
  ``\\boxed{}`` (MATH) — the answer column wins when non-empty (``math_answer.math_gold``).

Rows are read with grain: a JSONL file's lines through ``grain.MapDataset.source`` and a
Parquet file through ``grain.experimental.ParquetIterDataset`` (pyarrow), each mapped to an
``Example`` or to ``None`` for a malformed row (bad JSON or UTF-8, not an object, an empty
or missing question, no gold answer in the format's columns, a row the prompt template
cannot fill). Malformed rows are skipped and counted per split (``skipped_rows``). With
``answer_extraction='math'`` or ``'boxed'`` each example's gold is parsed once by math-verify;
a gold it cannot parse makes the example invalid: counted per split (``invalid_gold``) and
excluded.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Iterator

import grain
import numpy as np

from jaxreplay import storage
from jaxreplay.tasks.base import Example, binary_reward
from jaxreplay.tasks.math_answer import gsm8k_gold, math_gold, math_reward_fn, with_parsed_gold
from jaxreplay.tasks.spec import MATH_EXTRACTIONS, TaskSpec, field_names


class ExactMatchReward:
  """``answer_extraction='bare'`` for file tasks as a picklable callable: 1.0 when the
  completion's bare answer (``base.extract_answer``) equals ``example.answer`` exactly."""

  def __call__(self, completion: str, example: Example) -> float:
    return binary_reward(lambda a: float(a is not None and a == example.answer.strip()),
                         completion)


@dataclasses.dataclass
class FileTask:
  """Question/answer pairs from a train file and a held-out file.

  Attributes:
    name: ``"SOURCE:FORMAT"``, e.g. ``"jsonl:gsm8k"``.
    train, heldout: the valid examples (``answer``: the gold text; ``gold``: its parse
      with ``answer_extraction`` ``'math'`` or ``'boxed'``).
    skipped_rows: malformed rows skipped per split.
    invalid_gold: rows whose gold math-verify cannot parse, excluded, per split.
    answer_extraction: ``"bare"`` (exact match of the bare answer), ``"math"`` (the stated
      answer, math-verify) or ``"boxed"`` (the last ``\\boxed{}`` only, math-verify).
    scorer: the ``scoring.Scorer`` the loop uses (set by ``make_task``).
  """

  name: str
  train: list[Example]
  heldout: list[Example]
  skipped_rows: dict[str, int]
  invalid_gold: dict[str, int]
  answer_extraction: str = "bare"
  scorer: Any = None

  @property
  def reward_fn(self):
    """The picklable reward a scoring worker runs (no example lists shipped)."""
    return math_reward_fn(self.answer_extraction) or ExactMatchReward()

  def reward(self, completion: str, example: Example) -> float:
    """Binary reward of ``completion`` for ``example`` (see ``answer_extraction``)."""
    return self.reward_fn(completion, example)


def _json_row(line: bytes) -> dict | None:
  try:
    row = json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    return None
  return row if isinstance(row, dict) else None


def _plain(value: Any) -> Any:
  """A Parquet cell (numpy scalar or Python object) as a plain Python value."""
  return value.item() if isinstance(value, np.generic) else value


def data_files(path: str) -> list[str]:
  """The local files ``path`` names: itself, or the sorted matches of a glob pattern
  (``data/openr1/train-*.parquet``); files on cloud storage (``gs://...``) are copied into
  the local cache once (``storage.local_copy``).

  Raises:
    FileNotFoundError: nothing matches.
  """
  files = storage.glob(path)
  if not files:
    raise FileNotFoundError(f"task data file {path!r} does not exist")
  return [storage.local_copy(f) for f in files]


def read_rows(path: str, source: str) -> Iterator[dict | None]:
  """The rows of JSONL or Parquet files as dicts (``None`` for a line that is not a JSON
  object), read with grain, file after file.

  Args:
    path: a file or a glob pattern (``data_files``). source: ``"jsonl"`` (one JSON object
      per line; blank lines ignored) or ``"parquet"``.

  Returns:
    An iterator of row dicts (column name → Python value) or ``None``.

  Raises:
    FileNotFoundError: no such file. ValueError: an unknown ``source``.
  """
  files = data_files(path)
  if source == "jsonl":
    def rows(f):
      with open(f, "rb") as fh:
        lines = [line for line in fh.read().split(b"\n") if line.strip()]
      ds = grain.MapDataset.source(lines).map(_json_row)
      return (ds[i] for i in range(len(ds)))
  elif source == "parquet":
    from grain.experimental import ParquetIterDataset  # needs pyarrow

    def rows(f):
      return iter(ParquetIterDataset(f).map(
          lambda row: {k: _plain(v) for k, v in row.items()}))
  else:
    raise ValueError(f"task.source={source!r} is not a file source ('jsonl', 'parquet')")
  return itertools.chain.from_iterable(rows(f) for f in files)


def _gold(row: dict, fmt: str, names: dict) -> str | None:
  if fmt == "gsm8k":
    a = row.get(names["answer"])
    return gsm8k_gold(a) if isinstance(a, str) else None
  if fmt == "math":
    return math_gold(row.get(names["answer"]), row.get(names["solution"]))
  a = row.get(names["answer"])
  return str(a).strip() if a is not None and str(a).strip() else None


def read_examples(path: str, source: str, fmt: str = "plain", names: dict | None = None,
                  template: str = "{question}") -> tuple[list[Example], int]:
  """Examples of one file, malformed rows skipped and counted.

  Args:
    path: a file or a glob pattern. source: ``"jsonl"`` or ``"parquet"``. fmt: ``"plain"``, ``"gsm8k"``
      or ``"math"``. names: column names (``tasks.spec.field_names``; default: the
      format's). template: ``str.format`` template of the prompt over ``question`` (the
      question column's text) and every column of the row.

  Returns:
    (examples, skipped rows). ``Example.prompt`` is the filled template, ``answer`` the
    gold text, ``meta`` None (rows can be large; the prompt and gold are all a run needs).

  Raises:
    FileNotFoundError: no such file.
    ValueError: the template names a field the first valid row lacks (the valid fields
      are listed), or the file holds no valid row.
  """
  names = names or field_names({"format": fmt})
  examples, skipped, checked = [], 0, False
  for row in read_rows(path, source):
    q = row.get(names["question"]) if row is not None else None
    gold = _gold(row, fmt, names) if row is not None else None
    if not isinstance(q, str) or not q.strip() or gold is None:
      skipped += 1
      continue
    fields = {k: v for k, v in row.items() if isinstance(k, str) and k.isidentifier()}
    fields["question"] = q
    try:
      prompt = template.format(**fields)
    except (KeyError, IndexError) as e:
      if not checked:
        raise ValueError(f"task.prompt_template={template!r} names field {e}; valid: "
                         f"{', '.join(sorted(fields))}") from None
      skipped += 1
      continue
    checked = True
    examples.append(Example(prompt=prompt, answer=gold))
  if not examples:
    raise ValueError(f"task data file {path!r} has no valid rows ({skipped} malformed; "
                     f"format {fmt!r} reads columns {names})")
  return examples, skipped


def _subset(examples: list[Example], size: int, seed: int, stream: int) -> list[Example]:
  """At most ``size`` examples: all if there are that few, else a seeded random subset in
  file order."""
  if len(examples) <= size:
    return examples
  keep = np.sort(np.random.default_rng([seed, stream]).choice(len(examples), size, replace=False))
  return [examples[i] for i in keep]


def make_file_task(task: TaskSpec) -> FileTask:
  """Builds a task from ``task.train_path`` and ``task.heldout_path``.

  Args:
    task: the ``TaskSpec`` (``source``, ``format``, ``*_field``, ``prompt_template``,
      ``answer_extraction``, ``seed``, ``train_size``, ``heldout_size``, the paths).

  Returns:
    A ``FileTask`` with at most ``train_size`` / ``heldout_size`` examples per split (a
    subset seeded by ``task.seed`` when a file holds more, taken before invalid gold
    answers are excluded).

  Raises:
    FileNotFoundError: a missing file. ValueError: see ``read_examples``, or a split left
      empty once invalid gold answers are excluded.
  """
  cfg = TaskSpec.from_config(task)
  fmt, names = cfg.format, field_names(cfg)
  splits, skipped, invalid = {}, {}, {}
  for stream, split in enumerate(("train", "heldout")):
    path = getattr(cfg, f"{split}_path")
    exs, skipped[split] = read_examples(path, cfg.source, fmt, names, cfg.prompt_template)
    exs = _subset(exs, getattr(cfg, f"{split}_size"), cfg.seed, stream)
    invalid[split] = 0
    if cfg.answer_extraction in MATH_EXTRACTIONS:
      exs, invalid[split] = with_parsed_gold(exs)
      if not exs:
        raise ValueError(f"task.{split}_path={path!r}: no row's gold answer "
                         f"can be parsed by math-verify ({invalid[split]} invalid)")
    splits[split] = exs
  return FileTask(name=f"{cfg.source}:{fmt}", train=splits["train"], heldout=splits["heldout"],
                  skipped_rows=skipped, invalid_gold=invalid,
                  answer_extraction=cfg.answer_extraction)
