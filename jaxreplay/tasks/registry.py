"""Builds a task, and the scorer the loop scores it with, from the ``task`` section."""

from __future__ import annotations

from jaxreplay.tasks.scoring import Scorer
from jaxreplay.tasks.spec import FILE_SOURCES, TaskSpec


def make_task(task: TaskSpec):
  """Builds the task named by ``task.source`` and attaches its ``scorer``.

  The scorer runs the task's reward with ``task.reward_timeout_s`` per call, in this
  process (``task.reward_workers=0``) or in that many worker processes
  (``tasks.scoring.Scorer``); training and evaluation both score through it.

  Args:
    task: the ``TaskSpec`` (or a ``task`` mapping; see ``tasks.spec`` for which option
      applies to which source).

  Returns:
    An object satisfying ``jaxreplay.tasks.Task``, with ``scorer`` set.

  Raises:
    ValueError: an invalid option (``ConfigError``, from ``TaskSpec``), or data the options
      do not fit (unknown reasoning-gym dataset, a template field the items lack, no valid
      row).
    FileNotFoundError: a missing ``task.train_path`` / ``task.heldout_path``.
  """
  spec = TaskSpec.from_config(task)
  spec.check_files()
  if spec.source in FILE_SOURCES:
    from jaxreplay.tasks.file_task import make_file_task
    built = make_file_task(spec)
  else:
    from jaxreplay.tasks.reasoning_gym_task import make_reasoning_gym_task
    built = make_reasoning_gym_task(spec.name, spec.seed, spec.train_size, spec.heldout_size,
                                    dict(spec.kwargs), spec.prompt_template,
                                    spec.answer_extraction)
  built.scorer = Scorer(built.reward_fn, workers=spec.reward_workers,
                        timeout_s=spec.reward_timeout_s or None)
  return built
