"""Self-tuning replay in the lagged strategy: the controller of ``replay.auto`` wired in.

With ``auto_replay.enabled`` (``sync`` or ``simulated_async``), at every learner step t with
(t + 1) % ``auto_replay.every`` == 0 (the records ``every``, 2·``every``, ... like the drift
monitor's):

  ESTIMATE  between INSERT and UPDATE, the buffer as the sampler is about to see it and the
            parameters θ_t it is about to update: ``rl.noise.make_buffer_noise_fn`` scores
            ``num_samples`` items (ages = policy version t − the item's version, so the
            freshest are ``lag`` old, 0 in ``sync``) and gives α, ρ and the staleness
            bias (``estimate``; k = ``auto.relative_bias`` of it, used with
            ``auto_replay.bias_limit``);
  DECIDE    after UPDATE, in the step's RECORD (``record.record_step``): μ (the run's
            FLOP μ through step t, or the configured one: ``controller_mu``), then
            ``auto.update`` — R (a multiple of lcm(G, mesh data × fsdp), so a round still
            splits over the mesh) and the age
            cut-off ``max_staleness`` (``lag`` + h − 1 for a horizon of h steps, at least
            ⌈B/R⌉ steps: the trainer's ``learner.make_ready`` wants B items within the
            cut-off for every sampler) (``decide``). The record gets ``noise/*`` and
            ``auto/*``; the checkpoint written by that record holds the new state;
  APPLY     before step t + 1: the ``Run`` with the new ``rollout.per_step`` (its
            ``RolloutSource``) and ``buffer.max_staleness`` (the inserter, learner step
            and ``ready`` built for them, ``build.Run.learner_fns``) (``apply``). The
            buffer's arrays (capacity C) are never reallocated; a new R compiles the
            generation round and the inserter, a new cut-off the learner step, once each.

**μ** is the cost of generating one rollout over training on one sample (``plan``). With
``auto_replay.mu_source='flops'`` (default) it is the run's ``mu_flops`` from step 0
(``accounting``: the model's shapes and the tokens the run generated and trained, the
learner's scoring passes included; restored exactly on resume), so the same config and
seed take the same decisions however loaded the machine, and a ``sync`` run stays
bit-reproducible. It is the compute-bound floor: decoding is memory-bound on
accelerators, so a deployment's μ in seconds is higher (the paper's 5.3); to steer by
such a figure, measured once on an idle machine, set ``mu_source='configured'`` and
``auto_replay.mu``. The wall-time μ (``mu_time``, phase timers) is recorded in the
summary beside ``mu_flops`` and never steers: it moved from 0.95 to 0.15 between an idle
and a loaded machine. The estimate itself is timed apart (``auto/estimate_s``), in
neither phase, and its FLOPs are in neither phase's count.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.replay import auto as auto_lib
from jaxreplay.rl import noise as noise_lib
from jaxreplay.train import accounting
from jaxreplay.train import carry as carry_lib

NO_CUTOFF = -1  # ``auto/max_staleness`` when no age cut-off is in force


def due(run, step: int) -> bool:
  """Whether learner step ``step`` (0-based) estimates: the controller is on and
  (step + 1) % ``auto_replay.every`` == 0."""
  return run.fns.noise is not None and (step + 1) % run.auto_replay.every == 0


def estimate(run, carry, step: int):
  """The noise estimate of learner step ``step`` on ``carry.buffer`` at ``carry.state``.

  Returns:
    (``rl.noise.NoiseEstimate`` of host values, seconds it took).
  """
  t0 = time.time()
  est = run.fns.noise(carry.state.params, carry.buffer,
                      jax.random.fold_in(carry_lib.noise_key(carry), step), carry.state.step)
  est = multihost.to_host(est)
  return est, time.time() - t0


def controller_mu(spec: auto_lib.AutoReplaySpec, counts: dict) -> float:
  """The μ the controller is given (module docstring): ``spec.mu`` when
  ``spec.mu_source='configured'``, else the ledger's FLOP μ so far — NaN before any trained
  sample (the controller then keeps its running value). Reads no timer.

  Args:
    spec: the ``auto_replay`` spec. counts: ``Ledger.as_dict()`` (FLOPs and counts).
  """
  if spec.mu_source == "configured":
    return float(spec.mu)
  return accounting.mu(counts["generation_flops"], counts["generated_rollouts"],
                       counts["training_flops"], counts["trained_samples"])


def rollout_unit(run) -> int:
  """The step R moves in: lcm(G, mesh data × fsdp)."""
  return math.lcm(run.rollout.group_size, sharding_lib.batch_shards(run.mesh))


def _knobs(r: int, s: int | None, prefix: str) -> dict:
  return {f"{prefix}R": float(r), f"{prefix}max_staleness": float(NO_CUTOFF if s is None else s)}


def step_metrics(run) -> dict | None:
  """``auto/R`` and ``auto/max_staleness`` (−1: none) the step ran with, or None when the
  controller is off."""
  if run.learner_fns is None:
    return None
  return _knobs(run.rollout.per_step, run.buffer.max_staleness, "auto/")


def decide(run, state: auto_lib.AutoReplayState, done: int, est,
           counts: dict) -> tuple[auto_lib.AutoReplayState, dict]:
  """Folds an estimate into the controller and plans (``auto.update``).

  Args:
    run: the ``build.Run`` (B, G, C, lag, the mesh, the ``auto_replay`` spec).
    state: the controller state. done: learner steps completed, counting the estimating
      one (the decision's step: the first learner step, 0-based, that uses it).
    est: host ``NoiseEstimate``. counts: the ledger through that step (no timers: the
      decision does not depend on the machine's speed).

  Returns:
    (new state, metrics: ``noise.metrics(est)``; ``auto/mu_measured`` (this μ,
     ``controller_mu``),
     ``auto/mu``, ``auto/alpha``, ``auto/rho``, ``auto/kappa`` (the running values, NaN
     before the first); ``auto/kappa_measured`` (this k, ``auto.relative_bias``); ``auto/next_R`` and ``auto/next_max_staleness`` (in force from the next
     step), ``auto/changed`` (1 when either changed); with a plan (after warm-up)
     ``auto/x``, ``auto/y`` (the solver's x*, y*), ``auto/horizon`` (h),
     ``auto/objective`` and ``auto/x_cap`` (the bound on x the solve used)).
  """
  spec, b = run.auto_replay, run.train.batch_size
  mu = controller_mu(spec, counts)
  kappa = auto_lib.relative_bias(est.bias_slope, est.grad2, est.fresh_var, b)
  new, plan = auto_lib.update(state, done, spec, mu=mu, alpha=float(est.alpha),
                              rho=float(est.rho), batch_size=b, group_size=rollout_unit(run),
                              capacity=run.buffer.capacity, lag=run.lag, min_items=b,
                              kappa=kappa)
  nan = lambda v: float("nan") if v is None else float(v)
  changed = (new.rollouts_per_step, new.max_staleness) != (state.rollouts_per_step,
                                                           state.max_staleness)
  out = {**noise_lib.metrics(est), "auto/mu_measured": float(mu), "auto/mu": nan(new.mu),
         "auto/alpha": nan(new.alpha), "auto/rho": nan(new.rho),
         "auto/kappa_measured": float(kappa), "auto/kappa": nan(new.kappa),
         **_knobs(new.rollouts_per_step, new.max_staleness, "auto/next_"),
         "auto/changed": float(changed)}
  if plan is not None:
    out.update({"auto/x": plan.x, "auto/y": plan.y, "auto/horizon": float(plan.horizon),
                "auto/objective": plan.objective, "auto/x_cap": plan.x_cap})
  return new, out


def describe(change: auto_lib.Change) -> str:
  """One line for the run log."""
  return (f"auto_replay: from step {change.step}: rollout.per_step={change.rollouts_per_step}, "
          f"buffer.max_staleness={change.max_staleness} (mu={change.mu:.3g}, "
          f"alpha={change.alpha:.3g}, rho={change.rho:.3g}: x*={change.x:.3g}, "
          f"y*={change.y:.3g}; {change.reason})")


def apply(run, state: auto_lib.AutoReplayState | None):
  """The ``Run`` with ``state``'s R and age cut-off in force (``run`` itself when they
  already are, or the controller is off): ``rollout.per_step`` in ``rollout`` and the
  ``RolloutSource``, ``buffer.max_staleness``, and the learner-side functions for them
  (``build.Run.learner_fns``, built once per pair)."""
  if state is None or run.learner_fns is None:
    return run
  r, s = state.rollouts_per_step, state.max_staleness
  if (r, s) == (run.rollout.per_step, run.buffer.max_staleness):
    return run
  rollout = dataclasses.replace(run.rollout, per_step=r)
  buffer = dataclasses.replace(run.buffer, max_staleness=s)
  return dataclasses.replace(run, rollout=rollout, buffer=buffer,
                             source=dataclasses.replace(run.source, rollout=rollout),
                             fns=run.learner_fns(r, buffer))


def log_state(run, state: auto_lib.AutoReplayState) -> None:
  """Logs the knobs a resumed run continues with."""
  if state is not None and state.log:
    run.log(f"auto_replay: continuing with rollout.per_step={state.rollouts_per_step}, "
            f"buffer.max_staleness={state.max_staleness} (set at step {state.log[-1].step})")

