"""Group-relative advantage estimators, computed once at generation time.

Rewards arrive grouped: [P, G] for P prompts with G completions each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _zero_spread(r_pg: jax.Array) -> jax.Array:
  """[P, 1] bool: groups whose rewards are all equal (exact test, no epsilon)."""
  return (jnp.max(r_pg, -1, keepdims=True) == jnp.min(r_pg, -1, keepdims=True))


def grpo(r_pg: jax.Array, eps: float = 1e-6, unbiased: bool = False) -> jax.Array:
  """GRPO advantages (Shao et al. 2024, DeepSeekMath eq. 3 with outcome reward).

  A_i = (r_i − mean(r)) / (std(r) + eps) within each group. A group whose rewards
  are all equal gets exactly 0 (detected by max == min, not by the epsilon;
  CASES.md case 5), as does a group of size 1.

  Args:
    r_pg: [P, G] float32 rewards.
    eps: added to the std.
    unbiased: use the G−1 (sample) standard deviation instead of the population one.

  Returns:
    [P, G] float32 advantages.
  """
  r = r_pg.astype(jnp.float32)
  g = r.shape[-1]
  centred = r - jnp.mean(r, -1, keepdims=True)
  denom = max(g - 1, 1) if unbiased else g
  std = jnp.sqrt(jnp.sum(centred ** 2, -1, keepdims=True) / denom)
  return jnp.where(_zero_spread(r), 0.0, centred / (std + eps))


def dr_grpo(r_pg: jax.Array) -> jax.Array:
  """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero", eq. 2): r_i − mean(r).

  Args:
    r_pg: [P, G] float32 rewards.

  Returns:
    [P, G] float32; exactly 0 for groups with equal rewards.
  """
  r = r_pg.astype(jnp.float32)
  return jnp.where(_zero_spread(r), 0.0, r - jnp.mean(r, -1, keepdims=True))


def rloo(r_pg: jax.Array) -> jax.Array:
  """RLOO advantages (Ahmadian et al. 2024, eq. 5): r_i − mean_{j≠i} r_j.

  Args:
    r_pg: [P, G] float32 rewards (G >= 2; a group of size 1 gives 0).

  Returns:
    [P, G] float32; exactly 0 for groups with equal rewards.
  """
  r = r_pg.astype(jnp.float32)
  g = r.shape[-1]
  if g == 1:
    return jnp.zeros_like(r)
  loo = (jnp.sum(r, -1, keepdims=True) - r) / (g - 1)
  return jnp.where(_zero_spread(r), 0.0, r - loo)


def compute_advantages(r_pg: jax.Array, estimator: str) -> jax.Array:
  """Dispatches to ``grpo``, ``dr_grpo`` or ``rloo`` by name.

  Raises:
    ValueError: unknown ``estimator`` (lists the valid ones).
  """
  if estimator == "grpo":
    return grpo(r_pg)
  if estimator == "dr_grpo":
    return dr_grpo(r_pg)
  if estimator == "rloo":
    return rloo(r_pg)
  raise ValueError(f"algo.advantage={estimator!r} is not one of {ESTIMATORS}")
