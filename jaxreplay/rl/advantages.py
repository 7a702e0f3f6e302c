"""Advantage estimators.

Group-relative estimators (``grpo``, ``dr_grpo``, ``rloo``) run once at generation time
on rewards grouped as [P, G] (P prompts × G completions). ``gae`` is per token and
needs a learned value function, so it runs inside the learner step
(``jaxreplay.rl.objective.gae_advantages``) on the critic's values; at generation time it
stores 0.

Zero-spread convention (CASES.md case 5): a group whose rewards are all equal —
detected exactly with ``max == min``, never through an epsilon — gets advantage exactly
0 under every group estimator, and so does a group of size 1.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxreplay.rl.spec import ESTIMATORS, GROUP_ESTIMATORS  # noqa: F401  (re-exported)


def _zero_spread(r_pg: jax.Array) -> jax.Array:
  """[P, 1] bool: groups whose rewards are all equal (exact test, no epsilon)."""
  return jnp.max(r_pg, -1, keepdims=True) == jnp.min(r_pg, -1, keepdims=True)


def _group_std(r_pg: jax.Array, unbiased: bool) -> jax.Array:
  """[P, 1] population (or G−1) standard deviation, computed from centred values."""
  g = r_pg.shape[-1]
  centred = r_pg - jnp.mean(r_pg, -1, keepdims=True)
  denom = max(g - 1, 1) if unbiased else g
  return jnp.sqrt(jnp.sum(centred ** 2, -1, keepdims=True) / denom)


def group_mean(r_pg: jax.Array) -> jax.Array:
  """V̂ of AsymRE (Arnal et al. 2025, arXiv 2506.20520 §3): each group's mean reward.

  Args:
    r_pg: [P, G] float rewards.

  Returns:
    [P, G] float32, every member holding its group's mean.
  """
  chex.assert_rank(r_pg, 2)
  r = r_pg.astype(jnp.float32)
  return jnp.broadcast_to(jnp.mean(r, -1, keepdims=True), r.shape)


def grpo(r_pg: jax.Array, eps: float = 1e-6, unbiased: bool = False) -> jax.Array:
  """GRPO advantages (Shao et al. 2024, DeepSeekMath arXiv 2402.03300, §4.1.2 outcome supervision).

  A_i = (r_i − mean(r)) / (std(r) + eps) within each group; exactly 0 for a zero-spread
  group or a group of size 1 (module docstring).

  Args:
    r_pg: [P, G] float rewards.
    eps: added to the std (only matters for groups with a real spread).
    unbiased: use the G−1 (sample) standard deviation instead of the population one.

  Returns:
    [P, G] float32 advantages.
  """
  chex.assert_rank(r_pg, 2)
  r = r_pg.astype(jnp.float32)
  centred = r - jnp.mean(r, -1, keepdims=True)
  return jnp.where(_zero_spread(r), 0.0, centred / (_group_std(r, unbiased) + eps))


def dr_grpo(r_pg: jax.Array) -> jax.Array:
  """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783 §3.1).

  A_i = r_i − mean(r): GRPO without the std division.

  Args:
    r_pg: [P, G] float rewards.

  Returns:
    [P, G] float32; exactly 0 for zero-spread groups.
  """
  chex.assert_rank(r_pg, 2)
  r = r_pg.astype(jnp.float32)
  return jnp.where(_zero_spread(r), 0.0, r - jnp.mean(r, -1, keepdims=True))


def rloo(r_pg: jax.Array, std_normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """RLOO advantages (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740 §3.3; Kool et al. 2019).

  A_i = r_i − mean_{j≠i} r_j. With ``std_normalize`` the result is divided by the
  group's population std (+ eps); zero-spread groups still give exactly 0, so a
  floating-point residue never reaches the division (CASES.md case 5e).

  Args:
    r_pg: [P, G] float rewards; a group of size 1 gives 0.
    std_normalize: divide by the group std.
    eps: added to the std.

  Returns:
    [P, G] float32; exactly 0 for zero-spread groups.
  """
  chex.assert_rank(r_pg, 2)
  r = r_pg.astype(jnp.float32)
  g = r.shape[-1]
  if g == 1:
    return jnp.zeros_like(r)
  adv = r - (jnp.sum(r, -1, keepdims=True) - r) / (g - 1)
  if std_normalize:
    adv = adv / (_group_std(r, False) + eps)
  return jnp.where(_zero_spread(r), 0.0, adv)


def compute_advantages(r_pg: jax.Array, estimator: str, *, eps: float = 1e-6,
                       unbiased_std: bool = False, rloo_std: bool = False) -> jax.Array:
  """Sequence-level advantages stored with each rollout at generation time.

  Args:
    r_pg: [P, G] float rewards.
    estimator: one of ``ESTIMATORS``. ``"gae"`` returns zeros: its
      per-token advantages come from the value head in the learner step.
    eps: std epsilon (``grpo``, ``rloo`` with ``rloo_std``).
    unbiased_std: ``grpo`` divides by the G−1 std.
    rloo_std: ``rloo`` also divides by the group std.

  Returns:
    [P, G] float32.

  Raises:
    ValueError: unknown ``estimator`` (lists the valid ones).
  """
  if estimator == "grpo":
    return grpo(r_pg, eps=eps, unbiased=unbiased_std)
  if estimator == "dr_grpo":
    return dr_grpo(r_pg)
  if estimator == "rloo":
    return rloo(r_pg, std_normalize=rloo_std, eps=eps)
  if estimator == "gae":
    chex.assert_rank(r_pg, 2)
    return jnp.zeros(r_pg.shape, jnp.float32)
  raise ValueError(f"estimator={estimator!r} is not one of {ESTIMATORS}")


def terminal_rewards(rewards_b: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Places each sequence's reward on its last completion token (outcome reward).

  Args:
    rewards_b: [B] float. mask_bt: [B, T] bool completion mask (contiguous per row).

  Returns:
    [B, T] float32, zero everywhere except the last True column of each row (a row
    with no True column gets no reward).
  """
  chex.assert_rank([rewards_b, mask_bt], [1, 2])
  chex.assert_equal_shape_prefix([rewards_b, mask_bt], 1)
  t = mask_bt.shape[1]
  col = jnp.arange(t)[None, :]
  last = jnp.max(jnp.where(mask_bt, col, -1), axis=1, keepdims=True)
  return jnp.where(col == last, rewards_b.astype(jnp.float32)[:, None], 0.0)


def gae(rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over tokens (Schulman et al. 2016, arXiv 1506.02438 eq. 16).

  On the completion tokens of each row (the mask must be contiguous), with
  V_{T_end+1} = 0 after the last token:
    δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},   R_t = A_t + V_t.

  Args:
    rewards_bt: [B, T] float per-token rewards (e.g. ``terminal_rewards`` minus a KL
      penalty). values_bt: [B, T] float V(s_t), the value of the state in which token t
      is chosen. mask_bt: [B, T] bool completion mask.
    gamma, lam: discount γ and GAE λ in [0, 1].

  Returns:
    (advantages [B, T] float32, returns [B, T] float32), both 0 off the mask.
  """
  chex.assert_rank([rewards_bt, values_bt, mask_bt], 2)
  chex.assert_equal_shape([rewards_bt, values_bt, mask_bt])
  m = mask_bt.astype(jnp.float32)
  r = rewards_bt.astype(jnp.float32) * m
  v = values_bt.astype(jnp.float32) * m
  # Next column's value/mask (0 past the end); the mask is contiguous, so "next is
  # valid" means "t is not the last token".
  v_next = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], 1)
  m_next = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], 1)
  delta = (r + gamma * v_next * m_next - v) * m

  def step(carry, x):
    d_b, mn_b = x
    a = d_b + gamma * lam * mn_b * carry
    return a, a

  _, adv_tb = jax.lax.scan(step, jnp.zeros_like(r[:, 0]), (delta.T, m_next.T), reverse=True)
  adv = adv_tb.T * m
  return adv, (adv + v) * m
