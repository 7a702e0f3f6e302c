"""The jitted learner update: ``train_step(state, batch, weights, staleness) -> (state, metrics)``.

Recomputes per-token log-probs of the stored rollouts under the current policy (at the
sampler's temperature and top-k/top-p, so the ratio is 1 at identical parameters;
``scoring``), computes GAE advantages from the critic for ``algo.advantage='gae'``
(``objective.gae_advantages``), applies ``objective.objective`` and takes
``update_epochs × num_minibatches`` optax steps. A non-finite loss or gradient leaves
parameters and optimizer state untouched and is reported in the metrics.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from jaxreplay.models.lora import dropout_rng, graph_dropout, join_adapters, split_adapters
from jaxreplay.rl import diagnostics, losses, packing, value
from jaxreplay.rl.objective import gae_advantages, item_weights, objective
from jaxreplay.rl.scoring import (merge_micro_batches, micro_batches, packed_scores,
                                  policy_and_values, token_logprobs)
from jaxreplay.rl.spec import SCHEDULES, AlgoSpec
from jaxreplay.rollout import Rollout

sg = jax.lax.stop_gradient
# What the packed learner (``algo.pack_sequences``) and the chunked vocabulary pass
# (``algo.logprob_chunk``) call on the policy besides ``__call__`` (``scoring.packed_scores``,
# ``scoring.chunked_scores``): ``models.Transformer`` has both.
HIDDEN_METHODS = ("hidden", "project_logits")


def missing_methods(graphdef: nnx.GraphDef, names=HIDDEN_METHODS) -> tuple[str, ...]:
  """The methods of ``names`` the policy's class lacks.

  Args:
    graphdef: the policy graph (``nnx.split``); its root node names the policy's class.
    names: method names to look for.

  Returns:
    The missing names, in ``names`` order (empty when the class has them all, or when the
    graph does not name a class: nothing is assumed missing then).
  """
  try:
    cls = graphdef.nodes[0].type
  except (AttributeError, IndexError, TypeError):
    return ()
  if not isinstance(cls, type):
    return ()
  return tuple(n for n in names if not callable(getattr(cls, n, None)))


def fit_to_policy(graphdef: nnx.GraphDef, spec: AlgoSpec) -> AlgoSpec:
  """``spec`` as the policy can run it: a policy without ``HIDDEN_METHODS`` (one that
  implements only ``__call__``) trains unpacked.

  With ``algo.pack_sequences`` on and a method missing, one line is logged (a warning,
  naming the methods and the option) and the spec returned with ``pack_sequences=False``:
  the unpacked learner needs only ``__call__`` and computes the same loss and gradient, at
  full [B, T] width.

  Args:
    graphdef: the policy graph. spec: the ``AlgoSpec``.

  Returns:
    The spec, with ``pack_sequences`` off where the policy cannot be packed, and
    ``share_prompts`` off where its ``hidden`` takes no ``prefix_ids`` (one warning).

  Raises:
    ValueError: ``algo.logprob_chunk > 0`` with a method missing (one line naming the
      methods and the option): the chunked pass needs the hidden states, and falling back
      would materialise the [B, T, V] logits the option was set to avoid.
  """
  missing = missing_methods(graphdef)
  name = graphdef.nodes[0].type.__name__
  if not missing:
    if spec.share_prompts and "prefix_ids" not in inspect.signature(
        graphdef.nodes[0].type.hidden).parameters:
      logging.warning("the policy %s's hidden() takes no prefix_ids, which algo.share_prompts "
                      "needs: packing each prompt with its rollout (algo.share_prompts=False)",
                      name)
      spec = dataclasses.replace(spec, share_prompts=False)
    return spec
  if spec.logprob_chunk:
    raise ValueError(f"algo.logprob_chunk={spec.logprob_chunk} needs the policy methods "
                     f"{' and '.join(HIDDEN_METHODS)}; {name} lacks {' and '.join(missing)}: "
                     "implement them as models.Transformer does, or set algo.logprob_chunk=0")
  if spec.pack_sequences:
    logging.warning("the policy %s lacks %s, which algo.pack_sequences needs: training "
                    "unpacked (algo.pack_sequences=False)", name, " and ".join(missing))
    spec = dataclasses.replace(spec, pack_sequences=False, share_prompts=False)
  return spec


@flax.struct.dataclass
class TrainState:
  """Learner state (a pytree; the model graph lives outside it).

  Attributes:
    params: nnx.State of the policy's parameters (with LoRA: the frozen base and the
      ``nnx.LoRAParam`` adapters, ``models.lora``).
    opt_state: optax state of ``params`` — or of ``(params, value_params)`` when a value
      head is trained (``init_train_state`` sets this up); with LoRA, of the adapters only.
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
    frozen copy of ``params`` as the KL reference when ``algo.kl_coef > 0``. With LoRA
    adapters in ``params`` (``models.lora``) the optimizer state covers only them.

  Raises:
    ValueError: invalid ``algo`` (see ``AlgoSpec``).
  """
  spec = AlgoSpec.from_config(algo)
  value_params = ref_params = None
  if spec.uses_value_head:
    value_params = value.init_value_params(nnx.merge(graphdef, params).cfg.d_model)
  if spec.uses_reference:
    ref_params = jax.tree.map(jnp.copy, params)
  adapters, _ = split_adapters(params)
  trainable = adapters if value_params is None else (adapters, value_params)
  return TrainState(params=params, opt_state=optimizer.init(trainable), step=jnp.int32(0),
                    skipped=jnp.int32(0), value_params=value_params, ref_params=ref_params)


def _make_forward(graphdef, spec: AlgoSpec, temperature, top_k, top_p) -> Callable:
  """``forward(params, value_params, batch, plan=None) -> (logp, entropy, values or None)``,
  [B, T] each; with a ``packing.PackPlan`` of the batch's rows the pass runs packed."""

  def forward(params, value_params, batch, plan=None):
    if plan is not None:
      return packed_scores(graphdef, params, batch.tokens, plan, temperature, top_k, top_p,
                           spec.logprob_chunk, value_params)
    if value_params is None:
      logp, ent = token_logprobs(graphdef, params, batch.tokens, batch.attention_mask, temperature,
                                 top_k, top_p, spec.logprob_chunk)
      return logp, ent, None
    return policy_and_values(graphdef, params, value_params, batch.tokens,
                             batch.attention_mask, temperature, top_k, top_p,
                             spec.logprob_chunk)

  return forward


def make_grad_fn(graphdef: nnx.GraphDef, algo, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> Callable:
  """The loss, metrics and gradient of one minibatch, accumulated over micro-batches.

  ``grad_fn(trainable, batch, weights, staleness, prox, ref, v_start, plan=None,
  frozen=None, dropout_key=None) -> ((loss, metrics), grads)``, traceable (the caller
  jits). ``dropout_key`` (a PRNG key or None) turns LoRA adapter dropout on for the
  differentiated passes (``models.lora.dropout_rng``): accumulation part k uses
  fold_in(dropout_key, k), a whole-minibatch pass part 0's key. ``trainable`` is
  the policy's parameters, or ``(params, value_params)`` with a value head; with LoRA its
  params are the adapters and ``frozen`` the rest of the policy (``models.lora.split_adapters``),
  which gets no gradient.

  Full width (``plan`` None): with ``algo.grad_accum_steps = 1`` it is
  ``jax.value_and_grad`` of ``objective`` over the whole minibatch; with n > 1 the R rows
  are split into n micro-batches (``micro_batches``) scanned with ``lax.scan``, so only one
  micro-batch's activations are live. Packed (``plan``, ``packing.plan_batch``'s S steps of
  this minibatch): with n = 1 (S = 1) it is the whole minibatch's ``value_and_grad`` on its
  packed rows; with n > 1 it scans the S ≤ n steps, step s running the forward pass on its
  packed rows and the loss on the minibatch's rows with the loss mask cut to the sequences
  it packs (whole sequences, so per-sequence terms see all their tokens). Either way each
  part's loss is divided by the whole minibatch's ``losses.aggregate_normaliser``
  (``objective(normaliser=...)``) and the gradients are summed in float32, which is the
  whole minibatch's loss and gradient in every aggregation mode. With a value head the GAE
  advantages, their whitening and the value-clip anchor need the whole minibatch: one
  gradient-free pass over the parts computes the values (and log-probs for a reward-mode
  KL) first.

  Args:
    graphdef: the policy graph (static). algo: ``AlgoSpec`` or a mapping of ``algo``.
    temperature, top_k, top_p: the sampler's distribution (as ``make_train_step``).

  Returns:
    grad_fn. Its arguments: batch a Rollout of R rows; weights [R] float32;
    staleness [R] int32; prox, ref, v_start [R, T] float32 or None (the proximal,
    reference log-probs and start values, held constant); plan None (full width) or a
    ``packing.PackPlan`` of these R rows with leaves [S, ...] (``packing.plan_batch``'s
    plans of this minibatch): the forward passes run packed. It returns the float32 scalar
    loss, the ``objective`` metrics (token means over the whole minibatch, ``loss`` and
    ``pg_loss`` its aggregates; see ``diagnostics.combine_updates`` for the rest) and the
    gradient, a pytree like ``trainable`` in its dtypes.

  Raises:
    ValueError: invalid ``algo``; at trace time (full width) R not divisible by
      ``algo.grad_accum_steps``.
  """
  spec = AlgoSpec.from_config(algo)
  n_micro = spec.grad_accum_steps

  forward = _make_forward(graphdef, spec, temperature, top_k, top_p)

  def split_trainable(trainable, frozen=None):
    params, value_params = trainable if spec.uses_value_head else (trainable, None)
    return join_adapters(params, frozen), value_params

  def loss_fn(trainable, batch, w, stale, prox, ref, v_start, plan=None, frozen=None,
              dropout_key=None):
    params, value_params = split_trainable(trainable, frozen)
    with dropout_rng(dropout_key):  # the differentiated pass alone (models.lora)
      logp, ent, values = forward(params, value_params, batch, plan)
    adv = returns = None
    if spec.uses_value_head:  # bootstrapped from the values at the start of the step
      adv, returns = gae_advantages(spec, batch, values if v_start is None else v_start,
                                    logp_bt=logp, ref_logp_bt=ref)
    return objective(spec, logp, ent, batch, w, stale, adv_bt=adv, returns_bt=returns,
                     prox_logp_bt=prox, ref_logp_bt=ref, values_bt=values,
                     start_values_bt=v_start)

  whole_grad = jax.value_and_grad(loss_fn, has_aux=True)

  def micro_loss(trainable, batch, w, stale, prox, ref, v_start, adv, returns, norm, plan,
                 frozen, dropout_key):
    params, value_params = split_trainable(trainable, frozen)
    with dropout_rng(dropout_key):
      logp, ent, values = forward(params, value_params, batch, plan)
    return objective(spec, logp, ent, batch, w, stale, adv_bt=adv, returns_bt=returns,
                     prox_logp_bt=prox, ref_logp_bt=ref, values_bt=values,
                     start_values_bt=v_start, normaliser=norm)

  def start_advantages(trainable, batch, ref, v_start, frozen, passes):
    """(v_start, adv, returns) of the whole minibatch; ``passes(fn)`` runs the
    gradient-free ``fn(params, value_params, part)`` over the parts and joins them."""
    if not spec.uses_value_head:
      return v_start, None, None
    params, value_params = split_trainable(sg(trainable), frozen)
    logp0, _, values0 = passes(lambda part: forward(params, value_params, *part))
    v_start = values0 if v_start is None else v_start
    adv, returns = gae_advantages(spec, batch, v_start, logp_bt=logp0, ref_logp_bt=ref)
    return v_start, adv, returns

  def sum_parts(trainable, xs, part_args, frozen, dropout_key):
    """Scans ``xs`` (leading axis: the parts), part x's loss taking ``micro_loss``'s
    arguments ``part_args(x)`` (``batch`` to ``plan``) and dropout key fold_in(key, k);
    sums the float32 gradients and combines the metrics."""
    def accumulate(g_sum, xk):
      x, k = xk
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, k)
      (loss, metrics), g = jax.value_and_grad(micro_loss, has_aux=True)(
          trainable, *part_args(x), frozen, key)
      return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_sum, g), (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
    n_parts = jax.tree.leaves(xs)[0].shape[0]
    g_sum, (loss_k, metrics_k) = jax.lax.scan(accumulate, zeros,
                                              (xs, jnp.arange(n_parts, dtype=jnp.int32)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), g_sum, trainable)
    # Parts are disjoint sets of loss tokens evaluated at the same parameters: token means
    # combine by token counts, exactly as minibatches of one epoch do.
    metrics = diagnostics.combine_updates(metrics_k, 1, jnp.ones(loss_k.shape, jnp.float32))
    metrics.update(loss=loss_k.sum(), pg_loss=metrics_k["pg_loss"].sum())
    return (loss_k.sum(), metrics), grads

  def minibatch_normaliser(batch):
    mask = losses.loss_mask(batch.completion_mask, batch.truncated, spec.mask_truncated)
    return losses.aggregate_normaliser(mask, spec.aggregation)

  def strided_grad_fn(trainable, batch, w, stale, prox, ref, v_start, frozen, dropout_key):
    v_start, adv, returns = start_advantages(
        trainable, batch, ref, v_start, frozen, lambda fn: merge_micro_batches(jax.lax.map(
            lambda mb: fn((mb, None)), micro_batches(batch, n_micro))))
    norm = minibatch_normaliser(batch)
    xs = micro_batches((batch, w, stale, prox, ref, v_start, adv, returns), n_micro)
    return sum_parts(trainable, xs, lambda x: (*x, norm, None), frozen, dropout_key)

  def packed_grad_fn(trainable, batch, w, stale, prox, ref, v_start, plan, frozen,
                     dropout_key):
    v_start, adv, returns = start_advantages(
        trainable, batch, ref, v_start, frozen, lambda fn: packing.merge_steps(jax.lax.map(
            lambda p: fn((batch, p)), plan), plan))
    norm = minibatch_normaliser(batch)

    def step_args(plan_s):  # the loss tokens of the sequences step s packs, all of each
      rows = batch.replace(
          completion_mask=batch.completion_mask & packing.step_rows(plan_s)[:, None])
      return rows, w, stale, prox, ref, v_start, adv, returns, norm, plan_s

    return sum_parts(trainable, plan, step_args, frozen, dropout_key)

  def grad_fn(trainable, batch, w, stale, prox, ref, v_start, plan=None, frozen=None,
              dropout_key=None):
    # Accumulating takes the value head's extra pass even when the plan has one step, as
    # ``accounting.learner_forwards`` counts it.
    if plan is not None and (n_micro > 1 or plan.src.shape[0] > 1):
      return packed_grad_fn(trainable, batch, w, stale, prox, ref, v_start, plan, frozen,
                            dropout_key)
    if plan is not None:
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, 0)
      return whole_grad(trainable, batch, w, stale, prox, ref, v_start,
                        jax.tree.map(lambda x: x[0], plan), frozen, key)
    if n_micro == 1:
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, 0)
      return whole_grad(trainable, batch, w, stale, prox, ref, v_start, None, frozen, key)
    return strided_grad_fn(trainable, batch, w, stale, prox, ref, v_start, frozen, dropout_key)

  return grad_fn


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, algo,
                    temperature: float, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0) -> Callable:
  """Builds the jitted ``train_step(state, batch, weights=None, staleness=None)``.

  ``train_step`` returns ``(state, metrics)``; the state is donated (no parameter-sized copy
  per call). ``batch`` is a Rollout of B rows; ``weights`` [B] float32 are the
  sampling-correction weights (``weights.sampling_weights``; default ones); ``staleness``
  [B] int32 defaults to ``state.step − batch.policy_version``. Each call takes
  ``update_epochs × num_minibatches`` optimizer steps over fixed contiguous minibatches and
  advances the policy version ``step`` by one; each step's gradient is accumulated over
  ``algo.grad_accum_steps`` micro-batches of its minibatch (``make_grad_fn``: the same
  gradient as the whole minibatch's, in less memory). Metrics (float32 scalars, ``objective`` keys
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
    seed: int, the stream of LoRA adapter dropout masks (``model.lora.dropout`` > 0 only;
      ignored otherwise). Optimizer step u of the call at policy version v, accumulation
      part k, draws from fold_in(fold_in(fold_in(key(seed), v), u), k), so the same seed
      gives the same masks and a resumed run continues them.

  Returns:
    The train step, ``train_step(state, batch, weights=None, staleness=None, plan=None)``.
    With ``algo.pack_sequences`` (``packing``) every forward pass runs on packed rows:
    ``plan`` is the ``packing.PackPlan`` of the batch (``train_step.plan_batch(mask,
    multiple=1, advantages=None)``, ``packing.plan_batch`` of the [B, T] attention mask on
    the host, less the zero-advantage rows with ``algo.drop_zero_advantage``: each
    minibatch packed whole and split into S ≤ grad_accum_steps steps of R rows, leaves
    [num_minibatches, S, ...]; ``multiple`` the devices its rows split over); when it is
    None and the batch is concrete the step computes it on the host (a device to host copy
    of the mask), inside another trace it runs at full width. Each (S, R) compiles once.
    ``train_step.lower`` lowers the jitted step. Without ``pack_sequences`` it is the
    jitted step, always at full width.

  A policy that implements only ``__call__`` (no ``hidden`` / ``project_logits``) trains
  unpacked, with a one-line warning at build time (``fit_to_policy``).

  A policy with LoRA adapters (``models.lora.add_adapters``) updates only its
  ``nnx.LoRAParam`` leaves: the gradient, clip norm and optimizer step cover them alone,
  and the frozen rest of ``state.params`` comes back unchanged. With adapter dropout only
  the differentiated pass drops: the proximal, reference and value passes, like the
  behaviour log-probs, see the deterministic policy, so the importance ratio of an
  on-policy token is exp(log π_drop − log π), not 1.

  Raises:
    ValueError: invalid ``algo``, or ``algo.logprob_chunk > 0`` for a policy without
      ``hidden`` / ``project_logits`` (at build time); B not divisible by
      ``num_minibatches × grad_accum_steps`` or a missing value head / reference (at
      trace time).
  """
  spec = fit_to_policy(graphdef, AlgoSpec.from_config(algo))
  grad_fn = make_grad_fn(graphdef, spec, temperature, top_k, top_p)
  forward = _make_forward(graphdef, spec, temperature, top_k, top_p)
  by_micro_batch = _micro_batch_map(spec)
  dropout_base = jax.random.key(seed) if graph_dropout(graphdef) > 0 else None

  def train_step(state: TrainState, batch: Rollout, weights=None, staleness=None, plan=None):
    b = batch.rewards.shape[0]
    _check_batch(spec, state, b)
    if spec.drop_zero_advantage:  # the packing plan leaves the same rows out (plan_batch)
      batch = batch.replace(
          completion_mask=batch.completion_mask & _informative(batch.advantages)[:, None])
    weights = jnp.ones((b,), jnp.float32) if weights is None else weights
    if staleness is None:
      staleness = state.step - batch.policy_version
    staleness = staleness.astype(jnp.int32)
    # --- gradient-free passes over the whole batch: reference, proximal policy, values ---
    prox, ref, v_start = _gradient_free_passes(spec, forward, by_micro_batch, state, batch,
                                               plan)
    data = (batch, weights, staleness, prox, ref, v_start)
    # --- update_epochs × num_minibatches optimizer steps (LoRA: the adapters alone) -------
    adapters, frozen = split_adapters(state.params)
    trainable = adapters if not spec.uses_value_head else (adapters, state.value_params)
    idx = jnp.tile(jnp.arange(b).reshape(spec.num_minibatches, -1), (spec.update_epochs, 1))
    plans = None if plan is None else jax.tree.map(
        lambda x: jnp.tile(x, (spec.update_epochs,) + (1,) * (x.ndim - 1)), plan)
    step_key = (None if dropout_base is None
                else jax.random.fold_in(dropout_base, state.step))
    (trainable, opt_state, skipped), (per_update, norms) = jax.lax.scan(
        _make_update(spec, grad_fn, optimizer, data, frozen, step_key),
        (trainable, state.opt_state, state.skipped),
        (idx, plans, jnp.arange(idx.shape[0], dtype=jnp.int32)))
    # --- the batch's metrics and the next policy version ----------------------------------
    metrics = diagnostics.combine_updates(per_update, spec.update_epochs, norms)
    # An ESS over rows is no weighted mean of the minibatches' ESS; it does not depend on
    # the parameters, so it is taken over the whole batch.
    w_b = item_weights(spec, weights, staleness)[1]
    metrics["ess_sample_weights"] = diagnostics.effective_sample_size(
        w_b, jnp.ones(w_b.shape, bool))
    if spec.drop_zero_advantage:
      metrics["dropped_zero_advantage"] = 1.0 - _informative(batch.advantages).mean(
          dtype=jnp.float32)
    params, value_params = trainable if spec.uses_value_head else (trainable, state.value_params)
    state = state.replace(params=join_adapters(params, frozen), value_params=value_params,
                          opt_state=opt_state, step=state.step + 1, skipped=skipped)
    return state, metrics

  jitted = jax.jit(train_step, donate_argnums=(0,))
  return _with_packing(jitted, spec) if spec.pack_sequences else jitted


def _informative(advantages):
  """[B] bool (numpy or jax, as given): the rollouts ``algo.drop_zero_advantage`` keeps, whose
  advantage ([B] per sequence, or [B, T] per token) is not exactly 0 (on some token)."""
  return advantages != 0 if advantages.ndim == 1 else (advantages != 0).any(-1)


def _check_batch(spec: AlgoSpec, state: TrainState, b: int):
  """Raises ``make_train_step``'s trace-time ValueErrors: B rows that do not split into
  minibatches and micro-batches, or a value head / reference the algorithm needs and the
  state lacks."""
  if b % spec.num_minibatches:
    raise ValueError(f"train.batch_size={b} must be divisible by "
                     f"algo.num_minibatches={spec.num_minibatches}")
  if (b // spec.num_minibatches) % spec.grad_accum_steps:
    raise ValueError(f"the minibatch train.batch_size / algo.num_minibatches = "
                     f"{b // spec.num_minibatches} must be divisible by "
                     f"algo.grad_accum_steps={spec.grad_accum_steps}")
  if spec.uses_value_head and state.value_params is None:
    raise ValueError("algo.advantage='gae' needs TrainState.value_params "
                     "(build the state with init_train_state)")
  if spec.uses_reference and state.ref_params is None:
    raise ValueError("algo.kl_coef > 0 needs TrainState.ref_params "
                     "(build the state with init_train_state)")


def _micro_batch_map(spec: AlgoSpec) -> Callable:
  """``by_micro_batch(fn, batch, plan)``: ``fn(rows, plan_step)`` over a whole batch, its
  outputs row-aligned with ``batch``. Packed (``plan``): each minibatch's packed steps one
  at a time (``packing.merge_steps`` back to rows). Unpacked: the whole batch at once, or,
  with gradient accumulation, num_minibatches × grad_accum_steps micro-batches one at a
  time (with accumulation the whole batch's activations are assumed not to fit)."""
  n_mb, n_acc = spec.num_minibatches, spec.grad_accum_steps
  n_chunks = n_mb * n_acc if n_acc > 1 else 1

  def by_micro_batch(fn, batch, plan):
    if plan is not None:
      def minibatch(a):
        rows, plan_m = a
        return packing.merge_steps(jax.lax.map(lambda p: fn(rows, p), plan_m), plan_m)
      out = jax.lax.map(minibatch, (jax.tree.map(
          lambda x: x.reshape(n_mb, -1, *x.shape[1:]), batch), plan))
      return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)
    if n_chunks == 1:
      return fn(batch, None)
    return merge_micro_batches(jax.lax.map(lambda mb: fn(mb, None),
                                           micro_batches(batch, n_chunks)))

  return by_micro_batch


def _gradient_free_passes(spec: AlgoSpec, forward, by_micro_batch, state: TrainState,
                          batch: Rollout, plan):
  """The whole batch's log-probs and values at the step's start, gradients stopped:
  (prox [B, T] | None, ref [B, T] | None, v_start [B, T] | None). ``ref`` under the frozen
  reference (the KL term); ``prox`` and ``v_start`` under the step's starting parameters
  when it takes several optimizer steps: the decoupled loss's proximal policy (Hilton et al.
  2022, arXiv 2110.00641) and the values that the GAE advantages and PPO's value clipping
  hold fixed across those steps."""
  ref = prox = v_start = None
  if spec.uses_reference:
    ref, _, _ = by_micro_batch(lambda mb, p: forward(state.ref_params, None, mb, p), batch,
                               plan)
    ref = sg(ref)
  if spec.updates_per_step > 1 and (spec.loss == "decoupled" or spec.uses_value_head):
    prox, _, v_start = jax.tree.map(sg, by_micro_batch(
        lambda mb, p: forward(state.params, state.value_params, mb, p), batch, plan))
  return prox, ref, v_start


def _make_update(spec: AlgoSpec, grad_fn, optimizer: optax.GradientTransformation, data,
                 frozen, step_key=None) -> Callable:
  """The ``lax.scan`` body of one optimizer step on one minibatch.

  ``(trainable, opt_state, skipped), (idx [B / num_minibatches] int32, plan | None, u int32
  scalar: the step's index in the call)`` →
  (the new carry, (metrics, the minibatch's loss normaliser)). A step whose loss or gradient
  norm is not finite leaves parameters and optimizer state as they were and counts in
  ``skipped``; with ``spec.skip_zero_gradient``, so does a step whose gradient norm is
  exactly zero (metric ``zero_gradient_skipped``; not counted in ``skipped``).
  """
  def one_update(carry, xs):
    idx_m, plan_m, u = xs
    trainable, opt_state, skipped = carry
    mb = jax.tree.map(lambda x: x[idx_m], data)
    key = None if step_key is None else jax.random.fold_in(step_key, u)  # LoRA dropout
    (loss, metrics), grads = grad_fn(trainable, *mb, plan_m, frozen, key)
    gnorm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    # a zero gradient carries no information, but Adam would still step along its momentum
    empty = finite & (gnorm == 0) if spec.skip_zero_gradient else jnp.bool_(False)
    apply = finite & ~empty
    updates, new_opt = optimizer.update(grads, opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    keep = lambda new, old: jax.tree.map(lambda a, c: jnp.where(apply, a, c), new, old)
    metrics.update(loss=loss, grad_norm=gnorm, skipped_update=(~finite).astype(jnp.float32),
                   zero_gradient_skipped=empty.astype(jnp.float32))
    batch_m = mb[0]
    norm = losses.aggregate_normaliser(
        losses.loss_mask(batch_m.completion_mask, batch_m.truncated, spec.mask_truncated),
        spec.aggregation)
    return (keep(new_trainable, trainable), keep(new_opt, opt_state),
            skipped + (~finite).astype(jnp.int32)), (metrics, norm)

  return one_update


def _with_packing(jitted, spec: AlgoSpec) -> Callable:
  """The packed learner's entry point around the jitted step: plans a concrete batch's
  packing on the host when the caller gives no ``plan`` (``make_train_step``'s Returns)."""
  n_mb, n_acc = spec.num_minibatches, spec.grad_accum_steps

  def plan_batch(mask_bt: np.ndarray, multiple: int = 1, advantages=None, completion=None,
                 tokens=None, shape: packing.PlanShape | None = None) -> packing.PackPlan:
    mask_bt = np.asarray(mask_bt, bool)
    if spec.drop_zero_advantage and advantages is not None:
      keep = np.array(_informative(np.asarray(advantages)))
      if not keep.any():  # nothing to learn from: one row keeps the plan's shapes valid
        keep[0] = True
      mask_bt = mask_bt & keep[:, None]
    share = spec.share_prompts and completion is not None
    if share and tokens is None:
      raise ValueError("algo.share_prompts: plan_batch needs the batch's tokens")
    return packing.plan_batch(mask_bt, n_mb, n_acc, multiple=multiple,
                              completion_bt=None if completion is None else np.asarray(completion),
                              tokens_bt=None if tokens is None else np.asarray(tokens),
                              share_prompts=share, shape=shape)

  def packed_train_step(state: TrainState, batch: Rollout, weights=None, staleness=None,
                        plan=None):
    mask = batch.attention_mask
    if (plan is None and not isinstance(mask, jax.core.Tracer)
        and getattr(mask, "is_fully_addressable", True)  # a multi-process batch: the caller plans
        and mask.shape[0] % (n_mb * n_acc) == 0):  # else the jitted step raises or runs full
      adv = np.asarray(batch.advantages) if spec.drop_zero_advantage else None
      plan = plan_batch(np.asarray(mask), advantages=adv,
                        completion=np.asarray(batch.completion_mask),
                        tokens=np.asarray(batch.tokens) if spec.share_prompts else None)
    return jitted(state, batch, weights, staleness, plan)

  plan_batch.drops_zero_advantage = spec.drop_zero_advantage  # the caller copies advantages
  plan_batch.shares_prompts = spec.share_prompts  # ... and tokens
  packed_train_step.plan_batch = plan_batch
  packed_train_step.lower = jitted.lower
  return packed_train_step
