"""Builds a task from the ``task`` section of the config."""

from __future__ import annotations

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
  """
  if cfg.source == "reasoning_gym":
    return make_reasoning_gym_task(cfg.name, cfg.seed, cfg.train_size, cfg.heldout_size,
                                   dict(cfg.kwargs), cfg.prompt_template,
                                   cfg.get("answer_extraction", "bare"))
  if cfg.source == "jsonl":
    return make_jsonl_task(cfg.train_path, cfg.heldout_path)
  raise ValueError(f"task.source={cfg.source!r} is not one of {SOURCES}")
