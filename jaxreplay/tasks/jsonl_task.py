"""Tasks from JSONL files: one ``{"question": ..., "answer": ...}`` object per line."""

from __future__ import annotations

import dataclasses
import json
import os

from jaxreplay.tasks.base import Example, binary_reward


@dataclasses.dataclass
class JsonlTask:
  """Question/answer pairs from files, scored by exact match of the extracted answer.

  Attributes:
    name: ``"jsonl"``.
    train, heldout: examples read from the two files.
    skipped_rows: malformed rows skipped per split (bad JSON, non-UTF-8, missing or
      empty ``question``/``answer``).
  """

  name: str
  train: list[Example]
  heldout: list[Example]
  skipped_rows: dict[str, int]

  def reward(self, completion: str, example: Example) -> float:
    """1.0 if the extracted answer equals the gold answer (whitespace-stripped), else 0.0."""
    return binary_reward(lambda a: float(a is not None and a == example.answer.strip()),
                         completion)


def read_jsonl_examples(path: str) -> tuple[list[Example], int]:
  """Reads examples from a JSONL file, skipping and counting malformed rows.

  Args:
    path: file with one JSON object per line, fields ``question`` and ``answer``.

  Returns:
    (examples, number of skipped rows).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: the file holds no valid row.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"task data file {path!r} does not exist")
  examples, skipped = [], 0
  with open(path, "rb") as f:
    for raw in f:
      if not raw.strip():
        continue
      try:
        row = json.loads(raw.decode("utf-8"))
        q, a = row["question"], row["answer"]
        if not isinstance(q, str) or not q.strip() or str(a).strip() == "":
          raise ValueError("empty field")
        examples.append(Example(prompt=q, answer=str(a).strip(), meta=row))
      except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        skipped += 1
  if not examples:
    raise ValueError(f"task data file {path!r} has no valid rows ({skipped} malformed)")
  return examples, skipped


def make_jsonl_task(train_path: str, heldout_path: str) -> JsonlTask:
  """Builds a task from a train and a held-out JSONL file (see ``read_jsonl_examples``)."""
  train, s_train = read_jsonl_examples(train_path)
  heldout, s_held = read_jsonl_examples(heldout_path)
  return JsonlTask(name="jsonl", train=train, heldout=heldout,
                   skipped_rows={"train": s_train, "heldout": s_held})
