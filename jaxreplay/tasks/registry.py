"""Builds a task from the ``task`` section of the config."""

from __future__ import annotations

import os

from jaxreplay.tasks.jsonl_task import make_jsonl_task
from jaxreplay.tasks.reasoning_gym_task import make_reasoning_gym_task

SOURCES = ("reasoning_gym", "jsonl")


def make_task(cfg):
  """Builds the task named by ``cfg.source``.

  Args:
    cfg: the ``task`` ConfigDict (``source``, ``name``, ``seed``, ``train_size``,
      ``heldout_size``, ``kwargs``, ``prompt_template``, ``answer_extraction``,
      ``train_path``, ``heldout_path``).

  Returns:
    An object satisfying ``jaxreplay.tasks.Task``.

  Raises:
    ValueError: unknown ``task.source`` (lists the valid ones).
    FileNotFoundError: a missing ``task.train_path`` / ``task.heldout_path`` (jsonl).
  """
  if cfg.source == "reasoning_gym":
    return make_reasoning_gym_task(cfg.name, cfg.seed, cfg.train_size, cfg.heldout_size,
                                   dict(cfg.kwargs), cfg.prompt_template,
                                   cfg.get("answer_extraction", "bare"))
  if cfg.source == "jsonl":
    for field in ("train_path", "heldout_path"):
      if not cfg[field] or not os.path.exists(cfg[field]):
        raise FileNotFoundError(f"task.{field}={cfg[field]!r}: no such file (task.source='jsonl' "
                                "needs both task.train_path and task.heldout_path)")
    return make_jsonl_task(cfg.train_path, cfg.heldout_path)
  raise ValueError(f"task.source={cfg.source!r} is not one of {SOURCES}")
