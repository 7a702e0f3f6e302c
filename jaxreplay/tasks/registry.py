"""Builds a task, and the scorer the loop scores it with, from the ``task`` section."""

from __future__ import annotations

from jaxreplay.tasks.scoring import Scorer
from jaxreplay.tasks.spec import FILE_SOURCES, SOURCES, validate_task


def make_task(cfg):
  """Builds the task named by ``cfg.source`` and attaches its ``scorer``.

  The scorer runs the task's reward with ``task.reward_timeout_s`` per call, in this
  process (``task.reward_workers=0``) or in that many worker processes
  (``tasks.scoring.Scorer``); training and evaluation both score through it.

  Args:
    cfg: the ``task`` ConfigDict (see ``tasks.spec`` for which option applies to which
      source).

  Returns:
    An object satisfying ``jaxreplay.tasks.Task``, with ``scorer`` set.

  Raises:
    ValueError: an invalid option (``tasks.spec.validate_task``), or data the options do
      not fit (unknown reasoning-gym dataset, a template field the items lack, no valid
      row).
    FileNotFoundError: a missing ``task.train_path`` / ``task.heldout_path``.
  """
  validate_task(cfg)
  if cfg.source == "reasoning_gym":
    from jaxreplay.tasks.reasoning_gym_task import make_reasoning_gym_task
    task = make_reasoning_gym_task(cfg.name, cfg.seed, cfg.train_size, cfg.heldout_size,
                                   dict(cfg.kwargs), cfg.prompt_template,
                                   cfg.get("answer_extraction", "bare"))
  elif cfg.source in FILE_SOURCES:
    from jaxreplay.tasks.file_task import make_file_task
    task = make_file_task(cfg)
  else:
    raise ValueError(f"task.source={cfg.source!r} is not one of {SOURCES}")
  task.scorer = Scorer(task.reward_fn, workers=cfg.get("reward_workers", 0),
                       timeout_s=cfg.get("reward_timeout_s", 0.0) or None)
  return task
