"""Sample-weight pipeline (CASES.md case 13), staleness-adaptive trust region, and the
full objective: truncation masking (case 3), KL term (case 10), ratio masking, metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.rl import diagnostics, losses, weights
from jaxreplay.rl.objective import objective
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout

# ``objective`` runs eagerly here: op kernels are cached across tests, cheaper than one XLA
# compile per spec.


def spec(**kw) -> AlgoSpec:
  return AlgoSpec.from_config(kw)


def make_batch(mu, mask, adv, rewards=None, truncated=None, version=None) -> Rollout:
  mu = jnp.asarray(mu, jnp.float32)
  b, t = mu.shape
  return Rollout(tokens=jnp.zeros((b, t), jnp.int32), attention_mask=jnp.asarray(mask, bool),
                 completion_mask=jnp.asarray(mask, bool), behaviour_logprobs=mu,
                 rewards=jnp.zeros(b) if rewards is None else jnp.asarray(rewards, jnp.float32),
                 advantages=jnp.asarray(adv, jnp.float32), group_id=jnp.zeros(b, jnp.int32),
                 policy_version=jnp.zeros(b, jnp.int32) if version is None else jnp.asarray(version), newest_version=jnp.zeros(b, jnp.int32) if version is None else jnp.asarray(version),
                 truncated=jnp.zeros(b, bool) if truncated is None else jnp.asarray(truncated))


# --- CASES.md case 13: PER weights -------------------------------------------------------

P13 = np.array([0.1, 0.2, 0.3, 0.4], np.float32)


def test_case13_per_weights():
  raw = weights.sampling_weights(jnp.asarray(P13), 4, beta=1.0, normalize=False)
  np.testing.assert_allclose(raw, [2.5, 1.25, 0.8333333, 0.625], rtol=1e-6)
  np.testing.assert_allclose(weights.sampling_weights(jnp.asarray(P13), 4, 1.0),
                             [1.0, 0.5, 0.3333333, 0.25], rtol=1e-6)
  np.testing.assert_allclose(weights.sampling_weights(jnp.asarray(P13), 4, 0.4),
                             [1.0, 0.7578583, 0.6443940, 0.5743492], rtol=1e-6)


@pytest.mark.parametrize("n", [3, 4, 7, 300_000])
def test_case13_uniform_weights_are_exactly_one(n):
  p = jnp.full((5,), 1.0 / n, jnp.float32)
  np.testing.assert_array_equal(weights.sampling_weights(p, n, 0.4), np.ones(5, np.float32))
  np.testing.assert_array_equal(weights.sampling_weights(p, n, 0.4, min_prob=1.0 / n),
                                np.ones(5, np.float32))
  assert float(p[0] ** -0.4) > 1.5  # the bug: P^-β without N and without max-normalising


def test_case13_buffer_wide_normalisation_is_batch_independent():
  # A batch that misses the lowest-probability item: batch-max vs buffer-wide max.
  batch = jnp.asarray(P13[2:])
  np.testing.assert_allclose(weights.sampling_weights(batch, 4, 1.0), [1.0, 0.75], rtol=1e-6)
  np.testing.assert_allclose(weights.sampling_weights(batch, 4, 1.0, min_prob=0.1),
                             [0.3333333, 0.25], rtol=1e-6)
  with pytest.raises(ValueError, match=r"beta=1\.5 must be in \[0, 1\]"):
    weights.sampling_weights(batch, 4, 1.5)


def test_case13_uniform_weighted_loss_equals_unweighted_loss():
  logp = jnp.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8]])
  mu = logp + jnp.array([[0.1, -0.4, 0.2], [0.0, 0.3, -0.1]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
  adv = jnp.array([0.8, -1.2])
  params = losses.LossParams(eps_low=0.2, eps_high=0.2)
  plain = losses.aggregate(losses.ppo_clip_loss(logp, mu, adv, mask, params)[0], mask,
                           "token_mean")
  w = weights.sampling_weights(jnp.full((2,), 1 / 6), 6, 0.4)
  got, _ = objective(spec(), logp, jnp.zeros_like(logp), make_batch(mu, mask, adv), w,
                     jnp.zeros(2, jnp.int32))
  assert float(got) == float(plain)


# --- staleness-adaptive trust region ---------------------------------------------------------


@pytest.mark.parametrize("fn,want", [("inverse", [1.0, 0.5, 1 / 3, 0.2]),
                                     ("exp", np.exp(-0.5 * np.arange(4) * 2)),
                                     ("linear", [1.0, 0.0, 0.0, 0.0])])
def test_staleness_factor(fn, want):
  rate = {"inverse": 1.0, "exp": 1.0, "linear": 1.0}[fn]
  s = jnp.array([0, 1, 2, 4]) if fn != "exp" else jnp.array([0, 1, 2, 3])
  want = want if fn != "exp" else np.exp(-np.arange(4.0))
  np.testing.assert_allclose(weights.staleness_factor(s, fn, rate), want, rtol=1e-6)


def test_adaptive_trust_region_targets():
  s = jnp.array([0, 1, 3])
  f = np.array([1.0, 0.5, 0.25])  # inverse, rate 1
  tr = weights.adaptive_trust_region(s, 0.2, 0.28, 3.0, "clip", "inverse", 1.0)
  np.testing.assert_allclose(tr.eps_low, 0.2 * f, rtol=1e-6)
  np.testing.assert_allclose(tr.eps_high, 0.28 * f, rtol=1e-6)
  np.testing.assert_array_equal(tr.cap, [3.0] * 3)
  tr = weights.adaptive_trust_region(s, 0.2, 0.28, 3.0, "cap", "inverse", 1.0)
  np.testing.assert_allclose(tr.cap, 1 + 2 * f, rtol=1e-6)
  np.testing.assert_array_equal(tr.eps_low, np.full(3, 0.2, np.float32))
  tr = weights.adaptive_trust_region(s, 0.2, 0.28, 0.0, "weight", "inverse", 1.0)
  np.testing.assert_allclose(tr.weight, f, rtol=1e-6)
  assert np.isinf(np.asarray(tr.cap)).all()
  tr = weights.adaptive_trust_region(s, 0.2, 0.28, 3.0, "none", "inverse", 1.0)
  np.testing.assert_array_equal(tr.weight, [1.0] * 3)
  with pytest.raises(ValueError, match=r"target='eps' is not one of \('none', 'clip'"):
    weights.adaptive_trust_region(s, 0.2, 0.2, 2.0, "eps")
  with pytest.raises(ValueError, match=r"fn='cosine' is not one of \('inverse'"):
    weights.staleness_factor(s, "cosine", 1.0)


def test_staleness_clip_changes_the_gradient_of_stale_rows_only():
  # Two identical rows with ratio e^0.15 = 1.162 and A = 1; ε = 0.2 leaves them unclipped.
  # With target "clip", inverse, rate 1: the row of staleness 3 gets ε_high = 0.05 →
  # clipped (no gradient), the fresh row keeps −r·A/2 per token.
  logp = jnp.array([[-1.0], [-1.0]])
  mu = logp - 0.15
  b = make_batch(mu, [[1], [1]], [1.0, 1.0])
  sp = spec(staleness_target="clip", staleness_fn="inverse", staleness_rate=1.0)
  g, m = jax.grad(lambda lp: objective(sp, lp, jnp.zeros_like(lp), b, jnp.ones(2),
                                       jnp.array([0, 3])), has_aux=True)(logp)
  np.testing.assert_allclose(g, [[-np.exp(0.15) / 2], [0.0]], rtol=1e-6)
  assert float(m["clip_frac_high"]) == 0.5
  assert float(m["stale/s0/clip_frac_high"]) == 0.0
  assert float(m["stale/s2-3/clip_frac_high"]) == 1.0
  assert float(m["stale/s2-3/tokens"]) == 1.0 and float(m["stale/s1/tokens"]) == 0.0


def test_staleness_weight_scales_the_loss():
  logp = jnp.array([[-1.0], [-1.0]])
  b = make_batch(logp, [[1], [1]], [1.0, 1.0])
  sp = spec(loss="reinforce", staleness_target="weight", staleness_rate=1.0)
  g = jax.grad(lambda lp: objective(sp, lp, jnp.zeros_like(lp), b, jnp.array([1.0, 0.5]),
                                    jnp.array([0, 1]))[0])(logp)
  # Weights: sampling [1, 0.5] × staleness [1, 1/2] → gradient −A·w/2.
  np.testing.assert_allclose(g, [[-0.5], [-0.125]], rtol=1e-6)


# --- the full objective: case 3, case 10, ratio mask, entropy ------------------------------


def case3_batch(truncated):
  lengths = [10, 15, 5]
  mask = np.zeros((3, 15), bool)
  for i, n in enumerate(lengths):
    mask[i, :n] = True
  return make_batch(np.zeros((3, 15)), mask, [-1.0, -1.0, -1.0], truncated=truncated)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_case3_truncated_rows_leave_loss_and_normaliser(mode):
  sp = spec(mask_truncated=True, aggregation=mode, horizon=15)
  lp = jnp.zeros((3, 15))
  b = case3_batch([False, False, True])
  (val, _), g = jax.value_and_grad(
      lambda x: objective(sp, x, jnp.zeros_like(x), b, jnp.ones(3), jnp.zeros(3, jnp.int32)),
      has_aux=True)(lp)
  # Per-token loss 1 (ratio 1, A = −1). Sequence-mean modes skip the empty row; the
  # token-sum modes keep the constant normaliser B = 3 (the empty row contributes 0).
  want = {"token_mean": 25 / 25, "seq_mean_token_mean": 1.0, "seq_mean_token_sum": 25 / 3,
          "seq_mean_token_sum_norm": 25 / 3 / 15}
  assert float(val) == pytest.approx(want[mode], rel=1e-6)
  if mode == "token_mean":
    assert float(val) == 1.0  # the bug gives 25/30
  np.testing.assert_array_equal(g[2], np.zeros(15, np.float32))
  assert float(jnp.abs(g[:2]).sum()) > 0
  # Every completion truncated: loss exactly 0, finite gradients.
  b_all = case3_batch([True, True, True])
  (val, _), g = jax.value_and_grad(
      lambda x: objective(sp, x, jnp.zeros_like(x), b_all, jnp.ones(3),
                          jnp.zeros(3, jnp.int32)), has_aux=True)(lp)
  assert float(val) == 0.0 and bool(jnp.isfinite(g).all())


@pytest.mark.parametrize("logp,ref,est,excess", [
    (-1.0, -2.0, "k1", 0.1), (-1.0, -2.0, "k2", 0.05), (-1.0, -2.0, "k3", 0.0367879),
])
def test_case10_kl_term_adds_beta_times_estimate(logp, ref, est, excess):
  lp = jnp.array([[logp]])
  b = make_batch(lp, [[1]], [0.7])
  args = (lp, jnp.zeros_like(lp), b, jnp.ones(1), jnp.zeros(1, jnp.int32))
  base, _ = objective(spec(), *args, ref_logp_bt=jnp.array([[ref]]))
  with_kl, m = objective(spec(kl_coef=0.1, kl_estimator=est), *args, ref_logp_bt=jnp.array([[ref]]))
  assert float(with_kl - base) == pytest.approx(excess, abs=1e-6)
  assert "kl_ref" in m
  with pytest.raises(ValueError, match="reference"):
    objective(spec(kl_coef=0.1), *args)


def test_ratio_mask_zeroes_gradient_but_keeps_normaliser():
  # Ratios [e^1, 1, e^-1] with c = 2: the first and last are masked; the normaliser stays 3.
  logp = jnp.array([[-1.0, -1.0, -1.0]])
  mu = logp - jnp.array([[1.0, 0.0, -1.0]])
  b = make_batch(mu, [[1, 1, 1]], [1.0])
  sp = spec(loss="tis", is_cap=0.0, ratio_mask_c=2.0)
  (val, m), g = jax.value_and_grad(
      lambda x: objective(sp, x, jnp.zeros_like(x), b, jnp.ones(1), jnp.zeros(1, jnp.int32)),
      has_aux=True)(logp)
  np.testing.assert_allclose(g, [[0.0, -1 / 3, 0.0]], rtol=1e-6)
  assert float(val) == pytest.approx(1.0 / 3, rel=1e-6)  # −1·1·(−1)/3
  assert float(m["ratio_masked_frac"]) == pytest.approx(2 / 3)


def test_entropy_bonus_lowers_loss_and_is_masked():
  lp = jnp.array([[-1.0, -1.0]])
  ent = jnp.array([[0.8, 123.0]])  # the second column is off-mask
  b = make_batch(lp, [[1, 0]], [0.0])
  args = (lp, ent, b, jnp.ones(1), jnp.zeros(1, jnp.int32))
  base, m = objective(spec(), *args)
  bonus, _ = objective(spec(entropy_coef=0.01), *args)
  assert float(base - bonus) == pytest.approx(0.008, abs=1e-7)
  assert float(m["entropy"]) == pytest.approx(0.8)


def test_metrics_ignore_padding_sentinels():
  # Case 6 "the same masking applies to the KL and ratio metrics".
  lp = jnp.array([[-1.0, 5.0], [-2.0, 5.0]])
  mu = jnp.array([[-1.2, -50.0], [-1.9, 50.0]])
  b = make_batch(mu, [[1, 0], [1, 0]], [1.0, 1.0])
  _, m = objective(spec(), lp, jnp.zeros_like(lp), b, jnp.ones(2), jnp.zeros(2, jnp.int32))
  r = np.exp([0.2, -0.1])
  assert float(m["ratio_mean"]) == pytest.approx(r.mean(), rel=1e-6)
  assert float(m["ratio_max"]) == pytest.approx(r.max(), rel=1e-6)
  assert float(m["kl_behaviour"]) == pytest.approx((r - 1 - np.log(r)).mean(), rel=1e-5)
  assert float(m["ess"]) == pytest.approx(r.sum() ** 2 / (2 * (r ** 2).sum()), rel=1e-6)
  assert float(m["ratio_p50"]) == pytest.approx(r.mean(), rel=1e-6)  # 2 values: midpoint


def test_combine_updates_weights_by_tokens():
  per = {"ratio_mean": jnp.array([2.0, 0.0]), "tokens": jnp.array([3.0, 0.0]),
         "stale/s0/ratio_min": jnp.array([0.5, 0.0]), "stale/s0/tokens": jnp.array([1.0, 0.0]),
         "loss": jnp.array([1.0, 3.0]), "skipped_update": jnp.array([0.0, 1.0])}
  out = diagnostics.combine_updates(per, epochs=1, loss_weights=jnp.array([1.0, 1.0]))
  assert float(out["ratio_mean"]) == 2.0 and float(out["tokens"]) == 3.0
  assert float(out["stale/s0/ratio_min"]) == 0.5
  assert float(out["loss"]) == 2.0 and float(out["skipped_update"]) == 1.0
  # The loss is weighted by each update's aggregation normaliser: 3 tokens against 1.
  out = diagnostics.combine_updates(per, epochs=1, loss_weights=jnp.array([3.0, 1.0]))
  assert float(out["loss"]) == 1.5 and float(out["ratio_mean"]) == 2.0
  assert diagnostics.bucket_names((0, 1, 2, 4, 8)) == ["s0", "s1", "s2-3", "s4-7", "s8+"]


@pytest.mark.parametrize("field,value", [
    ("loss", "ppo"), ("advantage", "gae2"), ("aggregation", "mean"), ("kl_estimator", "k9"),
    ("kl_mode", "both"), ("staleness_target", "lr"), ("staleness_fn", "cos"),
])
def test_unknown_names_raise_naming_the_field(field, value):
  with pytest.raises(ValueError, match=rf"algo\.{field}={value!r}"):
    spec(**{field: value})


def test_invalid_combinations():
  with pytest.raises(ValueError, match=r"algo\.horizon"):
    spec(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="gspo"):
    spec(advantage="gae", loss="gspo")
  with pytest.raises(ValueError, match=r"algo\.kl_mode='reward'"):
    spec(kl_coef=0.1, kl_mode="reward", loss="asymre", advantage="dr_grpo")
  assert spec(kl_coef=0.1, kl_mode="reward").kl_mode == "reward"  # loop penalises rewards
  assert spec(kl_coef=0.1, kl_mode="reward", advantage="gae").kl_mode == "reward"
  with pytest.raises(ValueError, match="staleness_buckets"):
    spec(staleness_buckets=(1, 2))
  assert dataclasses.replace(spec(), loss="tis").loss == "tis"
