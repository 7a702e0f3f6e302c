"""Verifiable tasks: a prompt source plus a reward function (text only, no networks)."""

from jaxreplay.tasks.base import Example, Task, binary_reward

__all__ = ["Example", "Task", "binary_reward", "make_task"]


def __getattr__(name):
  # make_task pulls in reasoning-gym (tens of seconds to import on a loaded machine); a
  # scoring worker process imports this package and needs only its reward function.
  if name == "make_task":
    from jaxreplay.tasks.registry import make_task
    return make_task
  raise AttributeError(f"module 'jaxreplay.tasks' has no attribute {name!r}")
