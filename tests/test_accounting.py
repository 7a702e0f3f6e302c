"""Compute accounting: FLOP formulas, μ, emulated W/T and γ, and the eviction ledger,
against hand-computed numbers."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay, theory
from jaxreplay.rollout import empty_rollout
from jaxreplay.train import accounting as A

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
