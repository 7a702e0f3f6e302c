"""A value head on the policy transformer's final hidden states (for ``algo.advantage='gae'``).

The head is a separate NNX module whose parameters live in ``TrainState.value_params``
and share the policy trunk: ``forward_with_hidden`` runs the transformer once and
returns both the logits and the final-norm hidden states (the value-loss gradient
reaches the trunk, scaled by ``algo.vf_coef``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxreplay.models.transformer import Transformer


class ValueHead(nnx.Module):
  """V(h) = h · w + b, zero-initialised (the critic starts at V = 0).

  Its graph definition does not depend on the width D, so ``value_graphdef()`` is
  static and shared by every model size.
  """

  def __init__(self, d_model: int):
    self.w = nnx.Param(jnp.zeros((d_model,), jnp.float32))
    self.b = nnx.Param(jnp.zeros((), jnp.float32))

  def __call__(self, h_btd: jax.Array) -> jax.Array:
    """[B, T, D] hidden states -> [B, T] float32 values."""
    chex.assert_rank(h_btd, 3)
    return jnp.einsum("btd,d->bt", h_btd.astype(jnp.float32), self.w[...]) + self.b[...]


def value_graphdef() -> nnx.GraphDef:
  """The (width-independent) graph definition of ``ValueHead``."""
  return nnx.graphdef(ValueHead(1))


def init_value_params(d_model: int) -> nnx.State:
  """Zero-initialised value-head parameters for width ``d_model``."""
  return nnx.state(ValueHead(d_model))


def forward_with_hidden(model: Transformer, tokens: jax.Array,
                        mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``model(tokens, mask)`` that also returns the final-norm hidden states.

  Taps ``model.final_norm`` for the duration of one forward pass (restored after), so
  it depends only on the model applying ``final_norm`` once before its output head,
  not on the block internals. Replace with a ``return_hidden`` option once models/
  offers one.

  Args:
    model: the policy. tokens: [B, T] int32. mask: [B, T] bool.

  Returns:
    (logits [B, T, V] float32, hidden [B, T, D]); position t predicts token t+1.

  Raises:
    RuntimeError: the model did not call ``final_norm`` exactly once.
  """
  inner = model.final_norm
  captured = []

  def tap(x):
    y = inner(x)
    captured.append(y)
    return y

  model.final_norm = tap
  try:
    logits = model(tokens, mask)
  finally:
    model.final_norm = inner
  if len(captured) != 1:
    raise RuntimeError(f"model.final_norm was called {len(captured)} times, expected 1")
  return logits, captured[0]


def token_values(head: ValueHead, hidden_btd: jax.Array) -> jax.Array:
  """Per-column values aligned with ``token_logprobs``: column t holds V(tokens_<t).

  Args:
    head: the value head. hidden_btd: [B, T, D] from ``forward_with_hidden``.

  Returns:
    [B, T] float32; column 0 (no prefix) is 0.
  """
  v = head(hidden_btd)
  return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], 1)


def clipped_value_loss(v_bt, v_old_bt, returns_bt, clip_eps: float) -> jax.Array:
  """PPO clipped value loss (Schulman et al. 2017 PPO2 baselines; Ouyang et al. 2022 App. C).

  ½ · max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²), per token.

  Args:
    v_bt: [B, T] current values. v_old_bt: [B, T] values at the start of the update
      (constant). returns_bt: [B, T] GAE targets (constant). clip_eps: ε (≤ 0 = no clip).

  Returns:
    [B, T] float32.
  """
  chex.assert_equal_shape([v_bt, v_old_bt, returns_bt])
  ret = jax.lax.stop_gradient(returns_bt)
  unclipped = (v_bt - ret) ** 2
  if clip_eps <= 0:
    return 0.5 * unclipped
  v_old = jax.lax.stop_gradient(v_old_bt)
  clipped = (v_old + jnp.clip(v_bt - v_old, -clip_eps, clip_eps) - ret) ** 2
  return 0.5 * jnp.maximum(unclipped, clipped)
