"""Whole-state checkpoints with an Orbax ``CheckpointManager`` (async saves).

Saved per step: the learner ``TrainState`` (params, optimizer, step), the replay
``BufferState``, the RNG key (as ``key_data``), and JSON metadata (data position,
compute ledger, resolved config). Restores go into an abstract target built by the
caller's own init code, so a checkpoint also restores onto another mesh.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp


FAULT_ENV = "JAXREPLAY_FAULT"


def fault_point(name: str, step: int | None = None, detail: str = "") -> None:
  """Test-only fault injection: SIGKILLs this process at a named point.

  Kills when the environment variable ``JAXREPLAY_FAULT`` equals ``name`` or
  ``name:step`` (e.g. ``kill_during_save:3``); otherwise does nothing. Points:
  ``kill_during_save`` (an async checkpoint save just started, still in flight) and
  ``kill_during_cache_write`` (base-policy parameters saved, ``info.json`` not yet).

  Args:
    name: the point. step: the learner step, if the point has one.
    detail: text written to stderr just before the kill (what was in flight).
  """
  want = os.environ.get(FAULT_ENV)
  if want and want in (name, f"{name}:{step}"):
    sys.stderr.write(f"jaxreplay fault {want}: SIGKILL {detail}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` so that a crash leaves the old file or the new one, whole.

  Writes ``path.tmp-PID``, fsyncs it, then ``os.replace``s it over ``path``.
  """
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def make_manager(directory: str, max_to_keep: int) -> ocp.CheckpointManager:
  """A CheckpointManager at ``directory`` keeping the last ``max_to_keep`` steps.

  Temporary directories of saves that never finished (a process killed mid-save) are
  removed when the manager is created; they are never read as checkpoints.
  """
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=True,
                                           cleanup_tmp_directories=True))


BEST_METRIC = "acc_sampled"  # held-out accuracy of sampled completions (eval/acc_sampled)


def make_best_manager(directory: str) -> ocp.CheckpointManager:
  """A CheckpointManager at ``directory`` that keeps one checkpoint: the best ``BEST_METRIC``.

  Orbax's ``best_fn`` retention: each save passes ``metrics={BEST_METRIC: value}`` and
  only the highest-valued checkpoint survives. Use ``save_best`` to write to it.
  """
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=1, best_fn=lambda m: m[BEST_METRIC], best_mode="max",
          keep_checkpoints_without_metrics=False, enable_async_checkpointing=True,
          cleanup_tmp_directories=True))


def best_so_far(manager: ocp.CheckpointManager) -> tuple[int, float] | None:
  """(step, value) of the checkpoint in a ``make_best_manager`` directory, or None if empty."""
  meta = read_meta(manager)
  if meta is None:
    return None
  return int(meta["step"]), float(meta["eval"][BEST_METRIC])


def save_best(manager: ocp.CheckpointManager, best: tuple[int, float] | None, step: int,
              state: Any, evaluation: dict) -> tuple[int, float] | None:
  """Saves ``state`` at ``step`` when ``evaluation[BEST_METRIC]`` beats ``best`` (strictly).

  Args:
    manager: from ``make_best_manager``. best: the current (step, value), or None.
    step: learner step of ``state``. state: pytree to save (async).
    evaluation: the held-out evaluation dict of ``state`` (floats; needs ``BEST_METRIC``).

  Returns:
    The new (step, value) best; ``best`` unchanged when not improved or when ``step`` is
    already stored (a resumed run recomputing steps saved before a crash).
  """
  value = float(evaluation[BEST_METRIC])
  if (best is not None and value <= best[1]) or step in manager.all_steps():
    return best
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      meta=ocp.args.JsonSave({"step": step, "eval": dict(evaluation)})),
      metrics={BEST_METRIC: value}, force=True)
  return step, value


def abstract_target(tree: Any, shardings: Any = None) -> Any:
  """``jax.ShapeDtypeStruct`` leaves (shape, dtype, sharding) to restore ``tree`` into.

  Args:
    tree: a pytree of arrays or ShapeDtypeStructs (e.g. ``jax.eval_shape`` of the init).
    shardings: optional pytree of ``jax.sharding.Sharding`` matching ``tree`` (e.g.
      ``parallel.param_shardings`` on the new mesh); default: each leaf's own sharding.

  Returns:
    A pytree of ShapeDtypeStructs; restoring into it lays the arrays out as given, whatever
    mesh or device count the checkpoint was written with.
  """
  if shardings is None:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
  """Starts an async save of pytree ``state`` and JSON ``meta`` at ``step``.

  Orbax writes into a temporary directory and renames it to ``step`` when complete, so a
  crash mid-save leaves no directory named ``step`` (see ``make_manager``).

  Raises:
    RuntimeError: Orbax declined the save (``step`` not after the latest checkpoint).
  """
  if not manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta))):
    raise RuntimeError(f"checkpoint at step {step} not written: {manager.directory} already "
                       f"holds step {manager.latest_step()}")
  fault_point("kill_during_save", step, f"(save in progress: {manager.is_saving_in_progress()})")


def restore(manager: ocp.CheckpointManager, abstract_state: Any, step: int | None = None,
            log=print):
  """Restores (state, meta) of ``step``, or of the newest readable checkpoint.

  Without ``step`` it tries the checkpoints from newest to oldest: a corrupted or
  truncated one is reported through ``log``, renamed to ``STEP.unreadable-TIME`` (kept for
  inspection, out of the manager's way so that step can be saved again) and skipped, so
  the run falls back to the previous complete checkpoint.

  Args:
    manager: the CheckpointManager. abstract_state: a pytree with the target shapes,
      dtypes and shardings (arrays or ShapeDtypeStructs, see ``abstract_target``), e.g.
      freshly initialised state placed on the current mesh. The arrays come back with
      those shardings, also when the checkpoint was written on another mesh.
    step: a specific step (no fallback), or None.
    log: callable for the fallback messages.

  Returns:
    (state pytree, meta dict), or None when the directory holds no checkpoint.

  Raises:
    RuntimeError: checkpoints exist but none could be read.
  """
  abstract = abstract_target(abstract_state)
  steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
  if not steps:
    return None
  errors = []
  for s in steps:
    try:
      out = manager.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                       meta=ocp.args.JsonRestore()))
      return out.state, out.meta
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
      errors.append(f"step {s}: {type(e).__name__}: {str(e)[:200]}")
      if step is None:
        aside = os.path.join(str(manager.directory), f"{s}.unreadable-{int(time.time())}")
        os.replace(os.path.join(str(manager.directory), str(s)), aside)
        manager.reload()
        log(f"checkpoint at step {s} in {manager.directory} is unreadable "
            f"({type(e).__name__}); moved to {aside}, falling back to the previous one")
  raise RuntimeError("no readable checkpoint: " + "; ".join(errors))


def read_meta(manager: ocp.CheckpointManager) -> dict | None:
  """The JSON metadata of the newest checkpoint whose metadata reads (no arrays), or None."""
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception:  # noqa: BLE001 - a corrupted checkpoint: look at the previous one
      continue
  return None


# Config fields that may change between a run and its resumption: extending the run
# (train.steps), where it logs, how often it evaluates/saves/monitors drift (not what an
# evaluation measures: before and after must stay comparable), the device mesh (a checkpoint
# restores onto any mesh), and where caches live.
RESUMABLE_PREFIXES = ("train.steps", "workdir", "log.", "eval.every", "checkpoint.", "mesh.",
                      "drift.", "warmstart.cache_dir")


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
