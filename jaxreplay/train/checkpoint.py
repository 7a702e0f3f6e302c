"""Whole-state checkpoints with an Orbax ``CheckpointManager`` (async saves).

Saved per step: the learner ``TrainState`` (params, optimizer, step), the replay
``BufferState``, the RNG key (as ``key_data``), and JSON metadata (data position,
compute ledger, resolved config). Restores go into an abstract target built by the
caller's own init code, so a checkpoint also restores onto another mesh.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxreplay import storage
from jaxreplay.parallel import multihost
from jaxreplay.models.spec import LoraSpec
from jaxreplay.replay.auto import AutoReplaySpec


FAULT_ENV = "JAXREPLAY_FAULT"


def fault_point(name: str, step: int | None = None, detail: str = "") -> None:
  """Test-only fault injection: SIGKILLs this process at a named point.

  Kills when the environment variable ``JAXREPLAY_FAULT`` equals ``name`` or
  ``name:step`` (e.g. ``kill_during_save:3``); otherwise returns at once, having read one
  environment variable. Points: ``kill_during_save`` (an async checkpoint save in flight:
  every file written into its temporary directory, not yet renamed to the step's; raised
  on Orbax's background thread, see ``make_manager``) and ``kill_during_cache_write``
  (base-policy parameters saved, ``info.json`` not yet).

  Args:
    name: the point. step: the learner step, if the point has one.
    detail: text written to stderr just before the kill (what was in flight).
  """
  want = os.environ.get(FAULT_ENV)
  if not want or want not in (name, f"{name}:{step}"):
    return
  sys.stderr.write(f"jaxreplay fault {want}: SIGKILL {detail}\n")
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


class _KillBeforeCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
  """Orbax's atomic-rename temporary path with the ``kill_during_save`` fault point at its
  commit. The kill runs inside the save, so it lands while the save is in flight however
  slowly the main thread is scheduled; a test never races the background thread."""

  async def finalize(self):
    final = self.get_final().name
    if final.isdigit():  # the step's directory (items inside it have names)
      fault_point("kill_during_save", int(final), f"(save in flight: {self.get().name} existed)")
    await super().finalize()


def run_path(path: str | os.PathLike) -> epath.Path:
  """``path`` as an ``etils.epath.Path``: URLs (``gs://bucket/run``) are kept as they are,
  a relative local path is made absolute against the working directory."""
  p = epath.Path(path)
  return p if p.is_absolute() else p.absolute()


def write_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes ``text`` to ``path`` so that a crash leaves the old file or the new one, whole.

  Local files: writes ``path.tmp-PID``, fsyncs it, then ``os.replace``s it over ``path``.
  Object stores (``gs://`` and other ``epath`` URLs) replace an object in one request,
  which is already all or nothing, so the text is written directly.
  """
  storage.write_atomic(path, text)


def use_process_barriers() -> None:
  """Makes Orbax synchronise processes with the distributed runtime's barriers (its key-value
  service) instead of a collective over every device (its default,
  ``multihost_utils.sync_global_devices``).

  Needed when another thread runs programs on part of the devices while the learner
  checkpoints (the actor–learner split): a device-wide collective would interleave with the
  generator's programs in a different order on each process. Sets Orbax's
  ``--experimental_orbax_use_distributed_barrier`` flag, parsed or not.
  """
  from absl import flags
  name = "experimental_orbax_use_distributed_barrier"
  if name in flags.FLAGS:
    flags.FLAGS[name].value = True
    flags.FLAGS[name].present = 1  # readable before absl parses the command line


def make_manager(directory: str | os.PathLike, max_to_keep: int) -> ocp.CheckpointManager:
  """A CheckpointManager at ``directory`` (``run_path``) keeping the last ``max_to_keep`` steps.

  Temporary directories of saves that never finished (a process killed mid-save) are
  removed when the manager is created; they are never read as checkpoints. In a
  multi-process job every process creates the manager on the same directory; Orbax
  coordinates the writes.
  """
  fault = os.environ.get(FAULT_ENV, "").startswith("kill_during_save")
  return ocp.CheckpointManager(
      run_path(directory),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep, enable_async_checkpointing=True,
          cleanup_tmp_directories=True,
          **({"temporary_path_class": _KillBeforeCommit} if fault else {})))


BEST_METRIC = "acc_sampled"  # held-out accuracy of sampled completions (eval/acc_sampled)


def make_best_manager(directory: str | os.PathLike) -> ocp.CheckpointManager:
  """A CheckpointManager at ``directory`` that keeps one checkpoint: the best ``BEST_METRIC``.

  Orbax's ``best_fn`` retention: each save passes ``metrics={BEST_METRIC: value}`` and
  only the highest-valued checkpoint survives. Use ``save_best`` to write to it.
  """
  return ocp.CheckpointManager(
      run_path(directory),
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


class CheckpointReadError(RuntimeError):
  """A checkpoint that could not be read for a reason other than its content (out of
  memory, an I/O, permission or network error, missing storage). Nothing was moved: fix
  the cause and rerun, and the same checkpoint is read."""


# errno values of the storage or the machine, never of a checkpoint's bytes.
_ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, n) for n in ("EACCES", "EPERM", "EIO", "ENOMEM", "ENOSPC", "EROFS",
                                "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED",
                                "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN", "EAGAIN", "EBUSY",
                                "EMFILE", "ENFILE", "ESTALE", "EDQUOT", "ENOLINK")
    if hasattr(errno, n))
# Status codes (absl / gRPC, as XLA and TensorStore print them) and phrases of the same
# kinds of failure: memory, permissions, an unreachable or absent store.
_ENVIRONMENT_MARKERS = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED",
                        "UNAVAILABLE", "DEADLINE_EXCEEDED", "out of memory",
                        "Permission denied", "Input/output error", "NoSuchBucket",
                        "bucket does not exist")


def _chain(e: BaseException):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def environment_cause(e: BaseException) -> str | None:
  """Why ``e`` (raised while reading a checkpoint) is not evidence of a corrupt checkpoint,
  or None when it may be.

  Looks through ``e``'s cause/context chain for ``MemoryError``, ``PermissionError``,
  ``TimeoutError``, ``ConnectionError``, an ``OSError`` whose errno is one of the machine
  or the storage (EACCES, EIO, ENOMEM, ENOSPC, ETIMEDOUT, ...), or a message carrying a
  status code of that kind (``RESOURCE_EXHAUSTED``, ``PERMISSION_DENIED``,
  ``UNAVAILABLE``, ...: XLA's out-of-memory errors and TensorStore's storage errors).

  Returns:
    A short reason (str), or None.
  """
  for x in _chain(e):
    if isinstance(x, MemoryError):
      return "out of memory"
    if isinstance(x, (PermissionError, TimeoutError, ConnectionError)):
      return f"{type(x).__name__}"
    if isinstance(x, OSError) and x.errno in _ENVIRONMENT_ERRNOS:
      return f"OSError {errno.errorcode.get(x.errno, x.errno)}"
    text = str(x)
    for marker in _ENVIRONMENT_MARKERS:
      if marker.lower() in text.lower():
        return marker
  return None


def storage_problem(directory: epath.Path, step: int) -> str | None:
  """Checks that the storage under a checkpoint answers: the manager's directory exists,
  step ``step``'s directory lists, and every file in it opens and yields its first byte.

  A read that failed although all of this works failed on the checkpoint's content: the
  checkpoint is corrupt. Cost: one listing and one small read per file.

  Returns:
    None when the storage answered; else what failed (str).
  """
  try:
    if not directory.exists():
      return f"the checkpoint directory {directory} does not exist (storage missing?)"
    step_dir = directory / str(step)
    if not step_dir.exists():
      return f"{step_dir} disappeared while it was being read"
    todo = [step_dir]
    while todo:  # iterdir, not rglob: epath's rglob refuses "**" on object stores
      for f in todo.pop().iterdir():
        if f.is_dir():
          todo.append(f)
        else:
          with f.open("rb") as fh:
            fh.read(1)
  except Exception as e:  # noqa: BLE001 - any failure of the storage itself
    return f"{type(e).__name__}: {str(e)[:200]}"
  return None


def _set_aside(manager: ocp.CheckpointManager, step: int) -> epath.Path:
  """Renames checkpoint ``step`` to ``STEP.unreadable-TIME`` (process 0; every process
  waits for it and reloads the manager's step list). Returns the new path."""
  directory = epath.Path(manager.directory)
  # The time is process 0's, sent to all so every process reports the same path.
  stamp = int(multihost.agree(int(time.time()))[0])
  aside = directory / f"{step}.unreadable-{stamp}"
  if multihost.is_primary():
    (directory / str(step)).rename(aside)
  multihost.barrier(f"jaxreplay_set_aside_{step}_{stamp}")
  manager.reload()
  return aside


def restore(manager: ocp.CheckpointManager, abstract_state: Any, step: int | None = None,
            log=print):
  """Restores (state, meta) of ``step``, or of the newest readable checkpoint.

  Without ``step`` it tries the checkpoints from newest to oldest. A read that fails is
  classified before anything is touched: when the failure comes from the machine or the
  storage (``environment_cause``: out of memory, an I/O, permission or network error) or
  the storage does not answer (``storage_problem``: missing directory, unreadable files),
  the run stops with ``CheckpointReadError`` and every checkpoint stays where it is. Only
  a checkpoint whose storage answers but whose content fails to read — truncated or
  missing files, unparsable metadata: verified corrupt — is reported through ``log``,
  renamed to ``STEP.unreadable-TIME`` (kept for inspection, out of the manager's way so
  that step can be saved again) and skipped, so the run falls back to the previous
  complete checkpoint. In a multi-process job every process reads its own shards and the
  processes agree (``parallel.multihost.agree``): one environment failure anywhere stops
  all of them, and only process 0 renames.

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
    CheckpointReadError: a read failed for a reason other than corruption (nothing moved).
    RuntimeError: checkpoints exist but none could be read (all verified corrupt).
  """
  abstract = abstract_target(abstract_state)
  steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
  if not steps:
    return None
  errors = []
  for s in steps:
    out, error = None, None
    try:
      out = manager.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                       meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - classified below
      error = e
    cause = None if error is None else (environment_cause(error)
                                        or storage_problem(epath.Path(manager.directory), s))
    # 0: read, 1: verified corrupt, 2: the machine or the storage failed.
    codes = multihost.agree(0 if error is None else (2 if cause else 1))
    if codes.max() == 0:
      return out.state, out.meta
    if codes.max() == 2:
      where = "" if cause else f" on process {int(codes.argmax())}"
      what = f"{type(error).__name__}: {str(error)[:300]}" if error is not None else "see there"
      raise CheckpointReadError(
          f"cannot read the checkpoint at step {s} in {manager.directory}{where} "
          f"({cause or 'another process'}; {what}). This is not a corrupt checkpoint: "
          "nothing was moved. Fix the cause (memory, storage access, permissions) and rerun; "
          "the run resumes from this checkpoint.") from error
    detail = (f"{type(error).__name__}: {str(error)[:200]}" if error is not None
              else "unreadable on another process")
    errors.append(f"step {s}: {detail}")
    if step is None:
      aside = _set_aside(manager, s)
      log(f"checkpoint at step {s} in {manager.directory} is corrupt ({detail[:120]}); "
          f"moved to {aside}, falling back to the previous one")
  raise RuntimeError("no readable checkpoint: " + "; ".join(errors))


def read_meta(manager: ocp.CheckpointManager) -> dict | None:
  """The JSON metadata of the newest checkpoint whose metadata reads (no arrays), or None.

  Raises:
    CheckpointReadError: a read failed for a reason other than corruption
      (``environment_cause``); a corrupt checkpoint's metadata is skipped.
  """
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - classified: corrupt ones are skipped
      cause = environment_cause(e) or storage_problem(epath.Path(manager.directory), step)
      if cause:
        raise CheckpointReadError(
            f"cannot read the metadata of the checkpoint at step {step} in "
            f"{manager.directory} ({cause}; {type(e).__name__}: {str(e)[:300]}). Nothing was "
            "moved: fix the cause and rerun.") from e
      continue
  return None


# Config fields that may change between a run and its resumption: extending the run
# (train.steps, its generation budget train.max_generated_rollouts), where it logs, how often
# it evaluates/saves/monitors drift, which completions it records (not what an evaluation
# measures: before and after must stay comparable), the device mesh (a checkpoint restores
# onto any mesh), how the processes of a job find each other, and where caches live.
RESUMABLE_PREFIXES = ("train.steps", "train.max_generated_rollouts", "train.compile_cost_steps",
                      "workdir", "log.",
                      "eval.every", "eval.record", "checkpoint.", "mesh.", "drift.",
                      "warmstart.cache_dir", "distributed.")


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


# Fields a checkpoint's config may lack because its code had no such field, each with the
# value that behaves as that code did: at this value the run resumes; at another, it is a
# change like any other.
BEHAVES_AS_ABSENT = {"rollout.behaviour_logprobs": "sampler", "eval.batch_rows": 1024,
                     "sampler.slots": 0, "sampler.chunk_steps": 16,
                     "sampler.paged": False, "sampler.page_size": 16, "sampler.num_pages": 0,
                     "sampler.attention": "auto", "sampler.overlap_host_check": False,
                     "sampler.on_weight_swap": "recompute",
                     "algo.pack_sequences": False, "algo.share_prompts": False,
                     # optional model keys before the model spec stated them (absent = off)
                     "model.scan_layers": False, "model.remat": "none", "model.attention": "auto",
                     # the self-tuning replay section, off, before the trainer had it
                     **{f"auto_replay.{k}": v for k, v in AutoReplaySpec().to_dict().items()},
                     # LoRA, off, before the model section had it (tuples are JSON lists)
                     **{f"model.lora.{k}": list(v) if isinstance(v, tuple) else v
                        for k, v in LoraSpec().to_dict().items()}}


def config_changes(saved: dict, current: dict) -> list[str]:
  """Fields whose values differ between a checkpoint's config and the current one.

  Ignores ``RESUMABLE_PREFIXES``, and a field absent from ``saved`` whose current value is
  its ``BEHAVES_AS_ABSENT`` value.

  Args:
    saved, current: nested config dicts (``ConfigDict.to_json_best_effort``, parsed).

  Returns:
    ``"field: saved -> current"`` strings, sorted by field; empty if the run may resume.
  """
  a, b = _flatten(saved), _flatten(current)
  for k, v in BEHAVES_AS_ABSENT.items():
    if k not in a and b.get(k) == v:
      a[k] = v
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_PREFIXES)]
