"""The study's statistics on synthetic data with known answers: curve summaries, intervals
that cover at their stated rate, the saturating fit recovering known parameters, the noise
model recovering known noise, and the decision rules' false-positive rate and power."""

import math

import numpy as np
import pytest

from jaxreplay.study import fit, null, stats

# A curve shaped like the study's on-policy runs (tokens as a fraction of the budget) and
# noise of the size the archived runs show; both are inputs here, not results.
CURVE = dict(r0=0.30, a=0.49, b=0.95, c_mid=0.39)
NOISE = null.NoiseModel(jitter=0.018, seed=0.021, run=0.008)


def curve(t):
  return fit.saturating(t, **CURVE)


# --- curve summaries ----------------------------------------------------------------------

def test_smooth_holds_the_warm_start_and_averages_neighbours():
  acc = np.array([0.3, 0.4, 0.6, 0.5, 0.7])
  np.testing.assert_allclose(stats.smooth(acc), [0.3, 0.5, 0.5, 0.6, 0.6])
  np.testing.assert_allclose(stats.smooth(acc, hold_first=False),
                             [0.35, 13 / 30, 0.5, 0.6, 0.6])
  np.testing.assert_allclose(stats.smooth(acc, 0), acc)
  np.testing.assert_allclose(stats.smooth(np.stack([acc, acc + 1]))[1], [1.3, 1.5, 1.5, 1.6, 1.6])
  with pytest.raises(ValueError, match="half_width"):
    stats.smooth(acc, -1)


def test_first_crossing_interpolates_between_evaluations():
  t = np.array([0.0, 10.0, 20.0, 30.0])
  acc = np.array([0.2, 0.3, 0.5, 0.4])
  assert stats.first_crossing(t, acc, 0.4) == pytest.approx(15.0)
  assert stats.first_crossing(t, acc, 0.1) == 0.0
  assert stats.first_crossing(t, acc, 0.5) == 20.0
  assert stats.first_crossing(t, acc, 0.51) == math.inf


def test_log_auc_is_the_mean_over_the_log_axis():
  t = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 400)])
  assert float(stats.log_auc(t, np.full_like(t, 0.42), 1.0)) == pytest.approx(0.42)
  # acc = 0.5 + 0.1 ln t: its mean over ln t uniform on [ln 1/8, 0] is 0.5 + 0.1 ln(1/8)/2
  acc = 0.5 + 0.1 * np.log(np.maximum(t, 1e-3))
  assert float(stats.log_auc(t, acc, 1.0)) == pytest.approx(0.5 + 0.05 * math.log(1 / 8),
                                                            abs=1e-4)
  # linear in the accuracies: the weights give the same number
  w = stats.auc_weights(t, 1.0)
  assert w.sum() == pytest.approx(1.0) and float(w @ acc) == pytest.approx(
      float(stats.log_auc(t, acc, 1.0)))
  # a curve that reaches every accuracy with fewer tokens has the larger AUC
  tt = np.linspace(0, 1, 13)
  assert stats.log_auc(tt, curve(tt / 0.7), 1.0) > stats.log_auc(tt, curve(tt), 1.0) + 0.01


def test_paired_comparison_by_hand():
  c = stats.paired([0.51, 0.52, 0.53], [0.50, 0.50, 0.50])
  assert c.diff_s == pytest.approx((0.01, 0.02, 0.03)) and c.mean == pytest.approx(0.02)
  half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t_{0.975, 2} · sd / √3
  assert c.t == pytest.approx((0.02 - half, 0.02 + half))
  assert c.boot[0] >= 0.01 - 1e-12 and c.boot[1] <= 0.03 + 1e-12
  assert c.p_improve == 1.0 and 0 < c.p_value < 0.05
  with pytest.raises(ValueError, match="same seeds"):
    stats.paired([1, 2], [1, 2, 3])


def test_probability_of_improvement_paired_and_rliables():
  a, b = [0.3, 0.5, 0.4], [0.4, 0.4, 0.4]
  assert stats.probability_of_improvement(a, b) == pytest.approx(0.5)  # 0 + 1 + 0.5
  # unpaired: the share of all pairs (ties half), rliable's Mann–Whitney definition
  brute = np.mean([(x > y) + 0.5 * (x == y) for x in a for y in b])
  assert stats.probability_of_improvement(a, b, paired=False) == pytest.approx(brute)


def test_ratio_summary_with_an_unreached_seed():
  r = stats.ratio_summary([0.5, 0.8, math.inf])
  assert r.median == 0.8 and r.reached == 2 and r.boot[1] == math.inf
  assert math.isnan(r.geo)
  g = stats.ratio_summary([0.5, 0.5, 0.5])
  assert g.geo == pytest.approx(0.5) and g.boot == (0.5, 0.5)


# --- intervals cover at their stated rate --------------------------------------------------

@pytest.mark.parametrize("n", [3, 10])
def test_t_interval_covers_at_its_nominal_rate(n):
  rng = np.random.default_rng(0)
  reps = 4000
  hits = sum(lo <= 0.3 <= hi for lo, hi in
             (stats.t_interval(rng.normal(0.3, 0.02, n)) for _ in range(reps)))
  se = math.sqrt(0.95 * 0.05 / reps)
  assert abs(hits / reps - 0.95) < 3 * se


def test_seed_bootstrap_covers_with_many_seeds_and_not_with_three():
  """The percentile bootstrap reaches its nominal rate only with many seeds; with 3 it
  covers about three times in four, which is why the decisions use the t interval."""
  rng = np.random.default_rng(1)
  reps = 800

  def coverage(n):
    return np.mean([lo <= 0.3 <= hi for lo, hi in
                    (stats.bootstrap_interval(rng.normal(0.3, 0.02, n), seed=i,
                                              n_resamples=1000) for i in range(reps))])

  se = math.sqrt(0.95 * 0.05 / reps)
  assert abs(coverage(50) - 0.95) < 3 * se + 0.005  # + the method's own O(1/n) shortfall
  assert coverage(3) < 0.85


# --- the saturating fit -------------------------------------------------------------------

def test_fit_recovers_known_parameters_within_10_percent():
  truth = dict(r0=0.30, a=0.52, b=1.2, c_mid=0.4)
  rng = np.random.default_rng(2)
  c = np.linspace(0, 4, 49)
  curves = [(c, fit.saturating(c, **truth) + rng.normal(0, 0.004, len(c))) for _ in range(6)]
  for cv in curves:
    cv[1][0] = truth["r0"]
  f = fit.fit_seeds(curves, n_boot=100)
  for k in ("a", "b", "c_mid"):
    assert getattr(f, k) == pytest.approx(truth[k], rel=0.10), k
  assert f.a_ci[0] <= truth["a"] <= f.a_ci[1] and f.identified


def test_fit_does_not_claim_an_asymptote_it_never_approached():
  truth = dict(r0=0.30, a=0.52, b=1.2, c_mid=4.0)
  rng = np.random.default_rng(3)
  c = np.linspace(0, 1, 13)  # the data stop at a quarter of C_mid
  curves = [(c, fit.saturating(c, **truth) + rng.normal(0, 0.015, len(c))) for _ in range(3)]
  f = fit.fit_seeds(curves, n_boot=100)
  assert not f.identified


def test_fit_needs_three_points():
  with pytest.raises(ValueError, match=">= 3 points"):
    fit.fit_curve(np.array([0.0, 1.0, 2.0]), np.array([0.3, 0.4, 0.5]), 0.3)


# --- the noise model ----------------------------------------------------------------------

def test_noise_model_recovers_known_noise():
  rng = np.random.default_rng(4)
  t = null.EVAL_GRID * 50_000
  regimes = []
  for _ in range(3):
    acc = null.simulate(NOISE, lambda x: curve(x / 50_000), t, [0.0] * 4, 24, 1, rng)[0]
    runs = {f"c{k}": {s: (t, acc[k, s]) for s in range(24)} for k in range(4)}
    regimes.append((50_000.0, runs))
  m = null.fit_noise(regimes)
  assert m.jitter == pytest.approx(NOISE.jitter, rel=0.10)
  assert m.seed == pytest.approx(NOISE.seed, rel=0.30)
  assert m.run == pytest.approx(NOISE.run, rel=0.35)
  assert (m.df_seed, m.df_run) == (3 * 23, 3 * 3 * 23)


# --- decision rules under the null and under a known saving --------------------------------

K = 4  # on-policy and the study's three buffers per regime (two fixed, self-tuning)


def test_replay_pays_rule_fires_at_most_5_percent_on_equal_curves():
  rule = null.RULES["auc_bonferroni"]
  for seeds in (3, 12):
    assert null.rate(rule, NOISE, curve, [0.0] * K, seeds, n_sims=8000) <= 0.05
  # the old first-crossing rule and the uncorrected best of three do not
  assert null.rate(null.RULES["first_crossing"], NOISE, curve, [0.0] * K, 3) > 0.40
  assert null.rate(null.RULES["auc_uncorrected"], NOISE, curve, [0.0] * K, 3) > 0.10


def test_replay_pays_rule_finds_a_30_percent_saving_with_enough_seeds():
  """With one of the three buffers saving 30% of the tokens: 3 seeds find it rarely (the
  study is underpowered), 11 seeds find it at least 80% of the time, 10 do not."""
  rule = null.RULES["auc_bonferroni"]
  saving = null.savings_one(K, 0.30)
  assert null.rate(rule, NOISE, curve, saving, 3) < 0.30
  assert null.rate(rule, NOISE, curve, saving, 11) >= 0.80
  assert null.rate(rule, NOISE, curve, saving, 10) < 0.80
  assert null.seeds_for_power(rule, NOISE, curve, saving) == 11


def test_self_tuning_rule_includes_the_selection_of_the_best():
  saving_best = [0.0, 0.3, 0.0, 0.0]  # the second fixed configuration saves; self-tuning last
  assert null.rate(null.RULES["auto_short"], NOISE, curve, [0.0] * K, 3, n_sims=8000) <= 0.05
  assert null.rate(null.RULES["auto_short_uncorrected"], NOISE, curve, [0.0] * K, 3) > 0.07
  assert null.rate(null.RULES["auto_short"], NOISE, curve, saving_best, 11) >= 0.80


def test_detectable_difference_has_the_stated_power():
  sd, n = 0.016, 5
  d = null.detectable_difference(sd, n, n_tests=3)
  rng = np.random.default_rng(5)
  diffs = rng.normal(d, sd, (20000, 1, n))
  power = float(np.mean(null.decide_t(diffs, alpha=0.05 / 3, correct=False)))
  assert power == pytest.approx(0.80, abs=0.015)
  # the model's SD of an AUC difference and the saving that gives a difference
  assert null.auc_difference_sd(NOISE) == pytest.approx(
      math.sqrt(2 * (0.008 ** 2 + 0.018 ** 2 * np.sum(stats.auc_weights(
          null.EVAL_GRID, 1.0)[1:] ** 2))))
  g = null.auc_gain(curve, 0.3)
  assert null.saving_for_gain(curve, g) == pytest.approx(0.3, abs=1e-6)
  assert math.isnan(null.saving_for_gain(curve, 1.0))
