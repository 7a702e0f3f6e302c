"""Off-policy policy-gradient losses on per-token log-probs.

Shapes: B sequences × T tokens. ``logp`` is log π_θ of each token under the current
policy, ``behaviour_logp`` the stored log μ, ``mask`` the completion mask.
Losses are to be *minimised*.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
LOSSES = ("ppo_clip", "reinforce", "asymre")


def aggregate(loss_bt: jax.Array, mask_bt: jax.Array, mode: str, horizon: int | None = None):
  """Reduces per-token losses to a scalar (CASES.md case 4).

  Modes:
    token_mean: Σ loss·mask / Σ mask (0 when no token is valid).
    seq_mean_token_mean: mean over sequences with ≥1 token of each sequence's token mean.
    seq_mean_token_sum: mean over sequences of Σ_t loss·mask, divided by ``horizon``
      when given (Dr. GRPO's constant normaliser, Liu et al. 2025) — never by the count.

  Args:
    loss_bt: [B, T] float32. mask_bt: [B, T] bool. mode: one of ``AGGREGATIONS``.
    horizon: constant normaliser for ``seq_mean_token_sum`` (e.g. max response length).

  Returns:
    float32 scalar.

  Raises:
    ValueError: unknown ``mode``.
  """
  m = mask_bt.astype(jnp.float32)
  lm = jnp.where(mask_bt, loss_bt, 0.0)
  if mode == "token_mean":
    return lm.sum() / jnp.maximum(m.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    n_t = m.sum(-1)
    per_seq = lm.sum(-1) / jnp.maximum(n_t, 1.0)
    has = (n_t > 0).astype(jnp.float32)
    return (per_seq * has).sum() / jnp.maximum(has.sum(), 1.0)
  if mode == "seq_mean_token_sum":
    out = lm.sum(-1).mean()
    return out / horizon if horizon else out
  raise ValueError(f"algo.aggregation={mode!r} is not one of {AGGREGATIONS}")


def ppo_clip_token_loss(logp_bt, behaviour_logp_bt, adv_b, eps_low: float, eps_high: float):
  """Token-level clipped surrogate (Schulman et al. 2017, PPO eq. 7; DAPO clip-higher).

  loss_t = −min(r_t A, clip(r_t, 1−ε_low, 1+ε_high) A), r_t = exp(logp − behaviour_logp).

  Args:
    logp_bt, behaviour_logp_bt: [B, T] float32. adv_b: [B] float32.
    eps_low, eps_high: clip range.

  Returns:
    (loss [B, T], ratio [B, T], clipped_low [B, T] bool, clipped_high [B, T] bool):
    ``clipped_*`` mark tokens whose gradient the clip removes.
  """
  ratio = jnp.exp(logp_bt - behaviour_logp_bt)
  adv = adv_b[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  loss = -jnp.minimum(unclipped, clipped)
  clipped_low = (adv < 0) & (ratio < 1.0 - eps_low)
  clipped_high = (adv > 0) & (ratio > 1.0 + eps_high)
  return loss, ratio, clipped_low, clipped_high


def reinforce_token_loss(logp_bt, adv_b):
  """On-policy REINFORCE (Williams 1992): loss_t = −A · logp_t. Returns [B, T]."""
  return -adv_b[:, None] * logp_bt


def asymre_token_loss(logp_bt, rewards_b, group_mean_b, delta_v: float):
  """AsymRE (Arnal et al. 2025, arXiv 2506.20520): −(r − (V̂ + δV)) · logp, no ratio.

  Args:
    logp_bt: [B, T]. rewards_b, group_mean_b: [B] reward and its group's mean reward.
    delta_v: baseline shift δV (the paper uses −0.1).

  Returns:
    [B, T] float32.
  """
  return -(rewards_b - (group_mean_b + delta_v))[:, None] * logp_bt


def masked_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Mean of ``x`` over True entries of ``mask`` (0 when none)."""
  m = mask_bt.astype(jnp.float32)
  return jnp.where(mask_bt, x_bt, 0.0).sum() / jnp.maximum(m.sum(), 1.0)


def token_entropy(logits_btv: jax.Array) -> jax.Array:
  """Entropy of each position's distribution, −Σ p log p, [B, T] float32 (nats)."""
  logp = jax.nn.log_softmax(logits_btv, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
