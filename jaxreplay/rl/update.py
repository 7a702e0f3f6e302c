"""The jitted learner update: ``train_step(state, batch, weights) -> (state, metrics)``.

Recomputes per-token log-probs of the stored rollouts under the current policy (at
the sampling temperature, so the ratio is 1 at identical parameters), applies the
configured off-policy loss, and takes one optax step. A non-finite loss or gradient
leaves parameters and optimizer state untouched and is reported in the metrics.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxreplay.rl import losses
from jaxreplay.rollout import Rollout


@flax.struct.dataclass
class TrainState:
  """Learner state (a pytree; the model graph lives outside it).

  Attributes:
    params: nnx.State of the policy's parameters.
    opt_state: optax state.
    step: int32 scalar, learner steps taken = current policy version.
    skipped: int32 scalar, updates skipped for non-finite values (total).
  """

  params: Any
  opt_state: Any
  step: jax.Array
  skipped: jax.Array


def token_logprobs(graphdef: nnx.GraphDef, params, tokens: jax.Array, attention_mask: jax.Array,
                   temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs of ``tokens`` under the policy, and the full-distribution entropy.

  Args:
    graphdef, params: the policy (``nnx.split``).
    tokens: [B, T] int32. attention_mask: [B, T] bool.
    temperature: logits are divided by it (> 0), matching the sampler.

  Returns:
    (logp [B, T] float32 with column 0 set to 0 — column t is log π(tokens_t | tokens_<t);
     entropy [B, T] float32 of the distribution that predicted column t, 0 at column 0).
  """
  model = nnx.merge(graphdef, params)
  logits = model(tokens, attention_mask)[:, :-1] / temperature  # predicts tokens[:, 1:]
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1)


def make_optimizer(lr: float, warmup_steps: int, max_grad_norm: float, b1: float = 0.9,
                   b2: float = 0.999, weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam(W) with linear warmup to a constant ``lr`` and global-norm clipping (optax)."""
  sched = optax.linear_schedule(0.0, lr, max(warmup_steps, 1)) if warmup_steps > 0 else lr
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))


def policy_loss(logp_bt, batch: Rollout, weights_b, algo) -> tuple[jax.Array, dict]:
  """The configured policy loss on one batch.

  Args:
    logp_bt: [B, T] current log-probs. batch: Rollout with B rows.
    weights_b: [B] float32 per-sample weights (1 for uniform sampling).
    algo: ConfigDict with ``loss``, ``eps_low``, ``eps_high``, ``aggregation``,
      ``delta_v``, ``horizon``.

  Returns:
    (scalar loss, metrics dict of scalars).

  Raises:
    ValueError: unknown ``algo.loss``.
  """
  mask = batch.completion_mask
  adv = batch.advantages
  ratio = jnp.exp(logp_bt - batch.behaviour_logprobs)
  low = high = jnp.zeros_like(mask)
  if algo.loss == "ppo_clip":
    tok_loss, ratio, low, high = losses.ppo_clip_token_loss(
        logp_bt, batch.behaviour_logprobs, adv, algo.eps_low, algo.eps_high)
  elif algo.loss == "reinforce":
    tok_loss = losses.reinforce_token_loss(logp_bt, adv)
  elif algo.loss == "asymre":
    # Group mean reward V̂ recovered from the GRPO-free identity r − A_dr = mean; the
    # loop stores Dr.GRPO-style centred advantages for asymre, so V̂ = r − A.
    tok_loss = losses.asymre_token_loss(logp_bt, batch.rewards, batch.rewards - adv,
                                        algo.delta_v)
  else:
    raise ValueError(f"algo.loss={algo.loss!r} is not one of {losses.LOSSES}")
  tok_loss = tok_loss * weights_b[:, None]
  loss = losses.aggregate(tok_loss, mask, algo.aggregation, algo.horizon or None)
  log_ratio = logp_bt - batch.behaviour_logprobs
  metrics = {
      "ratio_mean": losses.masked_mean(ratio, mask),
      "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0)),
      "clip_frac_low": losses.masked_mean(low.astype(jnp.float32), mask),
      "clip_frac_high": losses.masked_mean(high.astype(jnp.float32), mask),
      # k3 estimator of KL(μ ‖ π) on tokens sampled from μ (Schulman 2020).
      "kl_behaviour": losses.masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask),
  }
  metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
  return loss, metrics


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, algo,
                    temperature: float) -> Callable:
  """Builds the jitted ``train_step(state, batch, weights) -> (state, metrics)``.

  The state is donated (no parameter-sized copy per call).

  Args:
    graphdef: the policy graph (static).
    optimizer: optax transformation whose state is ``state.opt_state``.
    algo: the ``algo`` ConfigDict (see ``policy_loss``).
    temperature: sampling temperature used for the behaviour log-probs (> 0).
  """

  def loss_fn(params, batch, weights):
    logp, ent = token_logprobs(graphdef, params, batch.tokens, batch.attention_mask, temperature)
    loss, metrics = policy_loss(logp, batch, weights, algo)
    metrics["entropy"] = losses.masked_mean(ent, batch.completion_mask)
    return loss, metrics

  @jax.jit
  def train_step(state: TrainState, batch: Rollout, weights: jax.Array):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, weights)
    gnorm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    state = TrainState(params=keep(new_params, state.params), opt_state=keep(new_opt, state.opt_state),
                       step=state.step + 1, skipped=state.skipped + (~finite).astype(jnp.int32))
    metrics.update(loss=loss, grad_norm=gnorm, skipped_update=(~finite).astype(jnp.float32))
    return state, metrics

  return jax.jit(train_step, donate_argnums=(0,))
