"""RECORD: after each learner step, the ledger, the metric record, evaluation and checkpoints.

``record_step`` takes the carry after a step and returns the next one; it is the only
place that writes run files during the loop (the ``metrics/`` files, TensorBoard, the
``samples/`` files, the latest and best checkpoints).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxreplay.parallel import multihost
from jaxreplay.train import accounting
from jaxreplay.train import carry as carry_lib
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train import progress, samples
from jaxreplay.train import self_tuning
from jaxreplay.train.carry import Carry
from jaxreplay.train.ledger import Ledger

HISTOGRAMS = ("staleness_hist", "steps_since_last_use_hist")


def learner_ledger(metrics: dict, batch_size: int) -> tuple[Ledger, dict]:
  """Splits a learner step's host metrics into its ``Ledger`` increment and the rest.

  Args:
    metrics: the learner step's metrics on the host (``multihost.to_host``: numpy scalars).
    batch_size: B, samples trained on per step.

  Returns:
    (``Ledger`` with trained tokens / samples, first-use tokens and training FLOPs;
     the remaining metrics, a new dict).
  """
  rest = dict(metrics)
  inc = Ledger(trained_tokens=int(rest.pop("trained_tokens")),
               first_use_tokens=int(rest.pop("first_use_tokens")),
               training_flops=float(rest.pop("training_flops")), trained_samples=batch_size)
  return inc, rest


def evaluate_and_record(run, params, key, step: int) -> dict:
  """The held-out evaluation of ``params`` at learner step ``step``, with its progress bar
  and duration line, its completion records written to ``samples/eval_STEP.jsonl``.

  Returns:
    The evaluation's metrics (``train.evaluate``, without its records).
  """
  with progress.phase(f"eval step {step}", enabled=run.progress, log=run.log,
                      unit="chunk") as bar:
    evaluation, records = samples.split(run.evaluate(params, key=key, progress=bar))
  samples.write(run.workdir, f"eval_{step}.jsonl", step, records)
  if records:
    run.writer.text(step, "samples/eval", samples.as_text(records))
  return evaluation


def record_step(run, carry: Carry, metrics: dict, gen_metrics: dict,
                extra: dict | None = None, noise=None, trained: dict | None = None) -> Carry:
  """Books learner step ``carry.step`` (steps completed, counting this one).

  Adds the learner's ledger increment, stops a run of non-finite updates, writes one
  metric record, evaluates on the held-out split every ``eval.every`` steps and at the
  end (keeping the best checkpoint), runs the drift monitor every ``drift.every`` steps
  and saves a checkpoint every ``checkpoint.every`` steps and at the end.

  Args:
    run: the ``build.Run``. carry: the carry after the step.
    metrics: the learner step's metrics (host values). gen_metrics: generation metrics of
      the rollouts inserted for this step (host floats; may be empty in ``async``).
    extra: further record entries (``async``: limiter counters).
    noise: (host ``rl.noise.NoiseEstimate``, seconds) of this step's self-tuning estimate
      (``self_tuning.estimate``), or None: with one, the controller decides on it and the
      ledger through this step (``self_tuning.decide``) before the record and checkpoint.
    trained: the rows this step trained on (``samples.peek_trained``), or None: written to
      ``samples/train_STEP.jsonl``.

  Returns:
    The carry with the ledger, timers, evaluation, best checkpoint, skip count and (with
    ``noise``) the controller's state updated.

  Raises:
    RuntimeError: ``algo.max_consecutive_skips`` non-finite updates in a row; a batch that
      drew empty or (without replacement) repeated slots: never trained on silently.
  """
  done, steps = carry.step, run.train.steps
  if metrics["batch_bad_slots"]:
    raise RuntimeError(f"step {done - 1} drew {int(metrics['batch_bad_slots'])} empty or "
                       "repeated buffer slots into its batch: the sampler was called without "
                       "enough eligible items (learner.make_ready)")
  inc, metrics = learner_ledger(metrics, run.train.batch_size)
  ledger = carry.ledger + inc
  last = done == steps or run.train.budget_reached(ledger.generated_rollouts)
  skips = carry.skips + 1 if metrics["skipped_update"] else 0
  if skips >= run.max_consecutive_skips:
    raise RuntimeError(f"{skips} consecutive non-finite updates at step {done - 1}; "
                       "lower algo.lr or check the data")
  hists = {k: metrics.pop(k).tolist() for k in HISTOGRAMS}
  counts, timers = ledger.as_dict(), carry.timers
  derived = accounting.summarize(counts, timers.as_dict())
  record = {**gen_metrics, **{k: float(v) for k, v in metrics.items()}, **counts, **hists,
            "replay_ratio": ledger.trained_samples / max(ledger.generated_rollouts, 1),
            "buffer_size": int(multihost.to_host(carry.buffer.size)), **timers.as_dict(),
            **(extra or {}),
            # deterministic in the lagged strategy; the time-based μ, γ are in the summary
            **{k: v for k, v in derived.items() if k.endswith("_flops")}}
  auto = carry.auto
  if noise is not None:
    auto, auto_metrics = self_tuning.decide(run, auto, done, noise[0], counts)
    record.update(auto_metrics)
    record["auto/estimate_s"] = noise[1]
    if auto_metrics["auto/changed"]:
      run.log(self_tuning.describe(auto.log[-1]))
  last_eval, best = carry.last_eval, carry.best
  if (run.eval.every and done % run.eval.every == 0) or last:
    t0 = time.time()
    last_eval = evaluate_and_record(run, carry.state.params,
                                    jax.random.fold_in(carry_lib.eval_key(carry), done), done)
    timers = timers.replace(eval_s=timers.eval_s + time.time() - t0)
    record.update({f"eval/{k}": v for k, v in last_eval.items()})
    if run.best_manager is not None and run.checkpoint.every:
      best = ckpt_lib.save_best(run.best_manager, best, done, {"train": carry.state}, last_eval)
  if run.fns.drift is not None and done % run.drift.every == 0:
    record.update({k: float(v) for k, v in multihost.to_host(run.fns.drift(
        carry.state.params, carry.buffer, jax.random.fold_in(carry_lib.drift_key(carry), done),
        jnp.int32(done))).items()})
  run.writer.write(done, record)
  if trained is not None:
    rows = samples.train_records(run.io, trained)
    samples.write(run.workdir, f"train_{done}.jsonl", done, rows)
    run.writer.text(done, "samples/train", samples.as_text(rows))
  carry = carry.replace(ledger=ledger, timers=timers, last_eval=last_eval, best=best,
                        skips=skips, auto=auto)
  if run.checkpoint.every and (done % run.checkpoint.every == 0 or last):
    # async: it blocks only while the previous save is still being written
    with progress.phase(f"checkpoint save step {done}", enabled=run.progress, log=run.log):
      carry_lib.save(run, carry)
  return carry
