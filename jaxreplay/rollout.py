"""The ``Rollout`` pytree: what the sampler produces, the buffer stores and the loss reads.

N sequences (prompts × group size G), T = P + M total length (P prompt width,
M ``max_new_tokens``). Prompts are left-padded into columns [0, P); completions
occupy [P, P+M), right-padded.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Rollout:
  """A batch of rollouts (leading axis N; in the buffer, leading axis C).

  Attributes:
    tokens: [N, T] int32, prompt (left-padded) then completion (right-padded).
    attention_mask: [N, T] bool, True on real tokens (prompt and completion up to and
      including the stop token).
    completion_mask: [N, T] bool, True on completion tokens the loss sees (EOS kept).
    behaviour_logprobs: [N, T] float32, log μ(token_t | tokens_<t) under the
      distribution the sampler actually sampled from (temperature applied); 0 off-mask.
    rewards: [N] float32 verifiable reward.
    advantages: [N] float32, computed within each group at generation time.
    group_id: [N] int32, prompt identity (unique across the run).
    policy_version: [N] int32, learner step whose weights generated the rollout — the
      oldest, when the weights changed while it was sampled (staleness, the age cut-off and
      the staleness-aware samplers use this one).
    truncated: [N] bool, hit ``max_new_tokens`` without a stop token.
    newest_version: [N] int32, the newest version that sampled one of its tokens
      (= ``policy_version`` unless an in-flight weight update fell inside it).
  """

  tokens: jax.Array
  attention_mask: jax.Array
  completion_mask: jax.Array
  behaviour_logprobs: jax.Array
  rewards: jax.Array
  advantages: jax.Array
  group_id: jax.Array
  policy_version: jax.Array
  truncated: jax.Array
  newest_version: jax.Array

  @property
  def num(self) -> int:
    """N, the number of rollouts."""
    return self.rewards.shape[0]


def empty_rollout(n: int, length: int) -> Rollout:
  """A zero-filled ``Rollout`` of N = ``n`` rows and T = ``length`` columns."""
  return Rollout(
      tokens=jnp.zeros((n, length), jnp.int32),
      attention_mask=jnp.zeros((n, length), bool),
      completion_mask=jnp.zeros((n, length), bool),
      behaviour_logprobs=jnp.zeros((n, length), jnp.float32),
      rewards=jnp.zeros((n,), jnp.float32),
      advantages=jnp.zeros((n,), jnp.float32),
      group_id=jnp.zeros((n,), jnp.int32),
      policy_version=jnp.zeros((n,), jnp.int32),
      truncated=jnp.zeros((n,), bool),
      newest_version=jnp.zeros((n,), jnp.int32),
  )


def completion_lengths(r: Rollout) -> np.ndarray:
  """[N] int completion lengths in tokens (host numpy)."""
  return np.asarray(r.completion_mask).sum(-1)
