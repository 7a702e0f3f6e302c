"""The jitted learner update: ``train_step(state, batch, weights, staleness) -> (state, metrics)``.

Recomputes per-token log-probs of the stored rollouts under the current policy (at the
sampler's temperature and top-k/top-p, so the ratio is 1 at identical parameters;
``scoring``), computes GAE advantages from the critic for ``algo.advantage='gae'``
(``objective.gae_advantages``), applies ``objective.objective`` and takes
``update_epochs × num_minibatches`` optax steps. A non-finite loss or gradient leaves
parameters and optimizer state untouched and is reported in the metrics.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxreplay.rl import diagnostics, losses, value
from jaxreplay.rl.objective import gae_advantages, item_weights, objective
from jaxreplay.rl.scoring import policy_and_values, token_logprobs
from jaxreplay.rl.spec import SCHEDULES, AlgoSpec
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


def scheduled_adamw(lr: float, warmup_steps: int, max_grad_norm: float, *, b1: float = 0.9,
                    b2: float = 0.999, weight_decay: float = 0.0, schedule: str = "constant",
                    total_steps: int = 0, final_lr_fraction: float = 0.1
                    ) -> optax.GradientTransformation:
  """Adam(W) with global-norm clipping and a learning-rate schedule (optax).

  Adam: Kingma & Ba 2015 (arXiv 1412.6980 Alg. 1); decoupled weight decay: Loshchilov &
  Hutter 2019 (arXiv 1711.05101 Alg. 2). Schedules: ``constant`` — linear warmup over
  ``warmup_steps`` to ``lr`` then constant; ``cosine`` — the same warmup, then cosine decay
  (Loshchilov & Hutter 2017, arXiv 1608.03983 eq. 5) to ``final_lr_fraction · lr`` at
  ``total_steps``. Steps count optimizer updates.

  Args:
    lr: peak learning rate. warmup_steps: ≥ 0. max_grad_norm: > 0, global-norm clip.
    b1, b2: Adam's moment decay rates. weight_decay: ≥ 0.
    schedule: one of ``SCHEDULES``. total_steps: length of the cosine schedule.
    final_lr_fraction: the cosine schedule's final lr / lr.

  Returns:
    optax.GradientTransformation over any parameter pytree.

  Raises:
    ValueError: unknown ``schedule``, or ``cosine`` with ``total_steps <= warmup_steps``.
  """
  if schedule == "constant":
    sched = optax.linear_schedule(0.0, lr, max(warmup_steps, 1)) if warmup_steps > 0 else lr
  elif schedule == "cosine":
    if total_steps <= warmup_steps:
      raise ValueError(f"schedule='cosine' needs total_steps={total_steps} > "
                       f"warmup_steps={warmup_steps}")
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps,
                                               end_value=lr * final_lr_fraction)
  else:
    raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))


def make_optimizer(algo, learner_steps: int) -> optax.GradientTransformation:
  """The learner's optimizer from the ``algo`` section (``scheduled_adamw``).

  ``algo.lr``, ``warmup_steps``, ``max_grad_norm``, ``weight_decay``, ``lr_schedule`` and
  ``final_lr_fraction``; the cosine schedule spans ``learner_steps × update_epochs ×
  num_minibatches`` optimizer steps. With ``learner_steps = 0`` (no training planned) there
  is no span to decay over and the schedule is warmup-then-constant.

  Args:
    algo: ``AlgoSpec``, or a mapping of ``algo`` fields.
    learner_steps: ≥ 0, learner steps of the run (``train.steps``).

  Returns:
    optax.GradientTransformation.

  Raises:
    ValueError: invalid ``algo``, or ``lr_schedule='cosine'`` with no more optimizer steps
      than ``warmup_steps``.
  """
  spec = AlgoSpec.from_config(algo)
  total = learner_steps * spec.updates_per_step
  schedule = spec.lr_schedule if learner_steps else "constant"
  if schedule == "cosine" and total <= spec.warmup_steps:
    raise ValueError(f"algo.lr_schedule='cosine' needs more optimizer steps (train.steps="
                     f"{learner_steps} × {spec.updates_per_step} per step) than "
                     f"algo.warmup_steps={spec.warmup_steps}")
  return scheduled_adamw(spec.lr, spec.warmup_steps, spec.max_grad_norm,
                         weight_decay=spec.weight_decay, schedule=schedule, total_steps=total,
                         final_lr_fraction=spec.final_lr_fraction)


def init_train_state(graphdef: nnx.GraphDef, params, optimizer: optax.GradientTransformation,
                     algo) -> TrainState:
  """A fresh ``TrainState`` at step 0.

  Args:
    graphdef, params: the policy (``nnx.split``).
    optimizer: the optax transformation whose state is created (``make_optimizer``).
    algo: ``AlgoSpec``, or a mapping of ``algo`` fields.

  Returns:
    TrainState with a zero-initialised value head when ``algo.advantage='gae'`` and a
    frozen copy of ``params`` as the KL reference when ``algo.kl_coef > 0``.

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


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, algo,
                    temperature: float, top_k: int = 0, top_p: float = 1.0) -> Callable:
  """Builds the jitted ``train_step(state, batch, weights=None, staleness=None)``.

  ``train_step`` returns ``(state, metrics)``; the state is donated (no parameter-sized copy
  per call). ``batch`` is a Rollout of B rows; ``weights`` [B] float32 are the
  sampling-correction weights (``weights.sampling_weights``; default ones); ``staleness``
  [B] int32 defaults to ``state.step − batch.policy_version``. Each call takes
  ``update_epochs × num_minibatches`` optimizer steps over fixed contiguous minibatches and
  advances the policy version ``step`` by one. Metrics (float32 scalars, ``objective`` keys
  plus ``loss``, ``grad_norm``, ``skipped_update``) are merged over those steps by
  ``diagnostics.combine_updates``: ``loss`` and ``pg_loss`` are the whole batch's under
  ``algo.aggregation`` (each minibatch weighted by its ``losses.aggregate_normaliser``),
  token means (``value_loss``, ``kl_ref``, ``ratio_masked_frac``, ...) the whole batch's
  (each minibatch weighted by its loss tokens), ``ess_sample_weights`` is the whole
  batch's, ``skipped_update`` is 1 if any update was skipped.

  Args:
    graphdef: the policy graph (static).
    optimizer: optax transformation whose state is ``state.opt_state``.
    algo: ``AlgoSpec``, or a mapping of ``algo`` fields (ConfigDict, dict).
    temperature: sampling temperature used for the behaviour log-probs (> 0).
    top_k, top_p: the sampler's truncation (``sampler.top_k`` / ``sampler.top_p``): the
      current and reference log-probs are taken under the same truncated distribution,
      so the ratio is 1 at identical parameters (see ``scoring.token_logprobs``).

  Returns:
    The jitted train step.

  Raises:
    ValueError: invalid ``algo`` (at build time); B not divisible by
      ``num_minibatches`` or a missing value head / reference (at trace time).
  """
  spec = AlgoSpec.from_config(algo)
  n_updates = spec.updates_per_step

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
    adv = returns = None
    if spec.uses_value_head:  # bootstrapped from the values at the start of the step
      adv, returns = gae_advantages(spec, batch, values if v_start is None else v_start,
                                    logp_bt=logp, ref_logp_bt=ref)
    return objective(spec, logp, ent, batch, w, stale, adv_bt=adv, returns_bt=returns,
                     prox_logp_bt=prox, ref_logp_bt=ref, values_bt=values,
                     start_values_bt=v_start)

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
    # An ESS over rows is no weighted mean of the minibatches' ESS; it does not depend on
    # the parameters, so it is taken over the whole batch.
    w_b = item_weights(spec, weights, staleness)[1]
    metrics["ess_sample_weights"] = diagnostics.effective_sample_size(
        w_b, jnp.ones(w_b.shape, bool))
    params, value_params = trainable if spec.uses_value_head else (trainable, state.value_params)
    state = state.replace(params=params, value_params=value_params, opt_state=opt_state,
                          step=state.step + 1, skipped=skipped)
    return state, metrics

  return jax.jit(train_step, donate_argnums=(0,))
