"""Issue 27 library: the noise-constant estimators (``rl.noise``), the bounded solver
(``theory.power_law_design_bounded``) and the self-tuning controller (``replay.auto``).

Synthetic recovery: per-sample gradient errors drawn with σ(s) = σ1·s^α and the paper's
correlation corr(ε_i, ε_j) = ρ|t_i − t_j|/N (Arnal et al. 2026 §4, as equalities), plus a
common true gradient the estimator does not know, projected on k = 128 Gaussian directions.
"""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

from conftest import forward_terms, reorder_tol
from jaxreplay import replay, theory
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.replay import auto
from jaxreplay.rl import noise as nz
from jaxreplay.rollout import empty_rollout
from jaxreplay.spec import ConfigError

# --------------------------------------------------------------------------- synthetic

X, R = 20, 8                       # horizon (ages 0..19) and items per step: N = 160
AGES = np.repeat(np.arange(X), R)
N = len(AGES)
D, K, SNAPSHOTS = 1024, 128, 32    # gradient dim, projections, estimates averaged
EDGES = tuple(range(X))            # one bucket per age


def _snapshots(alpha, rho, seed, center="mean"):
  """SNAPSHOTS estimates, each on fresh errors, a fresh projection and the same true grad."""
  rng = np.random.default_rng(seed)
  chol = np.linalg.cholesky(nz.synthetic_covariance(AGES, alpha, rho, N, sigma1=0.3))
  true_grad = rng.standard_normal(D) * 5.0 / np.sqrt(D)  # |∇F| ≈ 5 ≫ σ
  eps = chol @ (rng.standard_normal((SNAPSHOTS, N, D)) / np.sqrt(D))
  proj = rng.standard_normal((SNAPSHOTS, K, D)) / np.sqrt(K)
  g = (eps + true_grad) @ proj.transpose(0, 2, 1)
  ref = proj @ true_grad
  return _batched(center)(jnp.asarray(g, jnp.float32), jnp.asarray(ref, jnp.float32))


@functools.cache
def _batched(center):
  """``estimate_noise`` vmapped over snapshots, compiled once per ``center``."""
  fn = lambda gi, ri: nz.estimate_noise(gi, AGES, num_items=N, edges=EDGES, center=center,
                                        reference=ri if center == "reference" else None)
  return jax.jit(jax.vmap(fn))


@pytest.mark.parametrize("alpha", [0.1, 0.25, 0.4])
@pytest.mark.parametrize("rho", [0.05, 0.2])
def test_recovers_known_alpha_and_rho(alpha, rho):
  est = _snapshots(alpha, rho, seed=0)
  a_hat, r_hat = float(np.mean(est.alpha)), float(np.mean(est.rho))
  print(f"alpha={alpha} rho={rho}: alpha_hat={a_hat:.4f} rho_hat={r_hat:.4f} "
        f"(one snapshot: sd {np.std(est.alpha):.4f}/{np.std(est.rho):.4f}, jackknife se "
        f"{np.mean(est.alpha_se):.4f}/{np.mean(est.rho_se):.4f})")
  assert abs(a_hat / alpha - 1) < 0.25
  assert abs(r_hat / rho - 1) < 0.25
  # σ²(s) per bucket: the truth is 0.09·s^{2α} (0.09 at s = 0, σ_fresh = σ1).
  truth = 0.09 * np.maximum(np.arange(X), 1.0) ** (2 * alpha)
  np.testing.assert_allclose(np.mean(est.sigma2, 0), truth, rtol=0.05)
  np.testing.assert_allclose(np.mean(est.age, 0), np.arange(X), rtol=1e-6)
  assert np.all(np.asarray(est.count) == R)
  np.testing.assert_allclose(float(np.mean(est.log_sigma1)), math.log(0.3), atol=0.03)
  # the jackknife SE of one estimate is conservative: between 0.7× and 3.5× the
  # snapshot-to-snapshot spread (the delete-group jackknife overstates pair statistics)
  for se, val in ((est.alpha_se, est.alpha), (est.rho_se, est.rho)):
    assert 0.7 < float(np.mean(se)) / float(np.std(val)) < 3.5


@pytest.mark.parametrize("center", ["fresh", "reference"])
def test_other_references_recover_the_same_constants(center):
  est = _snapshots(0.25, 0.2, seed=1, center=center)
  assert abs(float(np.mean(est.alpha)) / 0.25 - 1) < 0.25
  assert abs(float(np.mean(est.rho)) / 0.2 - 1) < 0.25


def test_uncorrelated_errors_give_rho_near_zero_and_centering_leaves_no_bias():
  """ρ = 0: the buffer-mean centring induces corr −1/(n−1) between all pairs; the moment
  equations model it, so ρ̂ stays at 0 (a naive Gram would not)."""
  est = _snapshots(0.25, 0.0, seed=2)
  assert abs(float(np.mean(est.rho))) < 0.02


def test_estimator_edge_cases():
  rng = np.random.default_rng(0)
  g = rng.standard_normal((16, 8)).astype(np.float32)
  one_age = nz.estimate_noise(g, np.full(16, 3), num_items=16, edges=(0, 2, 4), jackknife=0)
  assert np.isnan(float(one_age.rho)) and np.isnan(float(one_age.alpha))  # nothing to fit
  np.testing.assert_array_equal(np.asarray(one_age.count), [0, 16, 0])
  assert np.isnan(float(one_age.sigma2[0])) and float(one_age.sigma2[1]) > 0
  no_fresh = nz.estimate_noise(g, np.arange(16) % 4 + 1, num_items=16, center="fresh",
                               jackknife=0)
  assert np.isnan(float(no_fresh.alpha))
  with pytest.raises(ValueError, match="center"):
    nz.estimate_noise(g, np.arange(16), num_items=16, center="median")
  with pytest.raises(ValueError, match="reference"):
    nz.estimate_noise(g, np.arange(16), num_items=16, center="reference")
  with pytest.raises(ValueError, match="positive definite"):
    nz.synthetic_covariance(np.repeat(np.arange(64), 2), 0.25, 1.0, 128)
  m = nz.metrics(one_age, (0, 2, 4))
  assert m["noise/count_s2-3"] == 16.0 and "noise/sigma2_s0-1" not in m


# --------------------------------------------------------------------------- tiny model


KEY = jax.random.split(jax.random.key(3))[1]  # what make_buffer_noise_fn(key(3)) projects with
KP = 256


@pytest.fixture(scope="module")
def tiny():
  """A one-layer policy, 24 rollouts of ages 0..5 and their jvp-projected gradients."""
  cfg = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(1)
  n, t = 24, 8
  comp = jnp.asarray(np.arange(t)[None] >= 3).repeat(n, 0)
  mu = jnp.where(comp, jnp.asarray(rng.normal(-np.log(16), 0.1, (n, t)), jnp.float32), 0.0)
  items = empty_rollout(n, t).replace(
      tokens=jnp.asarray(rng.integers(3, 16, (n, t)), jnp.int32),
      attention_mask=jnp.ones((n, t), bool), completion_mask=comp, behaviour_logprobs=mu,
      advantages=jnp.asarray(rng.normal(0, 1, n), jnp.float32),
      rewards=jnp.asarray(rng.random(n), jnp.float32))
  ages = jnp.asarray(np.arange(n) % 6, jnp.int32)
  loss_vec = nz.per_item_loss_fn(graphdef, {}, 1.0)
  jvp = jax.jit(lambda p: nz.projected_grads(lambda q: loss_vec(q, items, ages), p, KEY, KP))(
      params)
  return graphdef, params, items, ages, loss_vec, jvp


@pytest.mark.slow
@pytest.mark.numerics
def test_projected_grads_are_the_projection_of_exact_per_sample_grads_and_estimates_agree(tiny):
  graphdef, params, items, ages, loss_vec, jvp = tiny
  n, k = ages.shape[0], KP
  single = lambda p, item, age: loss_vec(p, jax.tree.map(lambda x: x[None], item), age[None])[0]

  @jax.jit
  def exact_and_projection():
    g = jax.vmap(lambda it, a: ravel_pytree(jax.grad(single)(params, it, a))[0])(items, ages)
    p = jax.vmap(lambda d: ravel_pytree(nz.projection_direction(params, KEY, d, k))[0])(
        jnp.arange(k))
    return g, p

  exact, proj = exact_and_projection()
  assert exact.shape == (n, proj.shape[1]) and proj.shape[1] > 2000  # D parameters
  assert int((jnp.linalg.norm(exact, axis=1) > 0).sum()) >= n - 2  # (PPO-clipped items: 0)
  # Forward mode against reverse mode, then a dot over the D parameters: the gradient's
  # chain (there and back, 8 positions) plus D terms, Σ|g·p| ≤ ‖g‖·‖p‖ (Cauchy–Schwarz)
  cfg = nnx.merge(graphdef, params).cfg
  n = 2 * forward_terms(cfg, items.tokens.shape[1]) + items.tokens.shape[1] + proj.shape[1]
  scale = float(jnp.linalg.norm(exact, axis=1).max() * jnp.linalg.norm(proj, axis=1).max())
  np.testing.assert_allclose(np.asarray(jvp), np.asarray(exact @ proj.T), rtol=0,
                             atol=reorder_tol(n, scale=scale))
  edges = (0, 1, 2, 3, 4, 5)
  # one compile for both: zero columns leave every inner product unchanged
  both = jnp.stack([exact, jnp.pad(jvp, ((0, 0), (0, exact.shape[1] - k)))])
  est = jax.vmap(lambda g: nz.estimate_noise(g, ages, num_items=n, edges=edges))(both)
  e_exact, e_proj = (jax.tree.map(lambda x: x[i], est) for i in (0, 1))
  rel = np.abs(np.asarray(e_proj.sigma2) / np.asarray(e_exact.sigma2) - 1)
  print(f"exact vs projected (k={k}): sigma2 rel err max {rel.max():.3f} mean {rel.mean():.3f};"
        f" alpha {float(e_exact.alpha):.4f} vs {float(e_proj.alpha):.4f} (se "
        f"{float(e_exact.alpha_se):.4f}); rho {float(e_exact.rho):.4f} vs "
        f"{float(e_proj.rho):.4f} (se {float(e_exact.rho_se):.4f})")
  assert rel.max() < 0.2  # √(2/k) ≈ 0.09 per item, 4 items per bucket
  # the projection moves α and ρ by less than half their own sampling spread
  assert abs(float(e_proj.alpha) - float(e_exact.alpha)) < 0.5 * float(e_exact.alpha_se)
  assert abs(float(e_proj.rho) - float(e_exact.rho)) < 0.5 * float(e_exact.rho_se)


@pytest.mark.slow
def test_noise_fn_on_a_buffer_scores_the_buffer_items(tiny):
  graphdef, params, items, ages, _, jvp = tiny
  n, edges = ages.shape[0], (0, 1, 2, 3, 4, 5)
  # k = 64: direction d is the same draw for any k, scaled 1/√k, so these projections are
  # the fixture's first 64 columns times √(256/64) = 2
  bnoise = nz.make_buffer_noise_fn(graphdef, {}, 1.0, num_samples=32, num_projections=64,
                                   edges=edges, jackknife=0, rows=10)  # 4 chunks of 10, 8 padded
  # all n items drawn (S = C = 32 > n), ages = 10 − version, N = the valid count
  buf = replay.add(replay.init(empty_rollout(1, 8), 32), items,
                   jnp.asarray(10 - np.asarray(ages), jnp.int32), 0)
  got = bnoise(params, buf, jax.random.key(3), jnp.int32(10))
  want = nz.estimate_noise(2.0 * jvp[:, :64], ages, num_items=n, edges=edges, jackknife=0)
  assert int(got.num_items) == n and np.asarray(got.count).tolist() == [4] * 6
  # the draw permutes the items; the point estimates are permutation-invariant
  np.testing.assert_allclose(np.asarray(got.sigma2), np.asarray(want.sigma2), rtol=1e-3)
  np.testing.assert_allclose(float(got.alpha), float(want.alpha), rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(float(got.rho), float(want.rho), rtol=1e-3, atol=1e-4)
  assert np.all(np.asarray(want.sigma2) > 0) and np.isnan(float(got.alpha_se))  # no jackknife


# --------------------------------------------------------------------------- solver, controller


def test_bounded_solver_is_the_closed_form_inside_the_box_and_the_box_optimum_outside():
  for mu, rho, alpha, x, y in ((5.28, 0.1, 0.25, 2.43, 3.21), (5.28, 0.1, 0.1, 14.3, 5.58),
                               (6.84, 0.05, 0.1, 24.2, 8.65)):  # NOTES.md §4 examples (rounded)
    xb, yb = theory.power_law_design_bounded(mu, rho, alpha)
    xc, yc = theory.power_law_design(mu, rho, alpha)
    assert xb == pytest.approx(xc, rel=1e-6) and yb == pytest.approx(yc, rel=1e-6)
    assert xb == pytest.approx(x, abs=0.05) and yb == pytest.approx(y, abs=0.005)
  # x forced up to 4: y*(4) = √(μ/(ρ + 1/4)) = 3.884; J(4, 3.884) beats the whole box
  xb, yb = theory.power_law_design_bounded(5.28, 0.1, 0.25, (4, 64), (1, 16))
  assert xb == 4 and yb == pytest.approx(math.sqrt(5.28 / 0.35), rel=1e-9)
  s2 = theory.power_law_sigma2_bar(0.25)
  grid = [(x, y) for x in np.linspace(4, 64, 241) for y in np.linspace(1, 16, 301)]
  assert theory.objective(xb, yb, 5.28, 0.1, s2) <= min(
      theory.objective(x, y, 5.28, 0.1, s2) for x, y in grid) + 1e-12
  # α = 0 (σ flat): staleness is free, the largest horizon wins
  assert theory.power_law_design_bounded(5.28, 0.1, 0.0, (1, 64), (1, 16))[0] == pytest.approx(64)


def test_controller_follows_the_closed_form():
  spec = auto.AutoReplaySpec()
  # NOTES.md §4: μ = 5.28, ρ = 0.1, α = 0.25 → x* ≈ 2.43, y* ≈ 3.21. With B = 64, G = 4:
  # R = 64/3.214 = 19.9 → 20 (y = 3.2); J(2, 3.2) = 1.38172 < J(3, 3.2) = 1.38316, so the
  # horizon is 2 steps: ages 0..1, max_staleness = 1.
  p = auto.plan(5.28, 0.25, 0.1, spec, batch_size=64, group_size=4, capacity=512)
  assert p.x == pytest.approx(2.43228, abs=1e-4) and p.y == pytest.approx(3.21402, abs=1e-4)
  assert (p.rollouts_per_step, p.horizon, p.max_staleness) == (20, 2, 1)
  assert p.objective == pytest.approx(1.381715, abs=1e-6)
  assert theory.objective(3, 3.2, 5.28, 0.1, theory.power_law_sigma2_bar(0.25)) == \
      pytest.approx(1.383162, abs=1e-6)
  # α = 0.1 → x* ≈ 14.32, y* ≈ 5.58; B = 256, G = 8: R = 45.9 → 48; horizon 14; lag 1
  p = auto.plan(5.28, 0.1, 0.1, spec, batch_size=256, group_size=8, capacity=4096, lag=1)
  assert (p.rollouts_per_step, p.horizon, p.max_staleness) == (48, 14, 14)
  # a capacity of 512 holds ⌈512/48⌉ = 11 steps (the oldest partly): the cut-off stops there
  assert auto.plan(5.28, 0.1, 0.1, spec, batch_size=256, group_size=8, capacity=512).horizon == 11
  # sampling B = 64 without replacement needs 64 eligible items: ⌈64/20⌉ = 4 steps, not 2
  p = auto.plan(5.28, 0.25, 0.1, spec, batch_size=64, group_size=4, capacity=512, min_items=64)
  assert (p.rollouts_per_step, p.horizon, p.max_staleness) == (20, 4, 3)
  # bounds: y_max = 2 forces R >= 256/2 = 128
  tight = auto.AutoReplaySpec(y_max=2.0)
  assert auto.plan(5.28, 0.1, 0.1, tight, batch_size=256, group_size=8,
                   capacity=4096).rollouts_per_step == 128
  # out-of-range estimates are clamped (ρ < 0 → 0; α < 0 → 0: horizon at x_max)
  p = auto.plan(5.28, -0.1, -0.2, spec, batch_size=64, group_size=4, capacity=8192)
  assert p.x == pytest.approx(64.0) and p.horizon == 64


def test_controller_updates_with_warmup_ema_hysteresis_and_round_trips_exactly():
  spec = auto.AutoReplaySpec(warmup=2, ema=0.5, tolerance=0.2)
  kw = dict(batch_size=64, group_size=4, capacity=512)
  st = auto.initial_state(16, None)
  st, p = auto.update(st, 50, spec, mu=5.28, alpha=0.25, rho=0.1, **kw)
  assert p is None and st.rollouts_per_step == 16 and st.num_estimates == 1
  st, p = auto.update(st, 100, spec, mu=5.28, alpha=0.25, rho=float("nan"), **kw)
  assert st.rho == 0.1 and st.alpha == 0.25  # NaN ignored, EMA of equal values
  assert (p.rollouts_per_step, p.max_staleness) == (20, 1)  # |20 − 16|/16 = 0.25 > 0.2
  assert st.rollouts_per_step == 20 and len(st.log) == 1 and st.log[0].step == 100
  assert st.log[0].reason == "estimate" and st.log[0].x == pytest.approx(2.43228, abs=1e-4)
  # α estimate 0.35 → EMA 0.3: y* = 2.976 → R = 21.5 → 20: within tolerance, R kept
  st, p = auto.update(st, 150, spec, mu=5.28, alpha=0.35, rho=0.1, **kw)
  assert st.alpha == pytest.approx(0.3) and st.rollouts_per_step == 20
  x, y = theory.power_law_design(5.28, 0.1, 0.3)
  assert p.x == pytest.approx(x, rel=1e-6) and p.y == pytest.approx(y, rel=1e-6)
  d = json.loads(json.dumps(st.to_dict()))
  assert auto.AutoReplayState.from_dict(d) == st
  assert auto.AutoReplayState.from_dict(d).to_dict() == st.to_dict()
  fresh = auto.initial_state(8)
  assert auto.AutoReplayState.from_dict(json.loads(json.dumps(fresh.to_dict()))) == fresh


def test_auto_replay_spec_validates():
  s = auto.AutoReplaySpec.from_config({"enabled": True, "every": 25, "x_max": 32.0})
  assert s.enabled and s.every == 25 and s.x_max == 32.0 and s.y_max == 16.0
  for bad in ({"every": 0}, {"x_min": 8.0, "x_max": 4.0}, {"y_min": 0.0}, {"ema": 1.0},
              {"center": "median"}, {"x_maxx": 3.0}):
    with pytest.raises(ConfigError, match="auto_replay"):
      auto.AutoReplaySpec.from_config(bad)
  from jaxreplay.spec import attribute_docs
  assert set(attribute_docs(auto.AutoReplaySpec)) == {f for f in auto.AutoReplaySpec().to_dict()}


@pytest.mark.slow
def test_bias_profile_recovers_a_known_bias_slope_and_the_fresh_gradient():
  # g_i = ∇F + s_i·d + noise: ‖∇F‖² = 4, ‖d‖ = 0.5 per step of age, per-item noise
  # variance 0.25 × 64 = 16; the bias of age s is ‖s·d‖² = 0.25 s² (Thm 4.4's κ-term, linear)
  rng = np.random.default_rng(0)
  k, n = 64, 1200
  f = rng.normal(size=k)
  f *= 2.0 / np.linalg.norm(f)
  d = rng.normal(size=k)
  d *= 0.5 / np.linalg.norm(d)
  ages = rng.integers(0, 6, size=n)
  g = f[None] + ages[:, None] * d[None] + 0.5 * rng.normal(size=(n, k))
  est = nz.estimate_noise(jnp.asarray(g), jnp.asarray(ages), num_items=n)
  assert float(est.bias_slope) == pytest.approx(0.5, rel=0.25)
  assert float(est.grad2) == pytest.approx(4.0, rel=0.25)
  assert float(est.fresh_var) == pytest.approx(16.0, rel=0.1)
  b2 = np.asarray(est.bias2)
  assert np.isnan(b2[0])  # the youngest age is the reference
  np.testing.assert_allclose(b2[1:6], 0.25 * np.arange(1, 6) ** 2, rtol=0.4, atol=0.15)
  m = nz.metrics(est)
  assert m["noise/bias2_s3"] == pytest.approx(float(b2[3])) and "noise/bias2_s0" not in m
  # no bias: what is left is the maximum's noise floor (≈ 0.19 here: a one-step bucket of
  # ~200 items against ~170 fresh ones), under half the biased case's 0.5
  g0 = f[None] + 0.5 * rng.normal(size=(n, k))
  assert float(nz.estimate_noise(jnp.asarray(g0), jnp.asarray(ages), num_items=n)
               .bias_slope) < 0.25
  # G = 8 completions of a prompt share a component (correlation 0.3): v/n understates the
  # variance of a bucket mean and the no-bias slope inflates; the cluster-robust correction
  # over group_id brings the floor down (5 ages × 4 groups of 8, as the bench's buffer)
  ages5 = np.repeat(np.arange(5), 32)
  grp = np.arange(160) // 8
  floors = {True: [], False: []}
  for _ in range(12):
    x = (f[None] + np.sqrt(0.3) * 2 * rng.normal(size=(20, k))[grp]
         + np.sqrt(0.7) * 2 * rng.normal(size=(160, k)))
    for use in (True, False):
      e = nz.estimate_noise(jnp.asarray(x), jnp.asarray(ages5), num_items=160,
                            groups=jnp.asarray(grp) if use else None)
      floors[use].append(auto.relative_bias(e.bias_slope, e.grad2, e.fresh_var, 64))
  assert np.median(floors[True]) < 0.75 < 1.0 < np.median(floors[False])
  assert auto.bias_cap(float("nan"), auto.AutoReplaySpec(bias_limit=0.3)) == 64.0
  # one age only: nothing to compare with
  one = nz.estimate_noise(jnp.asarray(g), jnp.zeros(n, jnp.int32), num_items=n)
  assert np.isnan(float(one.bias_slope)) and np.isfinite(float(one.grad2))


def test_controller_bias_cap_follows_thm_4_4():
  # k = slope / √(max(‖∇F‖², 0) + σ²(0)/B): 0.5/√(4 + 64/64) = 0.22361; ‖∇F‖² < 0 → 0
  assert auto.relative_bias(0.5, 4.0, 64.0, 64) == pytest.approx(0.5 / math.sqrt(5.0))
  assert auto.relative_bias(1.0, -1.0, 4.0, 1) == pytest.approx(0.5)
  assert math.isnan(auto.relative_bias(float("nan"), 4.0, 64.0, 64))
  spec = auto.AutoReplaySpec(x_max=8.0, y_max=4.0, bias_limit=auto.BIAS_LIMIT)
  kw = dict(batch_size=64, group_size=8, capacity=512, min_items=64)
  # k = 0.1: x_cap = (1/(2√2))/0.1 = 3.5355 and y <= x_cap; at the cap y*(x) =
  # √(3.7/(0.17 + 1/3.5355)) = 2.8584 → R = 64/2.8584 = 22.4 → 24; horizon ⌊3.5355⌋ = 3
  p = auto.plan(3.7, 0.0, 0.17, spec, kappa=0.1, **kw)
  assert p.x_cap == pytest.approx(3.53553, abs=1e-5) and p.x == pytest.approx(3.53553, abs=1e-5)
  assert p.y == pytest.approx(2.85843, abs=1e-4)
  assert (p.rollouts_per_step, p.horizon, p.max_staleness) == (24, 3, 2)
  # k = 0.5: x_cap = 0.707 → x_min = 1, y <= 1: on-policy (R = B, ages 0 only)
  p = auto.plan(3.7, 0.0, 0.17, spec, kappa=0.5, **kw)
  assert (p.rollouts_per_step, p.horizon, p.max_staleness, p.x_cap) == (64, 1, 0, 1.0)
  # off (bias_limit = 0, the default) or no k: the uncapped optimum (x_max, y at x_max)
  off = auto.plan(3.7, 0.0, 0.17, auto.AutoReplaySpec(x_max=8.0, y_max=4.0), kappa=0.5, **kw)
  assert off == auto.plan(3.7, 0.0, 0.17, spec, kappa=None, **kw)
  assert (off.rollouts_per_step, off.horizon) == (16, 8)
  # the controller folds k like the other estimates, logs it, and round-trips it
  st = auto.initial_state(32, 3)
  st, p = auto.update(st, 25, dataclasses.replace(spec, warmup=1), mu=3.7, alpha=0.0,
                      rho=0.17, kappa=0.5, **kw)
  assert st.kappa == 0.5 and (st.rollouts_per_step, st.max_staleness) == (64, 0)
  assert st.log[-1].kappa == 0.5 and st.log[-1].reason == "bias"
  d = json.loads(json.dumps(st.to_dict()))
  assert auto.AutoReplayState.from_dict(d) == st
  del d["kappa"]  # a state written before k was measured
  assert auto.AutoReplayState.from_dict(d).kappa is None
