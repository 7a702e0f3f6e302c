"""The jitted learner update: ``train_step(state, batch, weights[, staleness]) -> (state, metrics)``.

Recomputes per-token log-probs of the stored rollouts under the current policy (at
the sampler's temperature and top-k/top-p, so the ratio is 1 at identical parameters), applies the
configured objective (``objective``) and takes ``update_epochs × num_minibatches``
optax steps. A non-finite loss or gradient leaves parameters and optimizer state
untouched and is reported in the metrics.

The objective, per sampled item i with weight w_i (sampling × staleness correction,
``jaxreplay.rl.weights``) and per token t on the loss mask:

  ℓ_it = w_i · (pg_it + β·kl_it − c_H·H_it)   →  aggregate(ℓ, mask, algo.aggregation)
         + c_V · aggregate(w_i · value_loss_it)          (``gae`` only)

where pg is the configured policy loss (``losses``), kl a sampled KL estimate to the
frozen reference in ``TrainState.ref_params`` (``algo.kl_mode='loss'``), H the
full-distribution entropy. Tokens whose ratio falls outside [1/c, c]
(``algo.ratio_mask_c``) contribute no policy-gradient term; the normaliser still
counts them, so masking never up-weights the rest.

Config fields: ``jaxreplay.rl.spec.AlgoSpec``.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxreplay.models.logit_processing import process_logits
from jaxreplay.rl import advantages as adv_lib
from jaxreplay.rl import diagnostics, losses, value, weights as weights_lib
from jaxreplay.rl.spec import KL_MODES, SCHEDULES, AlgoSpec  # noqa: F401  (re-exported)
from jaxreplay.rollout import Rollout

sg = jax.lax.stop_gradient


@flax.struct.dataclass
class TrainState:
  """Learner state (a pytree; the model graph lives outside it).

  Attributes:
    params: nnx.State of the policy's parameters.
    opt_state: optax state of ``params`` — or of ``(params, value_params)`` when a value
      head is trained (``init_train_state`` sets this up).
    step: int32 scalar, learner steps taken = current policy version.
    skipped: int32 scalar, updates skipped for non-finite values (total).
    value_params: nnx.State of the ``ValueHead`` (``algo.advantage='gae'``), else None.
    ref_params: frozen reference policy for the KL term (``algo.kl_coef > 0``), else None.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  skipped: jax.Array
  value_params: Any = None
  ref_params: Any = None


# Log-prob given to a token outside the current policy's top-k/top-p set, whose log-prob
# under the truncated distribution is -inf: finite, so its ratio is exactly 0 (it cannot be
# sampled any more) and the metrics stay finite. Never reached without truncation.
LOGP_FLOOR = -1e4


def token_logprobs(graphdef: nnx.GraphDef, params, tokens: jax.Array, attention_mask: jax.Array,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs of ``tokens`` under the policy's sampling distribution, and its entropy.

  The distribution is the sampler's (``models.logit_processing.process_logits``): logits
  divided by ``temperature``, then top-k, then top-p renormalised — so for the same
  parameters these equal the behaviour log-probs ``sampling.generate`` records and the
  importance ratio is exactly 1. Without truncation this is ``log_softmax(logits / T)``.

  Args:
    graphdef, params: the policy (``nnx.split``).
    tokens: [B, T] int32. attention_mask: [B, T] bool.
    temperature: logits are divided by it (> 0), matching the sampler.
    top_k, top_p: the sampler's truncation (static; 0 and 1 disable it).

  Returns:
    (logp [B, T] float32 with column 0 set to 0 — column t is log π(tokens_t | tokens_<t),
     floored at ``LOGP_FLOOR`` for a token outside the truncated set;
     entropy [B, T] float32 of the (truncated) distribution that predicted column t,
     0 at column 0).

  Raises:
    ValueError: temperature <= 0, top_k < 0 or top_p outside [0, 1].
  """
  model = nnx.merge(graphdef, params)
  return _scores(model(tokens, attention_mask), tokens, temperature, top_k, top_p)


def _scores(logits_btv, tokens, temperature, top_k=0, top_p=1.0):
  # predicts tokens[:, 1:]; dropped tokens at -inf when truncated
  logits = process_logits(logits_btv[:, :-1], temperature, top_k, top_p)
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  logp = jnp.maximum(logp, LOGP_FLOOR)
  probs = jnp.exp(logp_all)
  ent = -jnp.sum(probs * jnp.where(probs > 0, logp_all, 0.0), axis=-1)  # 0·(-inf) -> 0
  pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1)


def policy_and_values(graphdef, params, value_params, tokens, attention_mask, temperature,
                      top_k: int = 0, top_p: float = 1.0):
  """(logp [B, T], entropy [B, T], values [B, T] aligned with logp) in one forward pass
  (log-probs and entropy as ``token_logprobs``)."""
  model = nnx.merge(graphdef, params)
  logits, hidden = value.forward_with_hidden(model, tokens, attention_mask)
  head = nnx.merge(value.value_graphdef(), value_params)
  logp, ent = _scores(logits, tokens, temperature, top_k, top_p)
  return logp, ent, value.token_values(head, hidden)


def make_optimizer(lr: float, warmup_steps: int, max_grad_norm: float, b1: float = 0.9,
                   b2: float = 0.999, weight_decay: float = 0.0, schedule: str = "constant",
                   total_steps: int = 0, final_lr_fraction: float = 0.1
                   ) -> optax.GradientTransformation:
  """Adam(W) with global-norm clipping and a learning-rate schedule (optax).

  Schedules: ``constant`` — linear warmup over ``warmup_steps`` to ``lr`` then constant
  (the paper's setting); ``cosine`` — the same warmup, then cosine decay to
  ``final_lr_fraction · lr`` at ``total_steps`` (optimizer steps).

  Raises:
    ValueError: unknown ``schedule`` or ``cosine`` with ``total_steps <= warmup_steps``.
  """
  if schedule == "constant":
    sched = optax.linear_schedule(0.0, lr, max(warmup_steps, 1)) if warmup_steps > 0 else lr
  elif schedule == "cosine":
    if total_steps <= warmup_steps:
      raise ValueError(f"algo.lr_schedule='cosine' needs train.steps={total_steps} > "
                       f"algo.warmup_steps={warmup_steps}")
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps,
                                               end_value=lr * final_lr_fraction)
  else:
    raise ValueError(f"algo.lr_schedule={schedule!r} is not one of {SCHEDULES}")
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))


def init_train_state(graphdef: nnx.GraphDef, params, optimizer: optax.GradientTransformation,
                     algo) -> TrainState:
  """A fresh ``TrainState``: a zero value head when ``algo.advantage='gae'`` and a frozen
  copy of ``params`` as the KL reference when ``algo.kl_coef > 0``.

  Raises:
    ValueError: invalid ``algo`` (see ``AlgoSpec``).
  """
  spec = AlgoSpec.from_config(algo)
  value_params = ref_params = None
  if spec.uses_value_head:
    value_params = value.init_value_params(nnx.merge(graphdef, params).cfg.d_model)
  if spec.uses_reference:
    ref_params = jax.tree.map(jnp.copy, params)
  trainable = params if value_params is None else (params, value_params)
  return TrainState(params=params, opt_state=optimizer.init(trainable), step=jnp.int32(0),
                    skipped=jnp.int32(0), value_params=value_params, ref_params=ref_params)


def _whiten(x_bt, mask_bt):
  """Masked (x − mean)/std; only centred when the spread is ~0 (no amplified residue)."""
  mean = losses.masked_mean(x_bt, mask_bt)
  c = jnp.where(mask_bt, x_bt - mean, 0.0)
  std = jnp.sqrt(losses.masked_mean(c * c, mask_bt))
  return jnp.where(std > 1e-4, c / jnp.maximum(std, 1e-4), c)


def objective(spec: AlgoSpec, logp_bt, entropy_bt, batch: Rollout, weights_b, staleness_b, *,
              prox_logp_bt=None, ref_logp_bt=None, values_bt=None,
              start_values_bt=None) -> tuple[jax.Array, dict]:
  """The full learner loss as a function of the policy's per-token outputs.

  Args:
    spec: validated ``AlgoSpec``.
    logp_bt: [B, T] float32 current log-probs (differentiable). entropy_bt: [B, T].
    batch: Rollout with B rows (uses completion_mask, behaviour_logprobs, advantages,
      rewards, truncated).
    weights_b: [B] float32 sampling-correction weights (1 for uniform sampling).
    staleness_b: [B] int32 policy versions between generation and now.
    prox_logp_bt: [B, T] proximal log-probs for ``decoupled`` (default: sg(logp), the
      policy at the start of this update).
    ref_logp_bt: [B, T] reference log-probs; required when ``spec.kl_coef > 0``.
    values_bt: [B, T] critic values (differentiable); required for ``gae``.
    start_values_bt: [B, T] critic values at the start of the learner step (GAE
      bootstrap and value-clip anchor; default sg(values)).

  Returns:
    (scalar loss, metrics dict of float32 scalars).

  Raises:
    ValueError: a required input is missing.
  """
  mask = losses.loss_mask(batch.completion_mask, batch.truncated, spec.mask_truncated)
  mu = batch.behaviour_logprobs
  tr = weights_lib.adaptive_trust_region(staleness_b, spec.eps_low, spec.eps_high, spec.is_cap,
                                         spec.staleness_target, spec.staleness_fn,
                                         spec.staleness_rate)
  w_b = weights_b.astype(jnp.float32) * tr.weight
  kl_bt = None
  if spec.uses_reference:
    if ref_logp_bt is None:
      raise ValueError("algo.kl_coef > 0 needs reference log-probs (TrainState.ref_params)")
    kl_bt = losses.kl_estimate(logp_bt, ref_logp_bt, spec.kl_estimator)

  metrics = {}
  if spec.uses_value_head:
    if values_bt is None:
      raise ValueError("algo.advantage='gae' needs critic values (TrainState.value_params)")
    v_start = sg(values_bt) if start_values_bt is None else sg(start_values_bt)
    rew_bt = adv_lib.terminal_rewards(batch.rewards, mask)
    if kl_bt is not None and spec.kl_mode == "reward":
      rew_bt = rew_bt - spec.kl_coef * sg(kl_bt)
    adv, ret_bt = adv_lib.gae(rew_bt, v_start, mask, spec.gae_gamma, spec.gae_lambda)
    adv = sg(_whiten(adv, mask) if spec.gae_whiten else adv)
    v_loss = value.clipped_value_loss(values_bt, v_start, ret_bt, spec.value_clip)
    metrics.update(value_loss=losses.masked_mean(v_loss, mask),
                   value_mean=losses.masked_mean(sg(values_bt), mask),
                   return_mean=losses.masked_mean(ret_bt, mask))
  else:
    adv = batch.advantages

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
  loss = losses.aggregate(w_b[:, None] * tok, mask, spec.aggregation, spec.horizon)
  if spec.uses_value_head:
    loss = loss + spec.vf_coef * losses.aggregate(w_b[:, None] * v_loss, mask,
                                                  spec.aggregation, spec.horizon)

  metrics.update(diagnostics.step_metrics(
      ratio_bt=sg(info.ratio), behaviour_log_ratio_bt=sg(logp_bt) - mu,
      clipped_low_bt=info.clipped_low, clipped_high_bt=info.clipped_high,
      entropy_bt=sg(entropy_bt), mask_bt=mask, staleness_b=staleness_b,
      edges=spec.staleness_buckets))
  metrics.update(
      pg_loss=losses.aggregate(sg(w_b[:, None] * jnp.where(keep, pg, 0.0)), mask,
                               spec.aggregation, spec.horizon),
      ratio_masked_frac=losses.masked_mean((~keep).astype(jnp.float32), mask),
      ess_sample_weights=diagnostics.effective_sample_size(w_b, jnp.ones(w_b.shape, bool)),
      staleness_weight_mean=tr.weight.mean(), eps_high_mean=tr.eps_high.mean())
  if kl_bt is not None:
    metrics["kl_ref"] = losses.masked_mean(sg(kl_bt), mask)
  return loss, metrics


def policy_loss(logp_bt, batch: Rollout, weights_b, algo, staleness_b=None):
  """Back-compatible wrapper: ``objective`` with entropy 0 and fresh data by default.

  Returns:
    (scalar loss, metrics dict).
  """
  spec = AlgoSpec.from_config(algo)
  if staleness_b is None:
    staleness_b = jnp.zeros(batch.rewards.shape, jnp.int32)
  return objective(spec, logp_bt, jnp.zeros_like(logp_bt), batch, weights_b, staleness_b)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, algo,
                    temperature: float, top_k: int = 0, top_p: float = 1.0) -> Callable:
  """Builds the jitted ``train_step(state, batch, weights, staleness=None) -> (state, metrics)``.

  The state is donated (no parameter-sized copy per call). ``staleness`` [B] int32
  defaults to ``state.step − batch.policy_version``. ``weights`` [B] are the
  sampling-correction weights (``weights.sampling_weights``; ones for uniform). Each
  call takes ``update_epochs × num_minibatches`` optimizer steps over fixed contiguous
  minibatches and advances the policy version ``step`` by one. Metrics are merged
  over those steps by ``diagnostics.combine_updates`` (``skipped_update`` is 1 if any
  was skipped).

  Args:
    graphdef: the policy graph (static).
    optimizer: optax transformation whose state is ``state.opt_state``.
    algo: the ``algo`` ConfigDict (see ``AlgoSpec``).
    temperature: sampling temperature used for the behaviour log-probs (> 0).
    top_k, top_p: the sampler's truncation (``sampler.top_k`` / ``sampler.top_p``): the
      current and reference log-probs are taken under the same truncated distribution,
      so the ratio is 1 at identical parameters (see ``token_logprobs``).

  Raises:
    ValueError: invalid ``algo`` (at build time); B not divisible by
      ``num_minibatches`` or a missing value head / reference (at trace time).
  """
  spec = AlgoSpec.from_config(algo)
  n_updates = spec.update_epochs * spec.num_minibatches

  def forward(params, value_params, batch):
    if value_params is None:
      logp, ent = token_logprobs(graphdef, params, batch.tokens, batch.attention_mask, temperature,
                                 top_k, top_p)
      return logp, ent, None
    return policy_and_values(graphdef, params, value_params, batch.tokens,
                             batch.attention_mask, temperature, top_k, top_p)

  def loss_fn(trainable, batch, w, stale, prox, ref, v_start):
    params, value_params = trainable if spec.uses_value_head else (trainable, None)
    logp, ent, values = forward(params, value_params, batch)
    return objective(spec, logp, ent, batch, w, stale, prox_logp_bt=prox, ref_logp_bt=ref,
                     values_bt=values, start_values_bt=v_start)

  def train_step(state: TrainState, batch: Rollout, weights=None, staleness=None):
    b = batch.rewards.shape[0]
    if b % spec.num_minibatches:
      raise ValueError(f"train.batch_size={b} must be divisible by "
                       f"algo.num_minibatches={spec.num_minibatches}")
    if spec.uses_value_head and state.value_params is None:
      raise ValueError("algo.advantage='gae' needs TrainState.value_params "
                       "(build the state with init_train_state)")
    if spec.uses_reference and state.ref_params is None:
      raise ValueError("algo.kl_coef > 0 needs TrainState.ref_params "
                       "(build the state with init_train_state)")
    weights = jnp.ones((b,), jnp.float32) if weights is None else weights
    if staleness is None:
      staleness = state.step - batch.policy_version
    staleness = staleness.astype(jnp.int32)
    ref = prox = v_start = None
    if spec.uses_reference:
      ref, _ = token_logprobs(graphdef, state.ref_params, batch.tokens, batch.attention_mask,
                              temperature, top_k, top_p)
      ref = sg(ref)
    if n_updates > 1 and (spec.loss == "decoupled" or spec.uses_value_head):
      prox, _, v_start = jax.tree.map(sg, forward(state.params, state.value_params, batch))
    data = (batch, weights, staleness, prox, ref, v_start)
    trainable = state.params if not spec.uses_value_head else (state.params,
                                                               state.value_params)
    idx = jnp.tile(jnp.arange(b).reshape(spec.num_minibatches, -1), (spec.update_epochs, 1))

    def one_update(carry, idx_m):
      trainable, opt_state, skipped = carry
      mb = jax.tree.map(lambda x: x[idx_m], data)
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, *mb)
      gnorm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
      updates, new_opt = optimizer.update(grads, opt_state, trainable)
      new_trainable = optax.apply_updates(trainable, updates)
      keep = lambda new, old: jax.tree.map(lambda a, c: jnp.where(finite, a, c), new, old)
      metrics.update(loss=loss, grad_norm=gnorm, skipped_update=(~finite).astype(jnp.float32))
      batch_m = mb[0]
      norm = losses.aggregate_normaliser(
          losses.loss_mask(batch_m.completion_mask, batch_m.truncated, spec.mask_truncated),
          spec.aggregation)
      return (keep(new_trainable, trainable), keep(new_opt, opt_state),
              skipped + (~finite).astype(jnp.int32)), (metrics, norm)

    (trainable, opt_state, skipped), (per_update, norms) = jax.lax.scan(
        one_update, (trainable, state.opt_state, state.skipped), idx)
    metrics = diagnostics.combine_updates(per_update, spec.update_epochs, norms)
    params, value_params = trainable if spec.uses_value_head else (trainable, state.value_params)
    state = state.replace(params=params, value_params=value_params, opt_state=opt_state,
                          step=state.step + 1, skipped=skipped)
    return state, metrics

  return jax.jit(train_step, donate_argnums=(0,))
