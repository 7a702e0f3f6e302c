"""Pieces of the loop: the KL reward penalty applied at generation time."""

import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import logprob_tol
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.rollout import Rollout
from jaxreplay.sampling import generate
from jaxreplay.train.generation import kl_reward_penalty

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
              group_id=jnp.zeros(n, jnp.int32), policy_version=jnp.zeros(n, jnp.int32), newest_version=jnp.zeros(n, jnp.int32),
              truncated=g.truncated)
  return graphdef, params, r


@pytest.mark.numerics
def test_kl_reward_penalty_is_zero_against_itself_and_exact_against_uniform():
  graphdef, params, r = _rollout()
  same = kl_reward_penalty(graphdef, params, r, temperature=1.0, beta=0.5, estimator="k1")
  # β·Σ_t (μ_t − ref_t): the sampler's and the learner's log-probs, each token within
  # conftest.logprob_tol
  model = nnx.merge(graphdef, params)
  logp_atol = logprob_tol(model.cfg, model(r.tokens, r.attention_mask))
  n_tok = int(np.asarray(r.completion_mask).sum(-1).max())
  np.testing.assert_allclose(same, r.rewards, rtol=0, atol=0.5 * n_tok * logp_atol)
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
  """Reward 1 for "ok", raises for "boom", NaN for "nan"; "hang" blocks until ``release``
  is set (at most 60 s) and then sets ``hung_done``."""

  def __init__(self):
    self.release, self.hung_done = threading.Event(), threading.Event()

  def reward(self, text, example):
    if text == "boom":
      raise RuntimeError("scorer crashed")
    if text == "hang":
      self.release.wait(60)
      self.hung_done.set()
    return float("nan") if text == "nan" else float(text == "ok")


def test_crashing_hanging_or_nan_rewards_score_zero_and_are_counted():
  from jaxreplay.train.policy import score
  task = _FlakyTask()
  texts = ["ok", "boom", "no", "hang", "nan", "ok"]
  try:
    rewards, failures = score(task, texts, [None] * 6, timeout_s=2.0)
    # scoring went on past the hanging call, which is still blocked
    assert not task.hung_done.is_set()
  finally:
    task.release.set()
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 1])
  assert failures == 3
  rewards, failures = score(task, ["ok", "boom", "nan"], [None] * 3)  # no timeout
  np.testing.assert_array_equal(rewards, [1, 0, 0])
  assert failures == 2


def test_simulated_async_generates_with_the_version_lag_steps_ago():
  from jaxreplay.train.lagged import advance_ring, behaviour_params, behaviour_version
  assert [behaviour_version(t, lag=2) for t in range(5)] == [0, 0, 0, 1, 2]
  assert [behaviour_version(t, lag=0) for t in range(3)] == [0, 1, 2]  # sync is lag 0
  assert behaviour_params(("oldest", "newer"), "current") == "oldest"
  assert behaviour_params((), "current") == "current"  # lag 0 is sync
  ring = advance_ring((jnp.zeros(1), jnp.ones(1)), jnp.full(1, 2.0))
  assert [float(x[0]) for x in ring] == [1.0, 2.0]
  assert advance_ring((), jnp.zeros(1)) == ()


def test_async_generator_inserts_within_the_limiter_and_stops_when_blocked():
  """A fake producer (no model): the thread fills the buffer only as far as the rate
  limiter allows (ρ·I − S <= offset + e), then blocks, and ``stop`` joins it."""
  from jaxreplay import replay
  from jaxreplay.replay import rate_limiter as rate_lib
  from jaxreplay.rollout import empty_rollout
  from jaxreplay.train.actor_learner import AsyncGenerator
  from jaxreplay.train.generation import Generation
  from jaxreplay.train.learner import make_inserter
  from jaxreplay.train.ledger import Ledger
  r, b = 4, 8
  lim = rate_lib.RateLimiter(samples_per_insert=2.0, min_size_to_sample=b, error_buffer=16.0)

  def produce(params, ref, version, position, key):
    ro = empty_rollout(r, 3).replace(completion_mask=jnp.ones((r, 3), bool),
                                     policy_version=jnp.full((r,), version, jnp.int32))
    return ro, Generation(Ledger(generated_rollouts=r), {"reward": 1.0}, position + r // 2)

  gen = AsyncGenerator(produce=produce, insert=make_inserter(replay.make_replay_buffer(32, b), r), limiter=lim,
                       limiter_state=rate_lib.init(), buffer=replay.init(empty_rollout(1, 3), 32),
                       position=0, params={"w": jnp.zeros(2)}, ref_params=None, version=0,
                       insert_size=r, sample_size=b, key=jax.random.key(0), timeout_s=120.0,
                       learner_step=0).start()
  try:
    with gen.cond:
      gen.wait_for_sample()
      # the thread found the limiter closed and waits: it inserts nothing more until a sample
      assert gen.cond.wait_for(lambda: gen.waiting_to_insert, timeout=120)
      # offset = 2·8 = 16, e = 16: inserts stop once 2·I > 32, i.e. at I = 16 (4 chunks)
      assert int(gen.limiter_state.inserted) == 16 and int(gen.buffer.size) == 16
      assert gen.take()[1] == Ledger(generated_rollouts=16)  # nothing overwritten unused
      assert gen.position == 8  # 4 chunks of 2 prompts
  finally:
    assert gen.stop(timeout_s=120.0)


def test_ready_needs_b_items_within_the_age_cutoff_for_every_sampler():
  """Recency draws with replacement (one eligible item would do for replay.can_sample),
  yet the learner waits for B = 4 items within max_staleness = 2 of its version."""
  from jaxreplay import replay
  from jaxreplay.rollout import empty_rollout
  from jaxreplay.train.learner import make_ready
  buf = replay.init(empty_rollout(1, 3), 8, evicts=True)
  buf = replay.add(buf, empty_rollout(4, 3), jnp.zeros(4, jnp.int32), jnp.int32(0))
  buf = replay.add(buf, empty_rollout(1, 3), jnp.full(1, 5, jnp.int32), jnp.int32(5))
  for sampler in ("recency", "uniform"):
    ready = make_ready(replay.make_replay_buffer(
        8, 4, replay.SamplerConfig(sampler=sampler, max_staleness=2)))
    assert not bool(ready(buf, jnp.int32(5)))  # 4 items are 5 versions old: 1 drawable
    assert bool(ready(buf, jnp.int32(2)))  # at version 2 all 5 are within the cut-off
  assert not bool(make_ready(replay.make_replay_buffer(8, 6))(buf, jnp.int32(0)))  # 5 < B = 6
