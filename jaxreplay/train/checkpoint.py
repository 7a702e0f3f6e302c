"""Whole-state checkpoints with an Orbax ``CheckpointManager`` (async saves).

Saved per step: the learner ``TrainState`` (params, optimizer, step), the replay
``BufferState``, the RNG key (as ``key_data``), and JSON metadata (data position,
compute ledger, resolved config). Restores go into an abstract target built by the
caller's own init code, so a checkpoint also restores onto another mesh.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def make_manager(directory: str, max_to_keep: int) -> ocp.CheckpointManager:
  """A CheckpointManager at ``directory`` keeping the last ``max_to_keep`` steps."""
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=True))


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
  """Starts an async save of pytree ``state`` and JSON ``meta`` at ``step``."""
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)))


def restore(manager: ocp.CheckpointManager, abstract_state: Any, step: int | None = None):
  """Restores (state, meta) of ``step`` (default: latest) into ``abstract_state``'s shapes.

  Returns:
    (state pytree, meta dict), or None when the directory holds no checkpoint.
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    return None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
  out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                      meta=ocp.args.JsonRestore()))
  return out.state, out.meta
