"""How often a decision rule fires by chance: a noise model fitted to the runs, and a null
simulator.

**The noise model** (``NoiseModel``, ``fit_noise``). An evaluation of configuration k at seed
s after t generated tokens reads

    acc_kse = f_k(t_e) + u_s + v_ks + ε_kse,

f_k the configuration's mean curve, u_s ~ N(0, seed²) the seed's offset (its warm start and
its prompts, shared by every configuration of the seed), v_ks ~ N(0, run²) the run's own
offset, ε_kse ~ N(0, jitter²) evaluation-to-evaluation jitter (the evaluation's sampling and
the policy moving between evaluations). The step-0 evaluation is the seed's warm start, the
same for all its configurations (u_s + one ε). Estimates, pooled over the regimes:
  * jitter: second differences, each evaluation against the line through its neighbours
    (evaluations 1..E−1; step 0 left out), scaled by their variance factor
    1 + (1 − w)² + w² (w the evaluation's place between its neighbours, in tokens);
  * seed and run: a two-way analysis of variance of the runs' ``log_auc`` (configurations ×
    seeds, configuration means removed; Searle, Casella & McCulloch 1992, §4.3): the
    residual mean square estimates run² + jitter²·Σ w_e² (w the AUC's weights, so the
    jitter's share is taken out), the seed mean square C·seed² + the residual's.

**The null simulator** (``simulate``, ``rate``). Curves of K configurations × S seeds are
drawn from the model with one mean curve f for all (the null), or with configuration k's
curve f(t/(1 − saving_k)) — it reaches every accuracy with (1 − saving_k) of the tokens. A
rule (``RULES``) maps the curves of a reference and K − 1 buffers to "replay pays"; its rate
over draws is its false-positive rate under the null and its power under a saving. The
selection of the best of K − 1 buffers is part of every rule, so the rates include it.

**Rules.** The paired t rules (``auc_bonferroni``, ``final_bonferroni``) test each buffer's
per-seed difference from the reference one-sided at α/(K − 1) (Bonferroni; the union bound
keeps the family's false-positive rate ≤ α however the tests correlate). Pairing removes u_s,
and the differences are normal under the model, so their rate is exact up to the union bound;
the crossing rules' is measured only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

from jaxreplay.study import stats

ALPHA = 0.05        # the largest false-positive rate a rule may have to be used
POWER = 0.80        # the power a study is sized for
SAVING = 0.30       # the token saving a study should detect
EVAL_GRID = np.linspace(0.0, 1.0, 13)  # simulated evaluations: step 0 and every 1/12 budget

Curve = tuple  # (tokens_e float [E], acc_e float [E])


@dataclasses.dataclass(frozen=True)
class NoiseModel:
  """Standard deviations (accuracy units) of the model's three noises and their sample sizes.

  Attributes:
    jitter: one evaluation around its run's curve. seed: a seed's offset, shared by its
      configurations. run: a run's offset. n_jitter: second differences used; df_seed,
      df_run: the analysis of variance's degrees of freedom (0: not estimated).
  """

  jitter: float
  seed: float
  run: float
  n_jitter: int = 0
  df_seed: int = 0
  df_run: int = 0


def second_differences(tokens_e: np.ndarray, acc_e: np.ndarray) -> np.ndarray:
  """Each evaluation minus the line through its two neighbours, scaled to the jitter's SD.

  Args:
    tokens_e: float [E] generated tokens. acc_e: float [E] accuracies (step 0 first).

  Returns:
    float64 [max(E − 3, 0)]: z_i = (a_i − (1 − w)a_{i−1} − w a_{i+1}) / √(1 + (1 − w)² + w²)
    for i = 2..E−2, w = (t_i − t_{i−1})/(t_{i+1} − t_{i−1}); E[z²] = jitter² on a locally
    straight curve.
  """
  t, a = np.asarray(tokens_e, np.float64)[1:], np.asarray(acc_e, np.float64)[1:]
  if len(a) < 3:
    return np.zeros(0)
  span = t[2:] - t[:-2]
  w = np.where(span > 0, (t[1:-1] - t[:-2]) / np.where(span > 0, span, 1.0), 0.5)
  d = a[1:-1] - (1 - w) * a[:-2] - w * a[2:]
  return d / np.sqrt(1 + (1 - w) ** 2 + w ** 2)


def fit_noise(regimes: Sequence[tuple[float, Mapping[str, Mapping[int, Curve]]]]) -> NoiseModel:
  """``NoiseModel`` of the runs of one or more regimes.

  Args:
    regimes: per regime (budget in tokens, {configuration: {seed: (tokens_e, acc_e)}}).
      The analysis of variance uses the seeds every configuration of the regime has.

  Returns:
    ``NoiseModel``; seed and run are 0 where their estimate is negative (noise) and NaN
    when no regime has 2 configurations × 2 seeds.

  Raises:
    ValueError: no second differences at all (every run has fewer than 4 evaluations).
  """
  z = [second_differences(*c) for _, runs in regimes for byseed in runs.values()
       for c in byseed.values()]
  z = np.concatenate(z) if z else np.zeros(0)
  if not len(z):
    raise ValueError("no run has 4 or more evaluations: the jitter cannot be estimated")
  jit2 = float(np.mean(z ** 2))
  ss_s = ss_r = w2 = 0.0
  df_s = df_r = n_w = 0
  c_eff = []
  for budget, runs in regimes:
    seeds = sorted(set.intersection(*(set(v) for v in runs.values()))) if runs else []
    names = [k for k in runs]
    if len(seeds) < 2 or len(names) < 2:
      continue
    lv = np.array([[float(stats.log_auc(*runs[k][s], budget)) for s in seeds] for k in names])
    for k in names:
      for s in seeds:
        w = stats.auc_weights(np.asarray(runs[k][s][0], np.float64), budget)
        w2, n_w = w2 + float(np.sum(w[1:] ** 2)), n_w + 1
    r = lv - lv.mean(1, keepdims=True)
    u = r.mean(0)
    ss_s += len(names) * float(np.sum(u ** 2))
    ss_r += float(np.sum((r - u) ** 2))
    df_s += len(seeds) - 1
    df_r += (len(names) - 1) * (len(seeds) - 1)
    c_eff.append(len(names))
  if not df_r:
    return NoiseModel(math.sqrt(jit2), float("nan"), float("nan"), len(z))
  ms_s, ms_r = ss_s / df_s, ss_r / df_r
  run2 = max(0.0, ms_r - jit2 * w2 / n_w)
  seed2 = max(0.0, (ms_s - ms_r) / float(np.mean(c_eff)))
  return NoiseModel(math.sqrt(jit2), math.sqrt(seed2), math.sqrt(run2), len(z), df_s, df_r)


# --- simulation ---------------------------------------------------------------------------

def simulate(noise: NoiseModel, curve: Callable[[np.ndarray], np.ndarray],
             tokens_e: np.ndarray, savings_k: Sequence[float], n_seeds: int, n_sims: int,
             rng: np.random.Generator) -> np.ndarray:
  """Draws evaluations from the model.

  Args:
    noise: the model. curve: f, accuracy at tokens (float [E] -> float [E]); f(0) is the
      warm start. tokens_e: float [E] evaluation tokens, tokens_e[0] = 0 (the warm start).
    savings_k: per configuration k, its token saving in [0, 1): its curve is
      f(t/(1 − saving_k)). Configuration 0 is the reference.
    n_seeds: S. n_sims: N draws. rng: numpy Generator.

  Returns:
    acc [N, K, S, E] float64.
  """
  t = np.asarray(tokens_e, np.float64)
  k = len(savings_k)
  mean_ke = np.stack([curve(t / (1.0 - s)) for s in savings_k])
  shape = (n_sims, k, n_seeds)
  u = rng.normal(0.0, noise.seed, (n_sims, 1, n_seeds, 1))
  v = rng.normal(0.0, noise.run, shape + (1,))
  e = rng.normal(0.0, noise.jitter, shape + (len(t),))
  acc = mean_ke[None, :, None, :] + u + v + e
  acc[..., 0] = mean_ke[None, :, None, 0] + u[..., 0] + rng.normal(
      0.0, noise.jitter, (n_sims, 1, n_seeds))
  return acc


def _first_raw(tokens_e: np.ndarray, acc: np.ndarray, target: np.ndarray) -> np.ndarray:
  """Tokens at the first evaluation >= target (no interpolation); +inf if none. [...]."""
  mask = acc >= target[..., None]
  i = mask.argmax(-1)
  return np.where(mask.any(-1), tokens_e[i], np.inf)


def _first_interp(tokens_e: np.ndarray, acc: np.ndarray, target: np.ndarray) -> np.ndarray:
  """``stats.first_crossing`` over leading axes: acc [..., E], target [...] -> [...]."""
  mask = acc >= target[..., None]
  i = mask.argmax(-1)
  j = np.maximum(i - 1, 0)
  a_i = np.take_along_axis(acc, i[..., None], -1)[..., 0]
  a_j = np.take_along_axis(acc, j[..., None], -1)[..., 0]
  step = np.where(a_i != a_j, a_i - a_j, 1.0)
  f = np.where((i > 0) & (a_i != a_j), (target - a_j) / step, 1.0)
  t = tokens_e[j] + f * (tokens_e[i] - tokens_e[j])
  return np.where(mask.any(-1), np.where(i > 0, t, tokens_e[i]), np.inf)


def _p_min(d_nks: np.ndarray) -> np.ndarray:
  """The smallest one-sided t p-value over k: [N, K, S] -> [N] (NaN p-values as 1)."""
  p = stats.t_pvalue_greater(d_nks)
  return np.min(np.where(np.isnan(p), 1.0, p), -1)


def decide_t(d_ks: np.ndarray, alpha: float = ALPHA, correct: bool = True) -> np.ndarray:
  """"At least one of K per-seed differences is above 0": one-sided t tests, each at
  α/K (``correct``) or α. d [..., K, S] -> bool [...]."""
  d = np.asarray(d_ks, np.float64)
  return _p_min(d) < alpha / (d.shape[-2] if correct else 1)


def rule_first_crossing(tokens_e, acc_nkse, last: int = 3):
  """The old rule: a buffer's median (over seeds) tokens to the first raw evaluation >= the
  reference's median final accuracy (its last ``last`` evaluations) is below the
  reference's median."""
  target_n = np.median(acc_nkse[:, 0, :, -last:].mean(-1), -1)
  reach = _first_raw(tokens_e, acc_nkse, target_n[:, None, None])
  ref = np.median(reach[:, 0], -1)
  ok = (ref > 0) & np.isfinite(ref)
  pct = np.median(reach[:, 1:], -1) / np.where(ok, ref, 1.0)[:, None]
  return ok & (np.min(pct, -1) < 1.0)


def rule_smoothed_crossing(tokens_e, acc_nkse):
  """A buffer's median ratio of tokens to reach the reference's smoothed final accuracy
  (per seed, smoothed curves, interpolated crossings) over the reference's is below 1."""
  sm = stats.smooth(acc_nkse)
  reach = _first_interp(tokens_e, sm, sm[:, 0:1, :, -1] * np.ones(sm.shape[1])[:, None])
  with np.errstate(divide="ignore", invalid="ignore"):  # inf/inf: neither reached
    ratio = reach[:, 1:] / reach[:, 0:1]
  return np.min(np.median(ratio, -1), -1) < 1.0


def _auc(tokens_e, acc_nkse):
  return acc_nkse @ stats.auc_weights(tokens_e, float(tokens_e[-1]))


def rule_auc(tokens_e, acc_nkse, correct: bool = True):
  """A buffer's per-seed AUC difference from the reference is above 0 (paired t)."""
  a = _auc(tokens_e, acc_nkse)
  return decide_t(a[:, 1:] - a[:, :1], correct=correct)


def rule_final(tokens_e, acc_nkse):
  """A buffer's per-seed smoothed accuracy at the budget is above the reference's (paired
  t, Bonferroni)."""
  f = stats.smooth(acc_nkse)[..., -1]
  return decide_t(f[:, 1:] - f[:, :1])


def rule_auto_short(tokens_e, acc_nkse, correct: bool = True):
  """Self-tuning (the last configuration) falls short of the best of the others (the
  highest mean AUC): best − self-tuning above 0, paired t at α/(K − 1) (``correct``)."""
  a = _auc(tokens_e, acc_nkse)
  cand, auto = a[:, :-1], a[:, -1]
  best = np.take_along_axis(cand, cand.mean(-1).argmax(-1)[:, None, None], 1)[:, 0]
  p = stats.t_pvalue_greater(best - auto)
  return np.where(np.isnan(p), 1.0, p) < ALPHA / (cand.shape[1] if correct else 1)


@dataclasses.dataclass(frozen=True)
class Rule:
  """A decision rule: ``fires(tokens_e, acc [N, K, S, E]) -> bool [N]``, configuration 0 the
  reference (for ``auto_short``: the last one is the self-tuning buffer)."""

  name: str
  text: str
  fires: Callable


RULES = {r.name: r for r in (
    Rule("first_crossing", "a buffer's median tokens to the first evaluation at on-policy's "
         "median final accuracy is below on-policy's (the old rule)", rule_first_crossing),
    Rule("smoothed_crossing", "a buffer's median ratio of tokens to reach on-policy's smoothed "
         "final accuracy, smoothed curves, is below 1", rule_smoothed_crossing),
    Rule("auc_uncorrected", "a buffer's AUC is above on-policy's, paired t at 5% for each "
         "buffer (best of k)", lambda t, a: rule_auc(t, a, correct=False)),
    Rule("auc_bonferroni", "a buffer's AUC is above on-policy's, paired t at 5%/k",
         rule_auc),
    Rule("final_bonferroni", "a buffer's smoothed accuracy at the budget is above "
         "on-policy's, paired t at 5%/k", rule_final),
    Rule("auto_short_uncorrected", "self-tuning's AUC is below the best fixed "
         "configuration's (highest mean AUC, on-policy included), paired t at 5%",
         lambda t, a: rule_auto_short(t, a, correct=False)),
    Rule("auto_short", "self-tuning's AUC is below the best fixed configuration's "
         "(highest mean AUC, on-policy included), paired t at 5%/k", rule_auto_short),
)}


def rate(rule: Rule, noise: NoiseModel, curve: Callable, savings_k: Sequence[float],
         n_seeds: int, n_sims: int = 4000, seed: int = 0,
         tokens_e: np.ndarray = EVAL_GRID, chunk: int = 2000) -> float:
  """The share of ``n_sims`` simulated studies (``simulate``) in which ``rule`` fires.

  Args:
    rule: a ``Rule``. noise, curve, savings_k, n_seeds: as ``simulate`` (all savings 0: the
      false-positive rate). n_sims: draws (the rate's SD is √(r(1 − r)/n_sims)). seed: the
      generator's seed. tokens_e: evaluation tokens (default: step 0 and every 1/12 of the
      budget, as the study's runs). chunk: draws per batch (memory).

  Returns:
    A float in [0, 1].
  """
  rng = np.random.default_rng(seed)
  t = np.asarray(tokens_e, np.float64)
  hits = 0
  for start in range(0, n_sims, chunk):
    n = min(chunk, n_sims - start)
    hits += int(np.sum(rule.fires(t, simulate(noise, curve, t, savings_k, n_seeds, n, rng))))
  return hits / n_sims


def savings_one(n_configs: int, saving: float, at: int = 1) -> list[float]:
  """[0, …, saving at index ``at``, …, 0] of length ``n_configs``: one configuration saves."""
  return [saving if i == at else 0.0 for i in range(n_configs)]


def seeds_for_power(rule: Rule, noise: NoiseModel, curve: Callable, savings_k: Sequence[float],
                    power: float = POWER, start: int = 3, max_seeds: int = 64,
                    n_sims: int = 2000, seed: int = 0) -> int | None:
  """The fewest seeds (>= ``start``) at which ``rule`` fires with rate >= ``power`` under
  ``savings_k``; None when ``max_seeds`` is not enough. Doubles, then bisects (the rate
  grows with the seeds)."""
  ok = lambda s: rate(rule, noise, curve, savings_k, s, n_sims, seed) >= power  # noqa: E731
  if ok(start):
    return start
  lo, hi = start, start
  while not ok(hi):
    lo, hi = hi, hi * 2
    if hi > max_seeds:
      return None if not ok(max_seeds) else _bisect(ok, lo, max_seeds)
  return _bisect(ok, lo, hi)


def _bisect(ok, lo: int, hi: int) -> int:
  """The smallest s in (lo, hi] with ok(s), given not ok(lo) and ok(hi)."""
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if ok(mid) else (mid, hi)
  return hi


# --- what a study can resolve -------------------------------------------------------------

def auc_difference_sd(noise: NoiseModel, tokens_e: np.ndarray = EVAL_GRID) -> float:
  """SD of one seed's AUC difference between two runs under the model: √(2(run² + jitter²
  Σ_{e>=1} w_e²)), w the AUC's weights (the shared step-0 evaluation and u_s cancel)."""
  t = np.asarray(tokens_e, np.float64)
  w = stats.auc_weights(t, float(t[-1]))
  return math.sqrt(2 * (noise.run ** 2 + noise.jitter ** 2 * float(np.sum(w[1:] ** 2))))


def detectable_difference(sd_d: float, n_seeds: int, n_tests: int = 1, alpha: float = ALPHA,
                          power: float = POWER) -> float:
  """The smallest mean difference a one-sided paired t test at α/n_tests detects with
  ``power``: δ with P(noncentral t_{S−1}(δ√S/sd) > t_{1−α/n_tests, S−1}) = power.

  Raises:
    ValueError: n_seeds < 2 or sd_d <= 0.
  """
  if n_seeds < 2 or not sd_d > 0:
    raise ValueError(f"need n_seeds={n_seeds} >= 2 and sd_d={sd_d} > 0")
  df = n_seeds - 1
  crit = sps.t.ppf(1 - alpha / n_tests, df)
  f = lambda d: sps.nct.sf(crit, df, d * math.sqrt(n_seeds) / sd_d) - power  # noqa: E731
  return float(optimize.brentq(f, 0.0, 100 * sd_d))


def auc_gain(curve: Callable, saving: float, tokens_e: np.ndarray = EVAL_GRID) -> float:
  """AUC of f(t/(1 − saving)) minus f's, both evaluated at ``tokens_e`` (accuracy units)."""
  t = np.asarray(tokens_e, np.float64)
  w = stats.auc_weights(t, float(t[-1]))
  return float(w @ curve(t / (1 - saving)) - w @ curve(t))


def saving_for_gain(curve: Callable, gain: float, tokens_e: np.ndarray = EVAL_GRID,
                    max_saving: float = 0.95) -> float:
  """The token saving whose ``auc_gain`` is ``gain``; NaN when even ``max_saving`` gains less
  (the curve is too flat for the difference to come from a saving)."""
  g = lambda s: auc_gain(curve, s, tokens_e) - gain  # noqa: E731
  if g(max_saving) < 0:
    return float("nan")
  if g(0.0) >= 0:
    return 0.0
  return float(optimize.brentq(g, 0.0, max_saving))
