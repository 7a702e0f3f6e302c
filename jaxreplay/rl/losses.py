"""Off-policy policy-gradient losses, KL estimators, entropy and token aggregation.

Pure functions in the rlax style. Shapes: B sequences × T token columns. ``logp_bt`` is
log π_θ of each sampled token under the current policy, ``behaviour_logp_bt`` the
stored log μ (the sampling distribution), ``mask_bt`` the loss mask. Every loss is to
be *minimised* and returns per-token values [B, T]; ``aggregate`` reduces them. The
per-token value is the negated surrogate, so ∂loss/∂logp is the (negated) policy
gradient weight of that token.

One contract for every policy loss (``POLICY_LOSSES``), so a caller dispatches by name:

  loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams)
      -> (loss_bt [B, T] float32, LossInfo)

``adv`` is [B] (one per sequence) or [B, T] (per token, GAE); ``LossParams`` carries the
hyper-parameters and the inputs only some losses read (π_prox, rewards). A loss ignores the
fields it does not use. Per-sample hyper-parameters (ε, truncation cap) may be Python
floats or [B] arrays: the staleness-adaptive trust region (``jaxreplay.rl.weights``) passes
[B]. Error messages use the argument names of these functions, not config fields.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxreplay.rl.spec import AGGREGATIONS, KL_ESTIMATORS, LOSSES  # noqa: F401  (re-exported)

sg = jax.lax.stop_gradient


class LossParams(NamedTuple):
  """Hyper-parameters of the policy losses, and the inputs only some of them read.

  Attributes:
    eps_low, eps_high: ε_low, ε_high > 0, float or [B] float32 clip range (``ppo_clip``,
      ``decoupled``, ``gspo``).
    cap: c̄ > 0, float or [B] float32 truncation (``tis``: of π/μ; ``decoupled``: of
      π_prox/μ); ``jnp.inf`` = none.
    delta_v: δV, the baseline shift of ``asymre``.
    prox_logp_bt: [B, T] float32 log π_prox for ``decoupled`` (held constant); None = the
      current log-probs with the gradient stopped (π_prox = π_θ at the start of the step).
    rewards_b: [B] float32 rewards r for ``asymre``, whose baseline is V̂ = r − A.
  """

  eps_low: Any = 0.2
  eps_high: Any = 0.2
  cap: Any = jnp.inf
  delta_v: float = -0.1
  prox_logp_bt: Any = None
  rewards_b: Any = None


class LossInfo(NamedTuple):
  """Diagnostics of a policy loss, all [B, T].

  Attributes:
    ratio: float32, the ratio the trust region sees (π/μ, π/π_prox for ``decoupled``,
      the sequence ratio broadcast to tokens for ``gspo``).
    clipped_low: bool, the clip/truncation removed this token's gradient from below.
    clipped_high: bool, ... from above (for ``tis``: the weight was truncated).
  """

  ratio: jax.Array
  clipped_low: jax.Array
  clipped_high: jax.Array


# |log π − log μ| is bounded before exp (verl clamps it to ±20 likewise): one token whose
# behaviour log-prob is far below the current one (e.g. a sampler-side numerical outlier)
# would otherwise give exp(x) = inf past x ≈ 88 in float32, a NaN gradient (0 · inf in the
# unselected branch of the clip), and a skipped update for the whole batch. Past the bound
# the token's term stays finite and its gradient is 0, as on the clipped side of PPO.
LOG_RATIO_BOUND = 20.0


def importance_ratio(logp_bt, behaviour_logp_bt) -> jax.Array:
  """exp(clip(logp − behaviour_logp, −20, 20)): the importance ratio π/μ, bounded.

  Args:
    logp_bt, behaviour_logp_bt: float32 arrays of one shape (log-probs, nats).

  Returns:
    float32 array of that shape in [e^−20, e^20]; its gradient is 0 where the log-ratio
    is outside ±``LOG_RATIO_BOUND`` (verl's ``compute_policy_loss`` clamps it the same).
  """
  return jnp.exp(jnp.clip(logp_bt - behaviour_logp_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def _per_seq(x, b: int) -> jax.Array:
  """A scalar or [B] hyper-parameter as a [B, 1] float32 column."""
  x = jnp.asarray(x, jnp.float32)
  chex.assert_rank(x, {0, 1})
  return jnp.broadcast_to(x, (b,))[:, None]


def _adv_bt(adv, shape) -> jax.Array:
  """[B] or [B, T] advantages as [B, T] float32."""
  chex.assert_rank(adv, {1, 2})
  adv = adv.astype(jnp.float32)
  return jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)


def _check(logp_bt, *others):
  chex.assert_rank(logp_bt, 2)
  chex.assert_equal_shape([logp_bt, *others])


def _unclipped(ratio_bt) -> LossInfo:
  """LossInfo of a loss without a trust region: the ratio, nothing clipped."""
  none = jnp.zeros(ratio_bt.shape, bool)
  return LossInfo(ratio_bt, none, none)


def _clipped_surrogate(ratio, adv, eps_low, eps_high):
  """−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) and which side removed the gradient."""
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = -jnp.minimum(ratio * adv, clipped * adv)
  low = (adv < 0) & (ratio < 1.0 - eps_low)
  high = (adv > 0) & (ratio > 1.0 + eps_high)
  return loss, low, high


def ppo_clip_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """Token-level clipped surrogate against the behaviour policy.

  PPO (Schulman et al. 2017, arXiv 1707.06347 eq. 7) with the decoupled lower/upper
  range of DAPO "clip-higher" (Yu et al. 2025, arXiv 2503.14476 eq. 8):
    loss_t = −min(r_t A, clip(r_t, 1−ε_low, 1+ε_high) A),  r_t = exp(logp_t − log μ_t).

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32. mask_bt: [B, T] bool (shape only).
    adv: [B] or [B, T] float32 advantages.
    params: reads ``eps_low``, ``eps_high`` (float or [B], > 0).

  Returns:
    (loss [B, T] float32, LossInfo).

  Raises:
    AssertionError (chex): rank or shape mismatch.
  """
  _check(logp_bt, behaviour_logp_bt, mask_bt)
  b = logp_bt.shape[0]
  a = _adv_bt(adv, logp_bt.shape)
  ratio = importance_ratio(logp_bt, behaviour_logp_bt)
  loss, low, high = _clipped_surrogate(ratio, a, _per_seq(params.eps_low, b),
                                       _per_seq(params.eps_high, b))
  return loss, LossInfo(ratio, low, high)


def tis_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """Truncated importance sampling policy gradient.

  IMPALA's truncated weight ρ̄ = min(c̄, π/μ) (Espeholt et al. 2018, arXiv 1802.01561
  eq. 1 and §4.2), applied to the token policy gradient as in TIS for LLM RL (Yao et
  al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    loss_t = −sg(min(r_t, c̄)) · A · logp_t.
  The value of the loss is a surrogate; its gradient is min(r, c̄)·A·∇log π.

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32. mask_bt: [B, T] bool (shape only).
    adv: [B] or [B, T] float32.
    params: reads ``cap`` (float or [B], > 0; ``jnp.inf`` for plain IS).

  Returns:
    (loss [B, T] float32, LossInfo with ``clipped_high`` = weight truncated).

  Raises:
    AssertionError (chex): rank or shape mismatch.
  """
  _check(logp_bt, behaviour_logp_bt, mask_bt)
  b = logp_bt.shape[0]
  a = _adv_bt(adv, logp_bt.shape)
  ratio = importance_ratio(logp_bt, behaviour_logp_bt)
  c = _per_seq(params.cap, b)
  w = sg(jnp.minimum(ratio, c))
  return -w * a * logp_bt, LossInfo(ratio, jnp.zeros(ratio.shape, bool), ratio > c)


def decoupled_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """Decoupled PPO: behaviour correction separated from the trust region.

  Hilton, Cobbe & Schulman 2022 ("Batch size-invariance for policy optimization",
  arXiv 2110.00641 §3, the decoupled PPO-clip objective), as used for asynchronous LLM
  RL by AReaL (Fu et al. 2025, arXiv 2505.24298, decoupled PPO objective):
    loss_t = −sg(min(π_prox/μ, c̄)) · min(r'_t A, clip(r'_t, 1−ε_low, 1+ε_high) A),
    r'_t = π_θ/π_prox,
  where π_prox is the proximal policy (the policy at the start of the learner step).

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32. mask_bt: [B, T] bool (shape only).
    adv: [B] or [B, T] float32.
    params: reads ``prox_logp_bt`` ([B, T], constant; None = sg(logp_bt)), ``eps_low``,
      ``eps_high`` (clip range around π_prox) and ``cap`` (truncation of π_prox/μ).

  Returns:
    (loss [B, T] float32, LossInfo whose ratio and clip flags refer to r').

  Raises:
    AssertionError (chex): rank or shape mismatch.
  """
  prox_logp_bt = logp_bt if params.prox_logp_bt is None else params.prox_logp_bt
  _check(logp_bt, behaviour_logp_bt, prox_logp_bt, mask_bt)
  b = logp_bt.shape[0]
  a = _adv_bt(adv, logp_bt.shape)
  prox = sg(prox_logp_bt)
  w = jnp.minimum(importance_ratio(prox, behaviour_logp_bt), _per_seq(params.cap, b))
  ratio = importance_ratio(logp_bt, prox)
  loss, low, high = _clipped_surrogate(ratio, a, _per_seq(params.eps_low, b),
                                       _per_seq(params.eps_high, b))
  return sg(w) * loss, LossInfo(ratio, low, high)


def gspo_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """GSPO: clipped surrogate on the length-normalised sequence ratio.

  Zheng et al. 2025 (Group Sequence Policy Optimization, arXiv 2507.18071 §4.1):
    s_i = exp((1/|y_i|) Σ_t (logp_t − log μ_t)),
    ℓ_i = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i).
  ℓ_i is written on every masked token of row i, so ``seq_mean_token_mean`` gives the
  paper's (1/G) Σ_i ℓ_i exactly (other modes weight sequences by length).

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32. mask_bt: [B, T] bool, the tokens |y_i|.
    adv: [B] float32 sequence advantages.
    params: reads ``eps_low``, ``eps_high`` (float or [B]; the paper uses ~3e-4 / 4e-4).

  Returns:
    (loss [B, T] float32, 0 off the mask; LossInfo with s_i broadcast over tokens).

  Raises:
    AssertionError (chex): rank or shape mismatch, or per-token ``adv``.
  """
  _check(logp_bt, behaviour_logp_bt, mask_bt)
  chex.assert_rank(adv, 1)
  b = logp_bt.shape[0]
  m = mask_bt.astype(jnp.float32)
  n = jnp.maximum(m.sum(-1, keepdims=True), 1.0)
  # [B, 1]: the mean token log-ratio, bounded like the token ratios
  s = importance_ratio(jnp.sum((logp_bt - behaviour_logp_bt) * m, -1, keepdims=True) / n, 0.0)
  loss, low, high = _clipped_surrogate(s, adv.astype(jnp.float32)[:, None],
                                       _per_seq(params.eps_low, b), _per_seq(params.eps_high, b))
  shape = logp_bt.shape
  return (jnp.broadcast_to(loss, shape) * m,
          LossInfo(jnp.broadcast_to(s, shape), jnp.broadcast_to(low, shape) & mask_bt,
                   jnp.broadcast_to(high, shape) & mask_bt))


def asymre_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """AsymRE (Arnal et al. 2025, arXiv 2506.20520 §3; jaxreplay paper §5.5).

  loss_t = −(r − (V̂ + δV)) · logp_t: REINFORCE with the group-mean baseline V̂ shifted
  by δV (< 0 lowers it), no importance ratio. ``adv`` is Dr. GRPO's A = r − V̂
  (``advantages.dr_grpo``), so V̂ = r − A.

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32 (μ only enters ``LossInfo.ratio``).
    adv: [B] float32, r − V̂. mask_bt: [B, T] bool (shape only).
    params: reads ``rewards_b`` ([B] float32 r, required) and ``delta_v`` (δV; the paper
      uses −0.1).

  Returns:
    (loss [B, T] float32, LossInfo with the ratio π/μ and nothing clipped).

  Raises:
    ValueError: ``params.rewards_b`` is None.
    AssertionError (chex): rank or shape mismatch.
  """
  if params.rewards_b is None:
    raise ValueError("asymre_loss needs params.rewards_b (the baseline is V̂ = r − adv)")
  _check(logp_bt, behaviour_logp_bt, mask_bt)
  chex.assert_rank([adv, params.rewards_b], [1, 1])
  chex.assert_equal_shape([adv, params.rewards_b])
  rewards_b = params.rewards_b
  baseline_b = rewards_b - adv
  loss = -(rewards_b - (baseline_b + params.delta_v)).astype(jnp.float32)[:, None] * logp_bt
  return loss, _unclipped(importance_ratio(sg(logp_bt), behaviour_logp_bt))


def reinforce_loss(logp_bt, behaviour_logp_bt, adv, mask_bt, params: LossParams = LossParams()):
  """On-policy REINFORCE (Williams 1992, eq. 11 with baseline): loss_t = −A · logp_t.

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32 (μ only enters ``LossInfo.ratio``).
    adv: [B] or [B, T] float32. mask_bt: [B, T] bool (shape only).
    params: unused (the shared contract).

  Returns:
    (loss [B, T] float32, LossInfo with the ratio π/μ and nothing clipped).

  Raises:
    AssertionError (chex): rank or shape mismatch.
  """
  _check(logp_bt, behaviour_logp_bt, mask_bt)
  loss = -_adv_bt(adv, logp_bt.shape) * logp_bt
  return loss, _unclipped(importance_ratio(sg(logp_bt), behaviour_logp_bt))


# Every policy loss by name (the choices of ``AlgoSpec.loss``). Each follows the contract of
# the module docstring, so a caller dispatches through this table.
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "tis": tis_loss, "decoupled": decoupled_loss,
                 "gspo": gspo_loss, "asymre": asymre_loss, "reinforce": reinforce_loss}


def ratio_in_range(ratio_bt, c: float) -> jax.Array:
  """[B, T] bool: 1/c ≤ ratio ≤ c (token masking of extreme ratios, e.g. IcePop/MIS).

  Args:
    ratio_bt: [B, T] float32. c: > 1, or ≤ 0 to disable (all True).

  Returns:
    [B, T] bool, True where the token keeps its policy gradient.

  Raises:
    ValueError: 0 < c ≤ 1.
  """
  if c <= 0:
    return jnp.ones(ratio_bt.shape, bool)
  if c <= 1:
    raise ValueError(f"c={c} must be > 1 (or <= 0 to disable)")
  return (ratio_bt >= 1.0 / c) & (ratio_bt <= c)


# --- KL to a reference policy ----------------------------------------------------------


def kl_estimate(logp_bt, ref_logp_bt, estimator: str) -> jax.Array:
  """Per-token sampled estimators of KL(π_θ ‖ π_ref) on tokens drawn from π_θ.

  Schulman 2020, "Approximating KL divergence" (joschu.net/blog/kl-approx.html), with
  log-ratio x = log π_ref − log π_θ:
    k1 = −x = logp − ref,   k2 = x²/2,   k3 = exp(x) − 1 − x  (≥ 0, unbiased).
  All three and their gradients are 0 at logp == ref; k2, k3 ≥ 0 (CASES.md case 10).

  Args:
    logp_bt, ref_logp_bt: same shape float32 (``ref`` is held constant).
    estimator: one of ``KL_ESTIMATORS``.

  Returns:
    Same shape float32.

  Raises:
    ValueError: unknown ``estimator``.
  """
  chex.assert_equal_shape([logp_bt, ref_logp_bt])
  x = sg(ref_logp_bt) - logp_bt
  if estimator == "k1":
    return -x
  if estimator == "k2":
    return 0.5 * x * x
  if estimator == "k3":
    return jnp.expm1(x) - x
  raise ValueError(f"estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def kl_penalised_rewards(rewards_b, logp_bt, ref_logp_bt, mask_bt, beta: float,
                         estimator: str = "k1") -> jax.Array:
  """KL as a reward penalty (Ziegler et al. 2019, arXiv 1909.08593 eq. 2): r − β Σ_t kl_t.

  For group estimators apply this at generation time, before ``compute_advantages``,
  with ``logp`` the behaviour log-probs and ``ref`` the reference's.

  Args:
    rewards_b: [B] float32. logp_bt, ref_logp_bt: [B, T] float32. mask_bt: [B, T] bool.
    beta: penalty coefficient. estimator: one of ``KL_ESTIMATORS``.

  Returns:
    [B] float32 penalised rewards (no gradient flows).
  """
  chex.assert_rank([rewards_b, logp_bt], [1, 2])
  kl = sg(kl_estimate(logp_bt, ref_logp_bt, estimator))
  return rewards_b.astype(jnp.float32) - beta * jnp.sum(jnp.where(mask_bt, kl, 0.0), -1)


# --- aggregation, masks, entropy -------------------------------------------------------


def loss_mask(completion_mask_bt, truncated_b, mask_truncated: bool) -> jax.Array:
  """The tokens the loss and its normaliser see (CASES.md case 3).

  Args:
    completion_mask_bt: [B, T] bool. truncated_b: [B] bool.
    mask_truncated: drop every token of truncated completions (the normaliser, computed
      from this mask by ``aggregate``, then excludes them too).

  Returns:
    [B, T] bool.
  """
  chex.assert_rank([completion_mask_bt, truncated_b], [2, 1])
  if not mask_truncated:
    return completion_mask_bt
  return completion_mask_bt & ~truncated_b[:, None]


def aggregate(loss_bt, mask_bt, mode: str, horizon: int | float = 0,
              normaliser=None) -> jax.Array:
  """Reduces per-token losses to a scalar (CASES.md case 4); batch-size invariant.

  Modes (the normaliser always comes from ``mask_bt``, so masked tokens never count):
    token_mean: Σ loss·m / Σ m (DAPO, Yu et al. 2025 eq. 8).
    seq_mean_token_mean: mean over sequences with ≥ 1 token of each one's token mean
      (GRPO, Shao et al. 2024 eq. 3).
    seq_mean_token_sum: mean over all B sequences of Σ_t loss·m (a fully masked row
      counts as 0, so the normaliser B is constant).
    seq_mean_token_sum_norm: the same divided by the constant ``horizon`` (Dr. GRPO,
      Liu et al. 2025 §3.1: the max response length).
  A batch with no valid token gives exactly 0.

  With ``normaliser`` (gradient accumulation) the rows are one part of a larger batch:
  the result is this part's numerator divided by the whole batch's normaliser
  (``aggregate_normaliser`` of the whole batch's mask), so the parts' results sum to the
  whole batch's aggregate in every mode.

  Args:
    loss_bt: [B, T] float32. mask_bt: [B, T] bool. mode: one of ``AGGREGATIONS``.
    horizon: > 0 for ``seq_mean_token_sum_norm`` (e.g. the max response length).
    normaliser: None (this batch's own), or a float32 scalar ≥ 0: the normaliser of the
      batch these rows are part of.

  Returns:
    float32 scalar.

  Raises:
    ValueError: unknown ``mode``, or ``seq_mean_token_sum_norm`` without a horizon.
  """
  _check(loss_bt, mask_bt)
  if mode == "seq_mean_token_sum_norm" and (not horizon or horizon <= 0):
    raise ValueError(f"horizon={horizon!r} must be > 0 for mode='seq_mean_token_sum_norm'")
  m = mask_bt.astype(jnp.float32)
  lm = jnp.where(mask_bt, loss_bt, 0.0)
  if normaliser is not None:
    if mode == "seq_mean_token_mean":
      n_t = m.sum(-1)
      num = (lm.sum(-1) / jnp.maximum(n_t, 1.0)).sum()  # a row with no token adds 0
    elif mode in AGGREGATIONS:
      num = lm.sum()
    else:
      raise ValueError(f"mode={mode!r} is not one of {AGGREGATIONS}")
    out = num / jnp.maximum(jnp.asarray(normaliser, jnp.float32), 1.0)
    return out / horizon if mode == "seq_mean_token_sum_norm" else out
  if mode == "token_mean":
    return lm.sum() / jnp.maximum(m.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    n_t = m.sum(-1)
    per_seq = lm.sum(-1) / jnp.maximum(n_t, 1.0)
    has = (n_t > 0).astype(jnp.float32)
    return (per_seq * has).sum() / jnp.maximum(has.sum(), 1.0)
  if mode == "seq_mean_token_sum":
    return lm.sum(-1).mean()
  if mode == "seq_mean_token_sum_norm":
    return lm.sum(-1).mean() / horizon
  raise ValueError(f"mode={mode!r} is not one of {AGGREGATIONS}")


def aggregate_normaliser(mask_bt, mode: str) -> jax.Array:
  """The count ``aggregate`` divides by: the weight of a minibatch's aggregate in the batch's.

  For disjoint minibatches k with aggregates a_k and normalisers n_k, the aggregate of their
  union is Σ_k n_k·a_k / Σ_k n_k in every mode (the ``horizon`` divides both sides):
    token_mean: Σ m (loss tokens).
    seq_mean_token_mean: rows with ≥ 1 loss token.
    seq_mean_token_sum, seq_mean_token_sum_norm: B (rows, masked or not).
  An empty minibatch has normaliser 0 under the first two modes, and aggregate 0.

  Args:
    mask_bt: [B, T] bool. mode: one of ``AGGREGATIONS``.

  Returns:
    float32 scalar.

  Raises:
    ValueError: unknown ``mode``.
  """
  chex.assert_rank(mask_bt, 2)
  m = mask_bt.astype(jnp.float32)
  if mode == "token_mean":
    return m.sum()
  if mode == "seq_mean_token_mean":
    return (m.sum(-1) > 0).astype(jnp.float32).sum()
  if mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
    return jnp.float32(mask_bt.shape[0])
  raise ValueError(f"mode={mode!r} is not one of {AGGREGATIONS}")


def masked_mean(x_bt, mask_bt) -> jax.Array:
  """Mean of ``x`` over True entries of ``mask`` (0 when none; off-mask values never read).

  Args:
    x_bt: float array. mask_bt: bool array of the same shape.

  Returns:
    float32 scalar.
  """
  chex.assert_equal_shape([x_bt, mask_bt])
  m = mask_bt.astype(jnp.float32)
  return jnp.where(mask_bt, x_bt, 0.0).sum() / jnp.maximum(m.sum(), 1.0)


def token_entropy(logits_btv) -> jax.Array:
  """Entropy −Σ_v p log p of each position's distribution, [B, T] float32 (nats).

  Args:
    logits_btv: [B, T, V] float.

  Returns:
    [B, T] float32.
  """
  chex.assert_rank(logits_btv, 3)
  logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sampled_entropy(logp_bt, mask_bt) -> jax.Array:
  """Per-sequence sampled-token entropy estimate −Σ_t m_t logp_t (CASES.md case 6a).

  Args:
    logp_bt: [B, T] float32 (off-mask values, e.g. sentinels, are never read).
    mask_bt: [B, T] bool.

  Returns:
    [B] float32.
  """
  _check(logp_bt, mask_bt)
  return -jnp.sum(jnp.where(mask_bt, logp_bt, 0.0), -1)
