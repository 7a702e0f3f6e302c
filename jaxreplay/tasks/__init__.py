"""Verifiable tasks: a prompt source plus a reward function (text only, no networks)."""

from jaxreplay.tasks.base import Example, Task, binary_reward
from jaxreplay.tasks.registry import make_task

__all__ = ["Example", "Task", "binary_reward", "make_task"]
