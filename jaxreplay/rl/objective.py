"""The learner's loss as a function of the policy's per-token outputs.

Per sampled item i with weight w_i (sampling × staleness correction,
``jaxreplay.rl.weights``) and per token t on the loss mask:

  ℓ_it = w_i · (pg_it + β·kl_it − c_H·H_it)   →  aggregate(ℓ, mask, algo.aggregation)
         + c_V · aggregate(w_i · value_loss_it)          (``gae`` only)

where pg is the configured policy loss (``losses.POLICY_LOSSES``, one contract, dispatched
by name), kl a sampled KL estimate to the frozen reference (``algo.kl_mode='loss'``), H
the full-distribution entropy. Tokens whose ratio falls outside [1/c, c]
(``algo.ratio_mask_c``) contribute no policy-gradient term; the normaliser still counts
them, so masking never up-weights the rest.

The advantages are the stored group advantages, or — for ``algo.advantage='gae'`` —
``gae_advantages``, which the train step computes from the critic's values before calling
``objective``; ``objective`` itself only combines per-token losses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxreplay.rl import advantages as adv_lib
from jaxreplay.rl import diagnostics, losses, value
from jaxreplay.rl import weights as weights_lib
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout

sg = jax.lax.stop_gradient


def _whiten(x_bt, mask_bt):
  """Masked (x − mean)/std; only centred when the spread is ~0 (no amplified residue)."""
  mean = losses.masked_mean(x_bt, mask_bt)
  c = jnp.where(mask_bt, x_bt - mean, 0.0)
  std = jnp.sqrt(losses.masked_mean(c * c, mask_bt))
  return jnp.where(std > 1e-4, c / jnp.maximum(std, 1e-4), c)


def gae_advantages(spec: AlgoSpec, batch: Rollout, start_values_bt, *, logp_bt=None,
                   ref_logp_bt=None) -> tuple[jax.Array, jax.Array]:
  """Per-token advantages and value targets of the learner step (``algo.advantage='gae'``).

  Token rewards are each completion's outcome reward on its last loss token
  (``advantages.terminal_rewards``), minus β·kl_t per token when ``algo.kl_mode='reward'``
  (Ziegler et al. 2019, arXiv 1909.08593 eq. 2); GAE (Schulman et al. 2016, arXiv
  1506.02438 eq. 16) bootstraps from the critic's values at the start of the learner step;
  with ``algo.gae_whiten`` the advantages are whitened over the batch's loss tokens.

  Args:
    spec: validated ``AlgoSpec``.
    batch: Rollout with B rows (reads completion_mask, truncated, rewards).
    start_values_bt: [B, T] float32 critic values (held constant).
    logp_bt, ref_logp_bt: [B, T] float32 current and reference log-probs; required when
      ``spec.kl_coef > 0`` and ``spec.kl_mode == 'reward'``.

  Returns:
    (adv_bt [B, T] float32 with the gradient stopped, returns_bt [B, T] float32), both 0
    off the loss mask.

  Raises:
    ValueError: a reward-mode KL penalty without the log-probs.
  """
  mask = losses.loss_mask(batch.completion_mask, batch.truncated, spec.mask_truncated)
  rew_bt = adv_lib.terminal_rewards(batch.rewards, mask)
  if spec.uses_reference and spec.kl_mode == "reward":
    if logp_bt is None or ref_logp_bt is None:
      raise ValueError("algo.kl_mode='reward' with algo.kl_coef > 0 needs the current and "
                       "reference log-probs for the GAE token rewards")
    kl_bt = losses.kl_estimate(logp_bt, ref_logp_bt, spec.kl_estimator)
    rew_bt = rew_bt - spec.kl_coef * sg(kl_bt)
  adv, ret_bt = adv_lib.gae(rew_bt, sg(start_values_bt), mask, spec.gae_gamma, spec.gae_lambda)
  return sg(_whiten(adv, mask) if spec.gae_whiten else adv), ret_bt


def item_weights(spec: AlgoSpec, weights_b, staleness_b) -> tuple[weights_lib.TrustRegion,
                                                                   jax.Array]:
  """The staleness-adaptive trust region and each item's weight w_i (module docstring).

  Args:
    spec: validated ``AlgoSpec``. weights_b: [B] sampling-correction weights.
    staleness_b: [B] int32.

  Returns:
    (TrustRegion of [B] arrays, w_b [B] float32 = weights_b · trust-region weight).
  """
  tr = weights_lib.adaptive_trust_region(staleness_b, spec.eps_low, spec.eps_high, spec.is_cap,
                                         spec.staleness_target, spec.staleness_fn,
                                         spec.staleness_rate)
  return tr, weights_b.astype(jnp.float32) * tr.weight


def objective(spec: AlgoSpec, logp_bt, entropy_bt, batch: Rollout, weights_b, staleness_b, *,
              adv_bt=None, returns_bt=None, prox_logp_bt=None, ref_logp_bt=None,
              values_bt=None, start_values_bt=None, normaliser=None
              ) -> tuple[jax.Array, dict]:
  """The full learner loss (module docstring) and its metrics.

  Args:
    spec: validated ``AlgoSpec``.
    logp_bt: [B, T] float32 current log-probs (differentiable). entropy_bt: [B, T] float32.
    batch: Rollout with B rows (uses completion_mask, behaviour_logprobs, advantages,
      rewards, truncated).
    weights_b: [B] float32 sampling-correction weights (1 for uniform sampling).
    staleness_b: [B] int32 policy versions between generation and now.
    adv_bt: [B, T] float32 advantages from ``gae_advantages``; required for ``gae``
      (default: the stored ``batch.advantages`` [B]).
    returns_bt: [B, T] float32 value targets from ``gae_advantages``; required for ``gae``.
    prox_logp_bt: [B, T] proximal log-probs for ``decoupled`` (default: sg(logp), the
      policy at the start of this update).
    ref_logp_bt: [B, T] reference log-probs; required when ``spec.kl_coef > 0``.
    values_bt: [B, T] critic values (differentiable); required for ``gae``.
    start_values_bt: [B, T] critic values at the start of the learner step, the
      value-clip anchor (default sg(values)).
    normaliser: None, or the float32 ``losses.aggregate_normaliser`` of a larger batch
      these B rows are a micro-batch of: the loss and ``pg_loss`` are then this part's
      share of that batch's aggregate (``losses.aggregate``), so the parts' losses and
      gradients sum to the whole batch's. The token-mean metrics stay this part's.

  Returns:
    (float32 scalar loss, dict of float32 scalar metrics: ``diagnostics.step_metrics``
    keys, ``pg_loss``, ``ratio_masked_frac``, ``ess_sample_weights``,
    ``staleness_weight_mean``, ``eps_high_mean``; ``kl_ref`` with a reference;
    ``value_loss``, ``value_mean``, ``return_mean`` for ``gae``).

  Raises:
    ValueError: a required input is missing.
  """
  mask = losses.loss_mask(batch.completion_mask, batch.truncated, spec.mask_truncated)
  mu = batch.behaviour_logprobs
  tr, w_b = item_weights(spec, weights_b, staleness_b)
  kl_bt = None
  if spec.uses_reference:
    if ref_logp_bt is None:
      raise ValueError("algo.kl_coef > 0 needs reference log-probs (TrainState.ref_params)")
    kl_bt = losses.kl_estimate(logp_bt, ref_logp_bt, spec.kl_estimator)

  metrics = {}
  adv = batch.advantages if adv_bt is None else adv_bt
  if spec.uses_value_head:
    if values_bt is None:
      raise ValueError("algo.advantage='gae' needs critic values (TrainState.value_params)")
    if adv_bt is None or returns_bt is None:
      raise ValueError("algo.advantage='gae' needs adv_bt and returns_bt (gae_advantages)")
    v_start = sg(values_bt) if start_values_bt is None else sg(start_values_bt)
    v_loss = value.clipped_value_loss(values_bt, v_start, returns_bt, spec.value_clip)
    metrics.update(value_loss=losses.masked_mean(v_loss, mask),
                   value_mean=losses.masked_mean(sg(values_bt), mask),
                   return_mean=losses.masked_mean(returns_bt, mask))

  params = losses.LossParams(eps_low=tr.eps_low, eps_high=tr.eps_high, cap=tr.cap,
                             delta_v=spec.delta_v, prox_logp_bt=prox_logp_bt,
                             rewards_b=batch.rewards)
  pg, info = losses.POLICY_LOSSES[spec.loss](logp_bt, mu, adv, mask, params)

  keep = losses.ratio_in_range(sg(jnp.exp(logp_bt - mu)), spec.ratio_mask_c)
  tok = jnp.where(keep, pg, 0.0)
  if kl_bt is not None and spec.kl_mode == "loss":
    tok = tok + spec.kl_coef * kl_bt
  if spec.entropy_coef:
    tok = tok - spec.entropy_coef * entropy_bt
  loss = losses.aggregate(w_b[:, None] * tok, mask, spec.aggregation, spec.horizon, normaliser)
  if spec.uses_value_head:
    loss = loss + spec.vf_coef * losses.aggregate(w_b[:, None] * v_loss, mask,
                                                  spec.aggregation, spec.horizon, normaliser)

  metrics.update(diagnostics.step_metrics(
      ratio_bt=sg(info.ratio), behaviour_log_ratio_bt=sg(logp_bt) - mu,
      clipped_low_bt=info.clipped_low, clipped_high_bt=info.clipped_high,
      entropy_bt=sg(entropy_bt), mask_bt=mask, staleness_b=staleness_b,
      edges=spec.staleness_buckets))
  metrics.update(
      pg_loss=losses.aggregate(sg(w_b[:, None] * jnp.where(keep, pg, 0.0)), mask,
                               spec.aggregation, spec.horizon, normaliser),
      ratio_masked_frac=losses.masked_mean((~keep).astype(jnp.float32), mask),
      ess_sample_weights=diagnostics.effective_sample_size(w_b, jnp.ones(w_b.shape, bool)),
      staleness_weight_mean=tr.weight.mean(), eps_high_mean=tr.eps_high.mean())
  if kl_bt is not None:
    metrics["kl_ref"] = losses.masked_mean(sg(kl_bt), mask)
  return loss, metrics


def policy_loss(logp_bt, batch: Rollout, weights_b, algo, staleness_b=None
                ) -> tuple[jax.Array, dict]:
  """``objective`` of the policy's log-probs alone: no entropy term, fresh data by default.

  For the group estimators (``algo.advantage`` ≠ ``gae``) without a KL term.

  Args:
    logp_bt: [B, T] float32 current log-probs. batch: Rollout with B rows.
    weights_b: [B] float32 sampling-correction weights.
    algo: ``AlgoSpec``, or a mapping of ``algo`` fields.
    staleness_b: [B] int32 (default 0: fresh data).

  Returns:
    (float32 scalar loss, metrics dict as ``objective``).

  Raises:
    ValueError: invalid ``algo``, or one that needs a value head or a reference.
  """
  spec = AlgoSpec.from_config(algo)
  if staleness_b is None:
    staleness_b = jnp.zeros(batch.rewards.shape, jnp.int32)
  return objective(spec, logp_bt, jnp.zeros_like(logp_bt), batch, weights_b, staleness_b)
