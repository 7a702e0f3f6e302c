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


def read_meta(manager: ocp.CheckpointManager) -> dict | None:
  """The JSON metadata of the latest checkpoint (no arrays read), or None if there is none."""
  step = manager.latest_step()
  if step is None:
    return None
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


# Config fields that may change between a run and its resumption: extending the run
# (train.steps), where it logs, how often it evaluates/saves, and where caches live.
RESUMABLE_PREFIXES = ("train.steps", "workdir", "log.", "eval.", "checkpoint.",
                      "warmstart.cache_dir")


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_changes(saved: dict, current: dict) -> list[str]:
  """Fields whose values differ between a checkpoint's config and the current one,
  ignoring ``RESUMABLE_PREFIXES``; each as ``"field: saved -> current"``."""
  a, b = _flatten(saved), _flatten(current)
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_PREFIXES)]
