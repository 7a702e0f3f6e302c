"""Compute accounting: FLOP formulas, μ, emulated W/T and γ, and the eviction ledger,
against hand-computed numbers."""

import math
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay import replay, theory
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import empty_rollout
from jaxreplay.train import accounting as A
from jaxreplay.train.learner import make_learner_step

COST = A.ModelCost(n_params=100, n_layers=2, n_heads=3, head_dim=4)  # 4·L·H·Dh = 96


def test_flops_by_hand():
  # Σ_{c=1}^{5} (2·100 + 96c) = 1000 + 96·15 = 2440
  assert A.forward_flops_causal(COST, 5) == 2440.0
  assert A.generation_flops(COST, 3, 3) == 2440.0  # positions 1 .. P+m−1 = 5
  # 3 × Σ_{c=1}^{6} (200 + 96c) = 3 × (1200 + 2016) = 9648; two epochs double it
  assert A.training_flops(COST, 3, 3) == 9648.0
  assert A.training_flops(COST, 3, 3, epochs=2) == 19296.0
  np.testing.assert_allclose(A.generation_flops(COST, 3, np.array([1, 3])), [
      sum(200 + 96 * c for c in range(1, 4)), 2440.0])
  got = jax.jit(lambda m: A.training_flops(COST, 3, m))(jnp.array([3, 0]))
  np.testing.assert_allclose(got, [9648.0, 3 * sum(200 + 96 * c for c in range(1, 4))])
  # a scoring pass is one forward over all P + m = 6 tokens: Σ_{c=1}^{6} (200 + 96c) = 3216
  assert A.generation_flops(COST, 3, 3, forwards=1) == 2440.0 + 3216.0
  assert A.training_flops(COST, 3, 3, forwards=1) == 4 * 3216.0
  assert A.training_flops(COST, 3, 3, epochs=2, forwards=2) == 8 * 3216.0
  assert A.design_mu(COST, 3, 3) == 2440.0 / 9648.0
  assert A.design_mu(COST, 3, 3, generation_forwards=1, training_forwards=1) == (
      5656.0 / 12864.0)


TINY = TransformerConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
                         head_dim=4, d_ff=12)


def test_mu_flops_of_a_tiny_decoder_by_hand():
  """N from the model's own parameters, then μ for a 5-token prompt and 3 sampled tokens."""
  params = nnx.split(nnx.eval_shape(lambda: Transformer(TINY, nnx.Rngs(0))), nnx.Param)[1]
  cost = A.ModelCost.from_params(params, TINY)
  # tied embedding V·D = 128 (the output projection); q, o: D·H·E = 64 each; k, v:
  # D·K·E = 32 each; SwiGLU 3·D·F = 288; two block RMSNorms and the final one 3·D = 24
  assert cost == A.ModelCost(n_params=128 + 64 + 64 + 32 + 32 + 288 + 24, n_layers=1,
                             n_heads=2, head_dim=4)
  # forward over S tokens: 2·632·S + 2·L·H·E·S(S+1) = 1264·S + 16·S(S+1)
  gen = 1264 * 7 + 16 * 7 * 8  # sampling: positions 1 .. P + m − 1 = 7  -> 9744
  fwd8 = 1264 * 8 + 16 * 8 * 9  # one pass over P + m = 8 tokens         -> 11264
  assert A.generation_flops(cost, 5, 3) == gen == 9744
  assert A.training_flops(cost, 5, 3) == 3 * fwd8 == 33792
  assert A.design_mu(cost, 5, 3) == pytest.approx(9744 / 33792)  # 0.2884
  # the learner's rescoring of the behaviour log-probs, and a reference for a KL term
  assert A.design_mu(cost, 5, 3, generation_forwards=1, training_forwards=1) == (
      pytest.approx((9744 + 11264) / (4 * 11264)))  # 0.4663
  # the ledger's μ of 4 such rollouts, each trained on twice, is the same number
  led = {"generated_rollouts": 4, "trained_samples": 8, "generation_flops": 4.0 * gen,
         "training_flops": 8.0 * 3 * fwd8}
  assert A.summarize(led, {"generate_s": 1.0, "train_s": 1.0})["mu_flops"] == (
      pytest.approx(9744 / 33792))


@pytest.mark.parametrize("fields, passes", [
    ({}, 0),
    ({"kl_coef": 0.1}, 1),  # the frozen reference's log-probs
    ({"loss": "decoupled", "update_epochs": 2}, 1),  # the proximal policy's log-probs
    ({"loss": "decoupled"}, 0),  # one optimizer step: the behaviour log-probs serve
    ({"loss": "decoupled", "num_minibatches": 2, "kl_coef": 0.1}, 2),
    ({"advantage": "gae"}, 0),
    ({"advantage": "gae", "update_epochs": 2}, 1),  # start values
    ({"advantage": "gae", "grad_accum_steps": 2}, 1),  # the minibatch's values before GAE
    ({"advantage": "gae", "update_epochs": 2, "grad_accum_steps": 2}, 3),
])
def test_learner_forwards_follow_the_train_step(fields, passes):
  assert A.learner_forwards(AlgoSpec(**fields)) == passes


class _Step(NamedTuple):
  """The one field of a train state the learner step's draw reads."""

  step: jax.Array


def test_learner_step_counts_the_real_tokens_of_each_drawn_item():
  """Training FLOPs follow each item's real prompt and completion tokens, not the padded
  width: rows with 1, 2 and 3 prompt tokens (width 4) and 2, 1 and 3 completion tokens."""
  prompt, completion, width = [1, 2, 3], [2, 1, 3], 7
  pos = np.arange(width)[None, :]
  p, m = np.asarray(prompt)[:, None], np.asarray(completion)[:, None]
  attn = (pos >= 4 - p) & (pos < 4 + m)
  rows = empty_rollout(3, width).replace(attention_mask=jnp.asarray(attn),
                                         completion_mask=jnp.asarray(attn & (pos >= 4)))
  rb = replay.make_replay_buffer(3, 3)
  buf = replay.add(replay.init(empty_rollout(1, width), 3), rows, jnp.zeros(3, jnp.int32), 0)
  step = make_learner_step(lambda st, *a, **k: (st, {}), rb, cost=COST, epochs=2, forwards=1)
  _, _, metrics = step(_Step(jnp.int32(0)), buf, jax.random.key(0))  # draws all three
  want = sum(A.training_flops(COST, pi, mi, epochs=2, forwards=1)
             for pi, mi in zip(prompt, completion))
  assert float(metrics["training_flops"]) == pytest.approx(want)
  assert int(metrics["trained_tokens"]) == sum(completion)


def test_model_cost_counts_the_untied_embedding_out():
  params = {"embed": jnp.zeros((10, 4)), "w": jnp.zeros((4, 5)), "head": jnp.zeros((4, 10))}
  cfg = types.SimpleNamespace(vocab_size=10, d_model=4, n_layers=1, n_heads=2, head_dim=2,
                              tie_embeddings=False)
  assert A.ModelCost.from_params(params, cfg).n_params == 40 + 20 + 40 - 40
  cfg.tie_embeddings = True
  assert A.ModelCost.from_params(params, cfg).n_params == 100


def test_mu_w_over_t_gamma_by_hand():
  # 10 units for 2 rollouts (5 each) over 30 units for 6 sequences (5 each): μ = 1
  assert A.mu(10.0, 2, 30.0, 6) == 1.0
  assert math.isnan(A.mu(10.0, 0, 30.0, 6)) and math.isnan(A.mu(1.0, 2, 0.0, 6))
  # μ = 3, ρ = B/R = 2: W/T = 1.5, γ = 2.5 / 4 = (B + μR)/(B(1 + μ)) with B=2, R=1
  assert A.emulated_w_over_t(3.0, 2.0) == 1.5
  assert A.gamma(3.0, 2.0) == pytest.approx(0.625)
  assert A.gamma(3.0, 2.0) == pytest.approx((2 + 3 * 1) / (2 * (1 + 3)))
  # on-policy (ρ = 1) costs exactly the no-buffer update: γ = 1; the paper's Table 1 row
  assert A.gamma(5.28, 1.0) == pytest.approx(1.0)
  # (W, T) = (5, 3), μ = 5.28: paper Table 1 prints 0.43 (8/3 / 6.28 = 0.4246)
  assert A.gamma(5.28, 5.28 * 3 / 5) == pytest.approx(theory.compute_ratio(5 / 3, 5.28))
  assert A.gamma(5.28, 5.28 * 3 / 5) == pytest.approx(0.4246, abs=1e-4)
  s = A.summarize({"generated_rollouts": 4, "trained_samples": 8, "generation_flops": 12.0,
                   "training_flops": 16.0}, {"generate_s": 8.0, "train_s": 2.0})
  # FLOPs: (12/4)/(16/8) = 1.5; time: (8/4)/(2/8) = 8; ρ = 2
  assert s["replay_ratio"] == 2.0
  assert s["mu_flops"] == 1.5 and s["w_over_t_flops"] == 0.75
  assert s["gamma_flops"] == pytest.approx(1.75 / 2.5)
  assert s["mu_time"] == 8.0 and s["gamma_time"] == pytest.approx(5.0 / 9.0)


def _rows(lengths, width=6):
  r = empty_rollout(len(lengths), width)
  m = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
  return r.replace(completion_mask=jnp.asarray(m))


@pytest.mark.parametrize("jit", [False, True])
def test_unused_overwritten_and_unused_in_buffer(jit):
  lost_fn = jax.jit(A.unused_overwritten, static_argnums=1) if jit else A.unused_overwritten
  s = replay.init(empty_rollout(1, 6), 4)
  s = replay.add(s, _rows([1, 2, 3, 4]), jnp.zeros(4, jnp.int32), 0)
  # slots 0 and 2 were sampled; the next add of 3 writes slots 0, 1, 2
  s = replay.set_columns(s, times_sampled=s.times_sampled.at[jnp.array([0, 2])].set(1))
  n, toks = lost_fn(s, 3)
  assert (int(n), int(toks)) == (1, 2)  # only slot 1 (2 tokens) is lost unused
  n, toks = A.unused_in_buffer(s)
  assert (int(n), int(toks)) == (2, 2 + 4)
  s = replay.add(s, _rows([5, 5, 5]), jnp.ones(3, jnp.int32), 1)  # write_index = 3 now
  n, toks = lost_fn(s, 2)  # slots 3 (4 tokens, unused) and 0 (new, unused)
  assert (int(n), int(toks)) == (2, 9)
  empty = replay.init(empty_rollout(1, 6), 4)
  assert tuple(int(x) for x in lost_fn(empty, 4)) == (0, 0)
