"""The ``algo`` config section as one frozen, validated dataclass, and the names it accepts.

``AlgoSpec`` owns every ``algo.*`` field: the objective's, the optimizer's and the loop's
(``max_consecutive_skips``). It is validated in plain Python when constructed
(``__post_init__``), is hashable, and is closed over by the jitted train step, so nothing in
it is traced. ``from_config`` also rejects keys that are not fields. Every error is a
one-line ``ValueError`` naming ``algo.<field>``, the value and what is allowed; checks that
also read other sections (``train.steps``, ``train.batch_size``, ``rollout.group_size``)
live in ``jaxreplay.config.validate``.

The name tuples are the valid choices of the string fields. The modules that implement
them (``losses``, ``advantages``, ``weights``, ``diagnostics``, ``train_step``) import them
from here, so that reading or validating a config imports neither jax, flax nor optax.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

from jaxreplay.spec import Spec, field

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gae")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
LOSSES = ("ppo_clip", "tis", "decoupled", "gspo", "asymre", "reinforce")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
STALENESS_TARGETS = ("none", "clip", "cap", "weight")
STALENESS_FNS = ("inverse", "exp", "linear")
SCHEDULES = ("constant", "cosine")
DEFAULT_BUCKETS = (0, 1, 2, 4, 8)

@dataclasses.dataclass(frozen=True)
class AlgoSpec(Spec):
  """The ``algo`` config section. Field = config key; value = default (``configs/default.py``).

  Attributes:
    advantage: A, one of ``ESTIMATORS``. Group estimators (``grpo``, ``dr_grpo``, ``rloo``)
      run at generation time; ``gae`` per token in the learner step with a value head.
    loss: the per-token policy loss, one of ``LOSSES`` (``losses.POLICY_LOSSES``).
    aggregation: how per-token losses reduce to a scalar, one of ``AGGREGATIONS``.
    eps_low, eps_high: ε_low, ε_high > 0, the clip range [1 − ε_low, 1 + ε_high].
    horizon: L > 0, the constant normaliser of ``seq_mean_token_sum_norm`` (Dr. GRPO).
    delta_v: δV, AsymRE's baseline shift (< 0 lowers the baseline).
    is_cap: c̄, truncation of π/μ for ``tis`` and of π_prox/μ for ``decoupled``; ≤ 0 = none.
    ratio_mask_c: c > 1: tokens with ratio ∉ [1/c, c] get no policy gradient; 0 = off.
    mask_truncated: drop truncated completions from the loss and its normaliser.
    kl_coef: β ≥ 0, weight of the KL to the frozen reference ``TrainState.ref_params``.
    kl_estimator: k1, k2 or k3 (Schulman 2020).
    kl_mode: ``loss`` adds β·kl per token; ``reward`` subtracts β·kl from the GAE token
      rewards, or (group estimators) from the rewards at generation time before the group
      advantages (``losses.kl_penalised_rewards``).
    entropy_coef: c_H ≥ 0, entropy bonus.
    gae_gamma, gae_lambda: γ, λ ∈ [0, 1] of GAE.
    vf_coef: c_V ≥ 0, value-loss weight.
    value_clip: ε_V of the clipped value loss (≤ 0 = no clip).
    gae_whiten: whiten the GAE advantages over the batch's loss tokens.
    staleness_target, staleness_fn, staleness_rate: the staleness-adaptive trust region
      (``weights.adaptive_trust_region``); rate ≥ 0.
    staleness_buckets: lower edges of the staleness buckets of the metrics, strictly
      increasing from 0.
    update_epochs, num_minibatches: ≥ 1; optimizer steps per learner step = their product.
    grad_accum_steps: ≥ 1 micro-batches per minibatch whose gradients are summed inside
      the jitted step before one optimizer step; every aggregation divides by the whole
      minibatch's normaliser, so the gradient equals the unsplit minibatch's (only the
      activation memory shrinks, by this factor). Packed, a micro-batch is a budget of
      rows: the minibatch's packed rows run in as few steps of at most that many rows.
    logprob_chunk: ≥ 0 sequence positions per chunk of the learner's log-prob/entropy over
      the vocabulary (``scoring``): the [B, T, V] float32 logits never exist at once, only
      [B, chunk, V], recomputed in the backward pass; 0 = off (the whole [B, T, V]).
    pack_sequences: the learner's forward passes run on packed rows (``packing``: each
      minibatch's real tokens end to end in as few full-width rows as fit, bucketed, then
      split into accumulation steps of whole sequences), not on the [B, T] padded layout;
      the same loss and gradient up to float rounding. The output head and the
      log-softmax run on the completion tokens alone (the only ones a loss reads).
    share_prompts: packed, the rollouts of a minibatch that share a prompt (a group's G
      samples) run it once: one copy of the prompt, then each completion, which attends to
      the prompt and to its own tokens only (``packing.place_units``). The same loss and
      gradient up to float rounding, with G − 1 prompts' forward and backward passes
      fewer per group; the rows' mask runs on XLA's attention, not a fused kernel. Needs
      ``pack_sequences`` and no value head.
    lr: peak learning rate > 0.
    warmup_steps: ≥ 0 optimizer steps of linear warmup; with the cosine schedule fewer than
      ``train.steps`` (a short run sets it lower, e.g. ``--config.algo.warmup_steps=0``).
    lr_schedule: one of ``SCHEDULES``.
    final_lr_fraction: ∈ [0, 1], the cosine schedule's final lr / lr.
    max_grad_norm: > 0, global-norm clip.
    weight_decay: ≥ 0, decoupled weight decay (AdamW).
    max_consecutive_skips: ≥ 1 non-finite updates in a row that stop the run.
    skip_zero_gradient: an optimizer step whose gradient is exactly zero (every advantage in
      its minibatch zero, no KL or entropy term) leaves parameters and optimizer state as
      they were. Otherwise Adam keeps moving the weights along its momentum with no new
      information (after one informative step, 0.67 of a step on the next and five steps'
      worth in all at β = (0.9, 0.999)) — with sparse rewards and few groups per step, most
      of the movement.
    drop_zero_advantage: the learner leaves out the rollouts whose advantage is exactly 0
      (in a group whose rewards are all equal): no forward or backward pass on them, and
      the loss normaliser counts only the rest — DAPO's dynamic-sampling filter (Yu et al.
      2025, arXiv 2503.14476 §3.2) applied to the learner batch. Their gradient is
      0 in every loss here but AsymRE's, so only the normaliser changes; with sparse
      rewards most of the learner's compute goes. Needs no KL loss term, no entropy bonus,
      no value head and a loss other than ``asymre``.
  """

  SECTION: ClassVar[str] = "algo"

  advantage: str = field("grpo", choices=ESTIMATORS)
  loss: str = field("ppo_clip", choices=LOSSES)
  aggregation: str = field("token_mean", choices=AGGREGATIONS)
  eps_low: float = field(0.2, gt=0)
  eps_high: float = field(0.2, gt=0)
  horizon: float = field(0, allowed="(> 0 with aggregation='seq_mean_token_sum_norm')")
  delta_v: float = field(-0.1)
  is_cap: float = field(2.0, allowed="(<= 0: no truncation)")
  ratio_mask_c: float = field(0.0, allowed="(> 1, or 0 to disable)")
  mask_truncated: bool = field(False)
  kl_coef: float = field(0.0, ge=0)
  kl_estimator: str = field("k3", choices=KL_ESTIMATORS)
  kl_mode: str = field("loss", choices=KL_MODES)
  entropy_coef: float = field(0.0, ge=0)
  gae_gamma: float = field(1.0, ge=0, le=1)
  gae_lambda: float = field(0.95, ge=0, le=1)
  vf_coef: float = field(0.5, ge=0)
  value_clip: float = field(0.2, allowed="(<= 0: no clip)")
  gae_whiten: bool = field(True)
  staleness_target: str = field("none", choices=STALENESS_TARGETS)
  staleness_fn: str = field("inverse", choices=STALENESS_FNS)
  staleness_rate: float = field(0.5, ge=0)
  staleness_buckets: tuple = field(DEFAULT_BUCKETS, allowed="(ints, strictly increasing from 0)")
  update_epochs: int = field(1, ge=1)
  num_minibatches: int = field(1, ge=1, allowed="(divides train.batch_size)")
  grad_accum_steps: int = field(1, ge=1, allowed="(divides the minibatch)")
  logprob_chunk: int = field(0, ge=0, allowed="(0 = the whole sequence at once)")
  pack_sequences: bool = field(True)
  share_prompts: bool = field(False)
  lr: float = field(1e-4, gt=0)
  warmup_steps: int = field(10, ge=0, allowed="(< train.steps with lr_schedule='cosine', unless train.steps = 0)")
  lr_schedule: str = field("cosine", choices=SCHEDULES)
  final_lr_fraction: float = field(0.1, ge=0, le=1)
  max_grad_norm: float = field(1.0, gt=0)
  weight_decay: float = field(0.0, ge=0)
  max_consecutive_skips: int = field(10, ge=1)
  skip_zero_gradient: bool = field(False)
  drop_zero_advantage: bool = field(False)

  def check(self):
    """The combinations that only need ``algo`` fields.

    Raises:
      ConfigError: the first bad ``algo.<field>``, with the value and what is allowed.
    """
    if self.ratio_mask_c and self.ratio_mask_c <= 1:
      self.fail("ratio_mask_c", self.ratio_mask_c, "must be > 1 (or 0 to disable)")
    if self.aggregation == "seq_mean_token_sum_norm" and not self.horizon > 0:
      self.fail("horizon", self.horizon, "must be > 0 (e.g. sampler.max_new_tokens) for "
                "algo.aggregation='seq_mean_token_sum_norm'")
    edges = self.staleness_buckets
    if (not edges or any(isinstance(e, bool) or not isinstance(e, numbers.Integral) for e in edges)
        or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:]))):
      self.fail("staleness_buckets", edges, "must be ints, strictly increasing and start at 0")
    object.__setattr__(self, "staleness_buckets", tuple(int(e) for e in edges))
    if self.loss == "asymre" and self.advantage != "dr_grpo":
      self.fail("advantage", self.advantage,
                "algo.loss='asymre' uses the group-mean baseline: set algo.advantage='dr_grpo'")
    if self.advantage == "gae" and self.loss in ("gspo", "asymre"):
      self.fail("loss", self.loss, f"needs a sequence-level advantage; algo.advantage='gae' is "
                f"per token (use one of {GROUP_ESTIMATORS})")
    if self.drop_zero_advantage:
      why = ("algo.kl_coef > 0 with algo.kl_mode='loss'" if self.kl_coef > 0 and
             self.kl_mode == "loss" else "algo.entropy_coef > 0" if self.entropy_coef > 0
             else "algo.advantage='gae' (the value loss)" if self.advantage == "gae"
             else "algo.loss='asymre'" if self.loss == "asymre" else "")
      if why:
        self.fail("drop_zero_advantage", True, f"a zero-advantage rollout still has a "
                  f"gradient with {why}; set algo.drop_zero_advantage=False")
    if self.share_prompts and not self.pack_sequences:
      self.fail("share_prompts", True, "shares prompts between packed rows: set "
                "algo.pack_sequences=True or algo.share_prompts=False")
    if self.share_prompts and self.uses_value_head:
      self.fail("share_prompts", True, "the value head reads every position of a row; with "
                "algo.advantage='gae' set algo.share_prompts=False")
    if self.kl_coef > 0 and self.kl_mode == "reward" and self.loss == "asymre":
      self.fail("kl_mode", self.kl_mode,
                "with algo.loss='asymre' the KL penalty would enter the group-mean baseline "
                "recovered from the stored advantages: use algo.kl_mode='loss'")

  @property
  def uses_value_head(self) -> bool:
    """GAE needs a critic: ``TrainState.value_params``."""
    return self.advantage == "gae"

  @property
  def uses_reference(self) -> bool:
    """A KL term needs the frozen reference: ``TrainState.ref_params``."""
    return self.kl_coef > 0

  @property
  def updates_per_step(self) -> int:
    """Optimizer steps per learner step: ``update_epochs × num_minibatches``."""
    return self.update_epochs * self.num_minibatches
