"""The job: set up, restore, train with the configured strategy, summarise.

``train.mode`` picks the strategy: ``sync`` and ``simulated_async`` are the lagged
strategy (``lagged``) with lag 0 and ``train.lag``; ``async`` is the actor–learner
strategy: a generator thread on the learner's devices (``actor_learner``), or, with
``mesh.generator_devices`` > 0, generator and learner on two sub-meshes (``split``). On-policy training is N = R = B in any mode. Read
``run`` top to bottom: it is the whole job.
"""

from __future__ import annotations

import json
import os
import time

from jaxreplay.config import RunConfig
from jaxreplay.parallel import multihost
from jaxreplay.train import accounting
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train import progress
from jaxreplay.train.actor_learner import train_async
from jaxreplay.train.build import Run, build
from jaxreplay.train.carry import Carry, resume
from jaxreplay.train.lagged import train_lagged
from jaxreplay.train.split import train_split


def run(config: RunConfig, log=print) -> dict:
  """Runs the whole job of a validated config; resumes from its workdir if that holds a
  checkpoint.

  Args:
    config: the ``RunConfig`` (``jaxreplay.config.validate(cfg)``). log: message sink.

  Returns:
    The summary dict also written to ``RUN_DIR/summary.json``.

  Raises:
    jaxreplay.config.ConfigError: a workdir holding another run's checkpoint, or task data
      the options do not fit (before any compilation).
    RuntimeError: ``algo.max_consecutive_skips`` non-finite updates in a row; in async
      mode, a failed generator thread or no batch for ``train.async_timeout_s``.
  """
  job, carry = build(config, log)
  carry = resume(job, carry)
  if carry.step >= job.train.steps:
    log(f"the run in {job.workdir} is complete at step {carry.step}; raise "
        "--config.train.steps to continue it")
  elif job.train.budget_reached(carry.ledger.generated_rollouts):
    log(f"the run in {job.workdir} spent its generation budget at step {carry.step}; raise "
        "--config.train.max_generated_rollouts to continue it")
  strategy = (train_split if job.generator_mesh is not None
              else train_async if job.is_async else train_lagged)
  carry = strategy(job, carry)
  return finish(job, carry)


def restore(config: RunConfig, log=print) -> tuple[Run, Carry]:
  """The job's set-up and its latest checkpoint, without training: to inspect a run.

  ``build`` then ``resume``, the metric writer closed again (nothing is appended to the
  run's metrics). Like ``run`` it rewrites ``config.json`` and lets the checkpoint manager
  clear unfinished saves: not for a workdir that a live run is writing.

  Args:
    config: the run's validated config (the one it was trained with; ``train.steps`` may
      differ).
    log: message sink.

  Returns:
    (run, carry): ``carry.step`` is the checkpoint's step (0 and the starting policy when
    the workdir holds none), ``carry.state.params`` the policy at that step,
    ``carry.buffer`` the replay buffer, ``carry.ledger`` the counters.

  Raises:
    jaxreplay.config.ConfigError: an invalid config, or a workdir holding a checkpoint of
      a run with other settings.
  """
  job, carry = build(config, log)
  job.writer.close()
  return job, resume(job, carry)


def _is_grade(key: str) -> bool:
  """An evaluation key of a grader's accuracy: ``acc_greedy_G`` or ``acc_sampled_G``."""
  return key.startswith(("acc_greedy_", "acc_sampled_"))


def finish(job: Run, carry: Carry) -> dict:
  """Waits for the checkpoint writes, closes the writer and writes ``summary.json``.

  Args:
    job: the ``build.Run``. carry: the carry after the last step.

  Returns:
    The summary: held-out accuracy before and after (``acc_{greedy,sampled}_{before,after}``;
    for a math-graded task also ``acc_{greedy,sampled}_{strict,lenient}_{before,after}``),
    generated / trained tokens and rollouts, configured and completed learner steps
    (``steps``, ``steps_done``) and whether the generation budget ended the run
    (``budget_reached``), wall time and phase timers, the ledger with the derived μ, W/T, γ
    and the items still unused in the buffer, the last evaluation, checkpoint paths.
  """
  with progress.phase("checkpoint write", enabled=job.progress, log=job.log):
    job.manager.wait_until_finished()
    if job.best_manager is not None:
      job.best_manager.wait_until_finished()
  job.writer.close()
  before, final, counts = carry.eval_before, carry.last_eval, carry.ledger.as_dict()
  timers = carry.timers.as_dict()
  unused = multihost.to_host(accounting.unused_in_buffer(carry.buffer))
  ledger = {**counts, "unused_in_buffer_rollouts": int(unused[0]),
            "unused_in_buffer_tokens": int(unused[1]), **accounting.summarize(counts, timers)}
  best = carry.best
  summary = {
      "acc_greedy_before": before["acc_greedy"], "acc_sampled_before": before["acc_sampled"],
      "acc_greedy_after": final["acc_greedy"], "acc_sampled_after": final["acc_sampled"],
      # a math-graded task's strict and lenient accuracy (``evaluate.grader_names``), when
      # both evaluations have them
      **{f"{k}_{when}": e[k] for k in before if k in final and _is_grade(k)
         for when, e in (("before", before), ("after", final))},
      "generated_tokens": counts["generated_tokens"], "trained_tokens": counts["trained_tokens"],
      "generated_rollouts": counts["generated_rollouts"], "steps": job.train.steps,
      "steps_done": carry.step,
      "budget_reached": job.train.budget_reached(counts["generated_rollouts"]),
      "wall_seconds": carry.wall_before + time.time() - job.t_start,
      "base_policy": job.base_info["path"], "mode": job.train.mode, **timers,
      "ledger": ledger, "eval_after": final,
      # rows a file source skipped as malformed and examples excluded for an unparseable
      # gold, per split (sources that count them)
      "data_rows": {k: dict(getattr(job.task, k)) for k in ("skipped_rows", "invalid_gold")
                    if isinstance(getattr(job.task, k, None), dict)},
      "checkpoints": os.path.join(job.workdir, "checkpoints"),
      "best_checkpoint": (None if best is None else
                          {"step": best[0], "eval/acc_sampled": best[1],
                           "path": os.path.join(job.workdir, "checkpoints_best", str(best[0]))}),
  }
  if multihost.is_primary():  # one writer per job
    ckpt_lib.write_atomic(os.path.join(job.workdir, "summary.json"), json.dumps(summary, indent=2))
  return summary
