"""Entry point: ``python -m jaxreplay.main --config configs/default.py [--config.a.b=v ...]``."""

from __future__ import annotations

import ast

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Path to a config file with get_config().",
                                          lock_config=True)


def main(argv) -> None:
  """Runs the configured job and prints its summary; a bad config exits with one line."""
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
  from jaxreplay.config import ConfigError, specs, validate
  try:
    cfg = _CONFIG.value  # the config file is loaded lazily: touch it here
    cfg["seed"]
  except (flags.Error, OSError, AttributeError, KeyError, TypeError, ValueError) as e:
    msg = " ".join(str(e).split())
    raise SystemExit(f"jaxreplay: cannot load --config: {msg}") from None
  try:  # every section's own fields, before JAX starts (the device checks need it)
    config = specs(cfg)
  except ConfigError as e:
    raise SystemExit(f"jaxreplay: {e}") from None
  set_device_memory_fraction(config.train.device_memory_fraction)
  enable_compilation_cache(config.train.compilation_cache_dir)
  settings = config.distributed.settings()
  if settings is not None:  # before any other JAX call (launch/: TPU pods, SLURM, local)
    from jaxreplay.parallel import multihost
    multihost.initialize(**settings)
  from jaxreplay.train.actor_learner import NoBatchError
  from jaxreplay.train.checkpoint import CheckpointReadError
  from jaxreplay.train.loop import run  # after flag parsing: keeps --help fast
  try:
    s = run(validate(config))
  except ConfigError as e:  # a bad config fails before any compute, without a traceback
    raise SystemExit(f"jaxreplay: {e}") from None
  except CheckpointReadError as e:  # the machine or the storage failed: nothing was moved
    raise SystemExit(f"jaxreplay: {e}") from None
  except NoBatchError as e:  # async: the buffer never offered a batch; the last checkpoint stays
    raise SystemExit(f"jaxreplay: {e}") from None
  import jax
  if jax.process_index() != 0:  # process 0 reports for the job
    return
  print("\n" + "\n".join(summary_lines(s, config.sampler.temperature)))


def set_device_memory_fraction(fraction: float) -> str | None:
  """Sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to ``fraction`` (``train.device_memory_fraction``)
  unless the variable is already set; call before JAX starts its backend.

  JAX's GPU allocator reserves that fraction of each device's memory at start-up (0.75 by
  default) and can use no more; a program whose peak (``bench/memory_plan.py``) fits the
  device but not 75% of it fails at its first step. CPUs and TPUs ignore the variable.

  Args:
    fraction: in [0, 1); 0 leaves JAX's default.

  Returns:
    The variable's value in effect ("0.9"), or None when neither it nor ``fraction`` is set.

  Raises:
    RuntimeError: ``fraction`` is set (> 0) but JAX's backend has already started, so the
      setting could not take effect.
  """
  import os
  import sys
  if os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
    return os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
  if not fraction:
    return None
  xla_bridge = sys.modules.get("jax._src.xla_bridge")
  started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
  if xla_bridge is not None and started():
    raise RuntimeError("train.device_memory_fraction must be set before JAX starts its "
                       "backend; set XLA_PYTHON_CLIENT_MEM_FRACTION instead")
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
  return os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]


def enable_compilation_cache(path: str) -> str | None:
  """Points JAX's persistent compilation cache at ``path`` (``train.compilation_cache_dir``)
  unless ``JAX_COMPILATION_CACHE_DIR`` already names one; call before anything compiles.

  Programs that took at least JAX's ``jax_persistent_cache_min_compile_time_secs`` (1 s by
  default) to compile are written there and loaded by the next process that compiles the
  same program — same results, without the compile.

  Args:
    path: a directory (``~`` expanded; created by JAX) or a URL; "" leaves the cache off.

  Returns:
    The directory in use, or None when the cache is off.
  """
  import os
  env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if env:  # JAX reads the variable itself
    return env
  if not path:
    return None
  import jax
  cache = path if "://" in path else os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", cache)
  return cache


# The graders a math-graded task's evaluations report (``train.evaluate.grader_names``) and
# what each counts, for the summary.
GRADE_LINES = (("strict", "last \\boxed{} only"), ("lenient", "last number, any format"))


def summary_lines(s: dict, temperature: float) -> list[str]:
  """The job's closing summary, one string per printed line.

  Args:
    s: ``train.loop.run``'s summary: held-out accuracy before/after (fractions; a
      math-graded task's strict and lenient ones get a line each when present), token and
      rollout counts, ``ledger``, ``wall_seconds`` and the ``generate_s``/``train_s``/``eval_s``
      phase times (seconds), ``checkpoints`` and ``base_policy`` paths.
    temperature: the sampler's temperature, named on the sampled-accuracy line.

  Returns:
    Lines; μ from FLOPs beside μ from wall time when the ledger has both; the wall time's
    breakdown names the rest ("other": set-up, the warm start, the evaluation before RL,
    which ``eval_s`` leaves out, and checkpoints), so in sync
    mode its parts add up to the total. In async mode generation
    and training overlap, their seconds can sum past the wall time, and "other" stays at 0.

  Raises:
    KeyError: ``s`` lacks one of the fields above.
  """
  lines = ["=== jaxreplay summary ===",
           f"held-out accuracy, sampled at T={temperature}: "
           f"{s['acc_sampled_before']:.3f} -> {s['acc_sampled_after']:.3f}",
           f"held-out accuracy, greedy: {s['acc_greedy_before']:.3f} -> "
           f"{s['acc_greedy_after']:.3f}",
           *[f"held-out accuracy, {g} ({how}), sampled: "
             f"{s[f'acc_sampled_{g}_before']:.3f} -> {s[f'acc_sampled_{g}_after']:.3f}, "
             f"greedy: {s[f'acc_greedy_{g}_before']:.3f} -> {s[f'acc_greedy_{g}_after']:.3f}"
             for g, how in GRADE_LINES if f"acc_sampled_{g}_before" in s],
           f"generated tokens: {s['generated_tokens']}  trained tokens: {s['trained_tokens']}  "
           f"rollouts: {s['generated_rollouts']}"]
  lost = s["ledger"].get("lost_in_flight_rollouts", 0)
  if lost:
    lines.append(f"rollouts generated but never inserted (queued or in flight at the stop): {lost}")
  phases = s["generate_s"] + s["train_s"] + s["eval_s"]
  other = max(0.0, s["wall_seconds"] - phases)
  lines += [f"wall time: {s['wall_seconds'] / 60:.1f} min  (generate {s['generate_s']:.0f}s, "
            f"train {s['train_s']:.0f}s, eval {s['eval_s']:.0f}s, other {other:.0f}s: set-up, "
            "warm start, the evaluation before RL, checkpoints)",
            f"checkpoints: {s['checkpoints']}", f"base policy: {s['base_policy']}"]
  led = s["ledger"]
  if "mu_flops" in led and "mu_time" in led:  # beside each other: only FLOPs are the run's own
    lines.insert(-2, f"mu (generating a rollout / training on a sample): {led['mu_flops']:.3f} "
                 f"from FLOPs, {led['mu_time']:.3f} from wall time (moves with the machine's load)")
  return lines


def _parse_flags(argv):
  """absl flag parsing with a one-line error for a misspelt or ill-typed config override."""
  try:
    rest = flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    # KeyError's str() is a repr (quotes, escapes): the message itself is its first arg.
    msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    msg = " ".join(msg.replace("\\n", " ").split())
    if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":  # a KeyError's repr, nested
      try:
        msg = ast.literal_eval(msg)
      except (ValueError, SyntaxError):
        msg = msg[1:-1]
    # Name the override the message is about (absl's messages give only the leaf field).
    named = [a.split("=")[0][2:] for a in argv[1:] if a.startswith("--config.")
             and a.split("=")[0].rsplit(".", 1)[-1] in msg]
    where = f"{named[0]}: " if named else ""
    if "Non-boolean argument" in msg:
      msg += "; valid: true, false (or 1, 0)"
    raise SystemExit(f"jaxreplay: bad command line: {where}{msg}") from None
  if len(rest) > 1:  # e.g. a config path given without --config: never run the default
    raise SystemExit(f"jaxreplay: unexpected argument(s) {' '.join(rest[1:])!r}; pass the "
                     "config file as --config PATH and overrides as --config.FIELD=VALUE")
  return rest


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
