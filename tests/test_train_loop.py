"""Pieces of the loop: the KL reward penalty applied at generation time."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.rollout import Rollout
from jaxreplay.sampling import generate
from jaxreplay.train.loop import kl_reward_penalty

V = 32


def _rollout():
  cfg = TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  prompts = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]], jnp.int32)
  pmask = prompts > 0
  g = generate(graphdef, params, prompts, pmask, jax.random.key(1), max_new_tokens=5,
               temperature=1.0, eos_ids=(2,), pad_id=0)
  n = 2
  r = Rollout(tokens=jnp.concatenate([prompts, g.tokens], 1),
              attention_mask=jnp.concatenate([pmask, g.mask], 1),
              completion_mask=jnp.concatenate([jnp.zeros_like(pmask), g.mask], 1),
              behaviour_logprobs=jnp.concatenate([jnp.zeros(pmask.shape), g.logprobs], 1),
              rewards=jnp.array([1.0, 0.0]), advantages=jnp.zeros(n),
              group_id=jnp.zeros(n, jnp.int32), policy_version=jnp.zeros(n, jnp.int32),
              truncated=g.truncated)
  return graphdef, params, r


def test_kl_reward_penalty_is_zero_against_itself_and_exact_against_uniform():
  graphdef, params, r = _rollout()
  same = kl_reward_penalty(graphdef, params, r, temperature=1.0, beta=0.5, estimator="k1")
  np.testing.assert_allclose(same, r.rewards, atol=1e-5)
  # A reference whose final norm scale is 0 gives all-zero logits: the uniform policy,
  # log ref = -log V on every token, so k1 summed = Σ_t (log μ_t + log V).
  uniform = jax.tree.map(lambda x: x, params)
  uniform["final_norm"]["scale"] = nnx.Param(jnp.zeros_like(params["final_norm"]["scale"][...]))
  got = kl_reward_penalty(graphdef, uniform, r, temperature=1.0, beta=0.5, estimator="k1")
  mu = np.asarray(r.behaviour_logprobs)
  m = np.asarray(r.completion_mask)
  expected = np.asarray(r.rewards) - 0.5 * np.where(m, mu + math.log(V), 0.0).sum(-1)
  np.testing.assert_allclose(got, expected, atol=1e-5)
  assert m.sum() > 2 and not np.allclose(got, r.rewards)


class _FlakyTask:
  """Reward 1 for "ok", raises for "boom", NaN for "nan", hangs for "hang"."""

  def reward(self, text, example):
    if text == "boom":
      raise RuntimeError("scorer crashed")
    if text == "hang":
      import time
      time.sleep(30)
    return float("nan") if text == "nan" else float(text == "ok")


def test_crashing_hanging_or_nan_rewards_score_zero_and_are_counted():
  import time
  from jaxreplay.train.policy import score
  texts = ["ok", "boom", "no", "hang", "nan", "ok"]
  t0 = time.time()
  rewards, failures = score(_FlakyTask(), texts, [None] * 6, timeout_s=0.5)
  assert time.time() - t0 < 5.0
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 1])
  assert failures == 3
  rewards, failures = score(_FlakyTask(), ["ok", "boom", "nan"], [None] * 3)  # no timeout
  np.testing.assert_array_equal(rewards, [1, 0, 0])
  assert failures == 2
