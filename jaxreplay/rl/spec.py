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
import difflib
import numbers
from typing import Any, Mapping

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

_CHOICES = {"advantage": ESTIMATORS, "loss": LOSSES, "aggregation": AGGREGATIONS,
            "kl_estimator": KL_ESTIMATORS, "kl_mode": KL_MODES,
            "staleness_target": STALENESS_TARGETS, "staleness_fn": STALENESS_FNS,
            "lr_schedule": SCHEDULES}
_INTS = ("update_epochs", "num_minibatches", "grad_accum_steps", "logprob_chunk",
         "warmup_steps", "max_consecutive_skips")
_BOOLS = ("mask_truncated", "gae_whiten", "pack_sequences")
_NUMBERS = ("eps_low", "eps_high", "horizon", "delta_v", "is_cap", "ratio_mask_c", "kl_coef",
            "entropy_coef", "gae_gamma", "gae_lambda", "vf_coef", "value_clip",
            "staleness_rate", "lr", "final_lr_fraction", "max_grad_norm", "weight_decay")


def _fail(field: str, value: Any, allowed: str):
  raise ValueError(f"algo.{field}={value!r} is invalid: {allowed}")


def _near(value: Any, valid) -> str:
  near = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
  return f" (did you mean {near[0]!r}?)" if near else ""


@dataclasses.dataclass(frozen=True)
class AlgoSpec:
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
    gae_gamma, gae_lambda: γ, λ ∈ [0, 1] of GAE. vf_coef: c_V ≥ 0, value-loss weight.
    value_clip: ε_V of the clipped value loss (≤ 0 = no clip). gae_whiten: whiten the
      GAE advantages over the batch's loss tokens.
    staleness_target, staleness_fn, staleness_rate: the staleness-adaptive trust region
      (``weights.adaptive_trust_region``); rate ≥ 0.
    staleness_buckets: lower edges of the staleness buckets of the metrics, strictly
      increasing from 0.
    update_epochs, num_minibatches: ≥ 1; optimizer steps per learner step = their product.
    grad_accum_steps: ≥ 1 micro-batches per minibatch whose gradients are summed inside
      the jitted step before one optimizer step; every aggregation divides by the whole
      minibatch's normaliser, so the gradient equals the unsplit minibatch's (only the
      activation memory shrinks, by this factor).
    logprob_chunk: ≥ 0 sequence positions per chunk of the learner's log-prob/entropy over
      the vocabulary (``scoring``): the [B, T, V] float32 logits never exist at once, only
      [B, chunk, V], recomputed in the backward pass; 0 = off (the whole [B, T, V]).
    pack_sequences: the learner's forward passes run on packed rows (``packing``: each
      micro-batch's real tokens end to end in as few full-width rows as fit, bucketed),
      not on the [B, T] padded layout; the same loss and gradient up to float rounding.
    lr: peak learning rate > 0. warmup_steps: ≥ 0 optimizer steps of linear warmup.
    lr_schedule: one of ``SCHEDULES``. final_lr_fraction: ∈ [0, 1], the cosine schedule's
      final lr / lr. max_grad_norm: > 0, global-norm clip. weight_decay: ≥ 0 (AdamW).
    max_consecutive_skips: ≥ 1 non-finite updates in a row that stop the run.
  """

  advantage: str = "grpo"
  loss: str = "ppo_clip"
  aggregation: str = "token_mean"
  eps_low: float = 0.2
  eps_high: float = 0.2
  horizon: float = 0
  delta_v: float = -0.1
  is_cap: float = 2.0
  ratio_mask_c: float = 0.0
  mask_truncated: bool = False
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_mode: str = "loss"
  entropy_coef: float = 0.0
  gae_gamma: float = 1.0
  gae_lambda: float = 0.95
  vf_coef: float = 0.5
  value_clip: float = 0.2
  gae_whiten: bool = True
  staleness_target: str = "none"
  staleness_fn: str = "inverse"
  staleness_rate: float = 0.5
  staleness_buckets: tuple = DEFAULT_BUCKETS
  update_epochs: int = 1
  num_minibatches: int = 1
  grad_accum_steps: int = 1
  logprob_chunk: int = 0
  pack_sequences: bool = True
  lr: float = 1e-4
  warmup_steps: int = 10
  lr_schedule: str = "cosine"
  final_lr_fraction: float = 0.1
  max_grad_norm: float = 1.0
  weight_decay: float = 0.0
  max_consecutive_skips: int = 10

  @classmethod
  def from_config(cls, algo: Mapping[str, Any] | AlgoSpec) -> AlgoSpec:
    """The spec of an ``algo`` ConfigDict or dict; missing keys take the defaults.

    Args:
      algo: a mapping with ``keys()`` and ``[]`` (ConfigDict, dict), or an ``AlgoSpec``
        (returned as is).

    Returns:
      The validated ``AlgoSpec``.

    Raises:
      ValueError: a key that is not a field (naming ``algo.<key>`` and a near match), or a
        bad value (see ``__post_init__``).
    """
    if isinstance(algo, AlgoSpec):
      return algo
    names = [f.name for f in dataclasses.fields(cls)]
    for key in algo.keys():
      if key not in names:
        near = difflib.get_close_matches(str(key), names, n=1)
        raise ValueError(f"algo.{key} is not a field of the algo section"
                         + (f" (did you mean algo.{near[0]}?)" if near else ""))
    return cls(**{key: algo[key] for key in algo.keys()})

  def __post_init__(self):
    """Checks every field, then the combinations that only need ``algo`` fields.

    Raises:
      ValueError: the first bad ``algo.<field>``, with the value and what is allowed.
    """
    for name, valid in _CHOICES.items():
      value = getattr(self, name)
      if value not in valid:
        _fail(name, value, f"must be one of {valid}{_near(value, valid)}")
    for name in _INTS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, value, "must be an int")
    for name in _BOOLS:
      if not isinstance(getattr(self, name), bool):
        _fail(name, getattr(self, name), "must be a bool")
    for name in _NUMBERS:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, value, "must be a number")
    for name in ("eps_low", "eps_high", "lr", "max_grad_norm"):
      if not getattr(self, name) > 0:
        _fail(name, getattr(self, name), "must be > 0")
    for name in ("kl_coef", "entropy_coef", "vf_coef", "staleness_rate", "weight_decay",
                 "warmup_steps", "logprob_chunk"):
      if getattr(self, name) < 0:
        _fail(name, getattr(self, name), "must be >= 0")
    for name in ("update_epochs", "num_minibatches", "grad_accum_steps",
                 "max_consecutive_skips"):
      if getattr(self, name) < 1:
        _fail(name, getattr(self, name), "must be >= 1")
    for name in ("gae_gamma", "gae_lambda", "final_lr_fraction"):
      if not 0 <= getattr(self, name) <= 1:
        _fail(name, getattr(self, name), "must be in [0, 1]")
    if self.ratio_mask_c and self.ratio_mask_c <= 1:
      _fail("ratio_mask_c", self.ratio_mask_c, "must be > 1 (or 0 to disable)")
    if self.aggregation == "seq_mean_token_sum_norm" and not self.horizon > 0:
      _fail("horizon", self.horizon, "must be > 0 (e.g. sampler.max_new_tokens) for "
            "algo.aggregation='seq_mean_token_sum_norm'")
    edges = self.staleness_buckets
    if (not isinstance(edges, (tuple, list)) or not edges
        or any(isinstance(e, bool) or not isinstance(e, numbers.Integral) for e in edges)
        or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:]))):
      _fail("staleness_buckets", edges, "must be ints, strictly increasing and start at 0")
    object.__setattr__(self, "staleness_buckets", tuple(int(e) for e in edges))
    if self.loss == "asymre" and self.advantage != "dr_grpo":
      _fail("advantage", self.advantage,
            "algo.loss='asymre' uses the group-mean baseline: set algo.advantage='dr_grpo'")
    if self.advantage == "gae" and self.loss in ("gspo", "asymre"):
      _fail("loss", self.loss, f"needs a sequence-level advantage; algo.advantage='gae' is "
            f"per token (use one of {GROUP_ESTIMATORS})")
    if self.kl_coef > 0 and self.kl_mode == "reward" and self.loss == "asymre":
      _fail("kl_mode", self.kl_mode,
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
