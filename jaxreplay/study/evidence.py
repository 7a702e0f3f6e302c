"""What a regime's runs support: paired comparisons, saturating fits, the noise model and
the decision rules' rates on it, and the theory's y* against the runs re-scored on compute.

Every number comes from ``jaxreplay.study.stats`` / ``fit`` / ``null`` applied to the runs'
curves (``runs.RunData.curve``: generated tokens, held-out sampled accuracy). The budget of
seed s is its on-policy run's generated tokens (every run of a regime spends the same).

  * ``compare``: configuration a against b, seed by seed — AUC over the log-token axis up
    to the budget, smoothed accuracy at ``FRACTIONS`` of it, and tokens to reach b's smoothed
    accuracy at the budget over b's own (smoothed curves, interpolated crossings).
  * ``regime_evidence``: every configuration against on-policy and against the best fixed
    configuration (highest mean AUC among on-policy and the fixed buffers); the decisions
    "replay pays" (``null.RULES["auc_bonferroni"]``) and "self-tuning falls short of the best
    fixed" (``null.RULES["auto_short"]``); a saturating fit per configuration.
  * ``rule_table``: each rule's false-positive rate and power, simulated with the noise model
    fitted to all regimes' runs and each regime's on-policy mean curve.
  * ``y_star_checks``: the runs re-scored on C = K_train + μ·K_inf (the theory's (B + μR)·T)
    at each μ of ``MUS``; the best replay ratio y and the y's not shown worse than it, beside
    the theory's y*(μ) at the regime's measured α, ρ.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from jaxreplay import theory
from jaxreplay.study import fit, null, stats

FRACTIONS = (0.25, 0.5, 1.0)   # accuracy compared at these fractions of the budget
MUS = (1.0, 2.0, 5.3, 10.0)    # μ at which the runs are re-scored against the theory's y*
FIT_BOOT = 200                 # seed-bootstrap resamples of each saturating fit


def theory_design(mu: float, alpha: float, rho: float, x_bounds: Sequence[float],
                  y_bounds: Sequence[float]) -> tuple[float, float]:
  """(x*, y*) of the power-law bound at measured constants (paper App. 9.3.2, Thm 4.5).

  Args:
    mu: μ > 0. alpha: α (clipped to >= 0). rho: ρ (clipped to [0, 1]).
    x_bounds, y_bounds: (lo, hi) of the staleness horizon x = N/R (learner steps) and the
      replay ratio y = B/R.

  Returns:
    (x*, y*) floats, or two NaNs when a constant is NaN or μ <= 0.
  """
  if not (mu > 0 and alpha == alpha and rho == rho):
    return float("nan"), float("nan")
  return theory.power_law_design_bounded(mu, min(max(rho, 0.0), 1.0), max(alpha, 0.0),
                                         tuple(x_bounds), tuple(y_bounds))


def round_design(x: float, y: float) -> tuple[int, int]:
  """The grid point nearest (x*, y*): y to the nearest power of two (log scale), x to the
  nearest whole number of learner steps, at least y (the trainer needs N >= B).

  Returns:
    (x, y) ints; (1, 1) is on-policy. Raises ValueError on NaN input.
  """
  if not (x == x and y == y):
    raise ValueError(f"cannot round a NaN design (x={x}, y={y})")
  yr = 2 ** max(0, round(math.log2(max(y, 1.0))))
  return max(int(round(x)), yr, 1), yr


# --- comparisons --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConfigComparison:
  """Configuration ``name`` against ``against``, seed by seed.

  Attributes:
    auc: ``stats.Comparison`` of the log-token AUC (accuracy units).
    at: {fraction of the budget: ``stats.Comparison`` of the smoothed accuracy there}.
    tokens: ``stats.Ratio`` of tokens to reach ``against``'s smoothed accuracy at the budget
      over ``against``'s own (NaN for a seed where ``against`` starts at or above it).
  """

  name: str
  against: str
  auc: stats.Comparison
  at: dict
  tokens: stats.Ratio


def by_seed(runs) -> dict:
  """{seed: run} of a list of ``RunData``."""
  return {r.seed: r for r in runs}


def compare(name: str, runs_a, against: str, runs_b, budget_s: Mapping[int, float],
            seed: int = 0) -> ConfigComparison | None:
  """``ConfigComparison`` of runs ``runs_a`` against ``runs_b`` (lists of ``RunData``) on the
  seeds both have and ``budget_s`` names; None when they share fewer than 1 seed."""
  a, b = by_seed(runs_a), by_seed(runs_b)
  seeds = sorted(set(a) & set(b) & set(budget_s))
  if not seeds:
    return None
  ca = {s: a[s].curve() for s in seeds}
  cb = {s: b[s].curve() for s in seeds}
  auc = [[float(stats.log_auc(*c[s], budget_s[s])) for s in seeds] for c in (ca, cb)]
  sm = lambda c, s: (c[s][0], stats.smooth(c[s][1]))  # noqa: E731
  at = {}
  for f in FRACTIONS:
    va, vb = ([float(stats.at(*sm(c, s), f * budget_s[s])) for s in seeds] for c in (ca, cb))
    at[f] = stats.paired(va, vb, seed=seed)
  ratio = []
  for s in seeds:
    target = float(stats.at(*sm(cb, s), budget_s[s]))
    tb = stats.first_crossing(*sm(cb, s), target)
    ta = stats.first_crossing(*sm(ca, s), target)
    ratio.append(ta / tb if tb > 0 else float("nan"))
  return ConfigComparison(name, against, stats.paired(*auc, seed=seed), at,
                          stats.ratio_summary(ratio, seed=seed))


# --- one regime ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RegimeEvidence:
  """A regime's comparisons, decisions and fits.

  Attributes:
    reference: the on-policy configuration. budget_s: {seed: its generated tokens}.
    vs_reference: {configuration: ``ConfigComparison`` against on-policy} (on-policy left out).
    best_fixed: the highest mean AUC among on-policy and the fixed buffers.
    vs_best: {configuration: ``ConfigComparison`` against ``best_fixed``}.
    buffers: the fixed and self-tuning configurations, sweep order.
    pays: "replay pays" fired (``null.RULES["auc_bonferroni"]``); lead: the buffer with
      the smallest p-value, the one the rule is decided on (None without a test).
    auto: the self-tuning configuration or None;
    auto_short: "self-tuning falls short of the best fixed" fired (None without one).
    fits: {configuration: ``fit.SaturatingFit`` on tokens / budget, or None}.
  """

  reference: str
  budget_s: dict
  vs_reference: dict
  best_fixed: str
  vs_best: dict
  buffers: tuple
  pays: bool
  lead: str | None
  auto: str | None
  auto_short: bool | None
  fits: dict

  @property
  def n_tests(self) -> int:
    return len(self.buffers)


def _mean_auc(runs, budget_s) -> float:
  v = [float(stats.log_auc(*r.curve(), budget_s[r.seed])) for r in runs if r.seed in budget_s]
  return float(np.mean(v)) if v else -math.inf


def regime_evidence(runs: Mapping[str, list], roles: Mapping[str, str], reference: str,
                    seed: int = 0, n_boot: int = FIT_BOOT) -> RegimeEvidence:
  """``RegimeEvidence`` of one regime.

  Args:
    runs: {configuration: [RunData]} (sweep order). roles: {configuration: "onpolicy" |
      "fixed" | "auto"}. reference: the on-policy configuration (it has runs).
    seed: the bootstraps' generator seed. n_boot: resamples of each fit.

  Raises:
    ValueError: the reference has no runs.
  """
  if not runs.get(reference):
    raise ValueError(f"the reference {reference!r} has no runs")
  budget_s = {r.seed: float(r.curve()[0][-1]) for r in runs[reference]}
  present = [n for n in runs if runs[n]]
  vs_ref = {n: compare(n, runs[n], reference, runs[reference], budget_s, seed)
            for n in present if n != reference}
  cands = [n for n in present if roles.get(n) in ("onpolicy", "fixed")]
  best = max(cands, key=lambda n: _mean_auc(runs[n], budget_s))
  vs_best = {n: compare(n, runs[n], best, runs[best], budget_s, seed)
             for n in present if n != best}
  buffers = tuple(n for n in present if roles.get(n) in ("fixed", "auto"))
  pays, lead = _decide_pays(vs_ref, buffers)
  autos = [n for n in present if roles.get(n) == "auto"]
  auto = autos[0] if autos else None
  short = None
  if auto is not None and vs_best.get(auto) is not None:
    d = -np.asarray(vs_best[auto].auc.diff_s)[None, :]
    short = bool(null.decide_t(d, alpha=null.ALPHA / len(cands), correct=False))
  return RegimeEvidence(reference, budget_s, vs_ref, best, vs_best, buffers, pays, lead,
                        auto, short, {n: _fit(runs[n], budget_s, seed, n_boot) for n in present})


def _decide_pays(vs_ref: Mapping, buffers: Sequence[str]) -> tuple[bool, str | None]:
  """(fired, lead): ``null.decide_t`` on the buffers' AUC differences (Bonferroni over the
  buffers), lead the buffer with the smallest one-sided p-value."""
  comps = [vs_ref[n] for n in buffers if vs_ref.get(n) is not None and vs_ref[n].auc.n >= 2]
  if not comps:
    return False, None
  p = [c.auc.p_value if c.auc.p_value == c.auc.p_value else 1.0 for c in comps]
  i = int(np.argmin(p))
  return p[i] < null.ALPHA / len(buffers), comps[i].name


def _fit(runs, budget_s, seed: int, n_boot: int) -> fit.SaturatingFit | None:
  curves = [(r.curve()[0] / budget_s[r.seed], r.curve()[1]) for r in runs if r.seed in budget_s]
  try:
    return fit.fit_seeds(curves, n_boot=n_boot, seed=seed)
  except (ValueError, RuntimeError):
    return None


# --- the decision rules' rates ------------------------------------------------------------

USED = {"auc_bonferroni": "replay pays", "auto_short": "self-tuning falls short"}


@dataclasses.dataclass(frozen=True)
class RuleRates:
  """One rule's simulated rates at the study's design.

  Attributes:
    rule: the ``null.Rule``. fpr: {regime: false-positive rate}. power: {regime: rate with
    one configuration saving ``null.SAVING`` of the tokens}. seeds_needed: {regime: fewest
    seeds for ``null.POWER``, None above 64} (used rules only). used: what the report
    decides with it ("" when it is not used).
  """

  rule: null.Rule
  fpr: dict
  power: dict
  seeds_needed: dict
  used: str

  @property
  def fpr_max(self) -> float:
    return max(self.fpr.values()) if self.fpr else float("nan")


def mean_curve(runs) -> callable:
  """The saturating curve fitted to runs (tokens / budget -> accuracy), or their mean
  curve interpolated when the fit fails."""
  budget = float(np.median([r.curve()[0][-1] for r in runs]))
  curves = [(r.curve()[0] / budget, r.curve()[1]) for r in runs]
  try:
    f = fit.fit_seeds(curves, n_boot=0)
    return lambda t: fit.saturating(t, f.r0, f.a, f.b, f.c_mid)
  except (ValueError, RuntimeError):
    grid = null.EVAL_GRID
    m = np.mean([np.interp(grid, *c) for c in curves], 0)
    return lambda t: np.interp(t, grid, m)


def rule_table(noise: null.NoiseModel, curves: Mapping[str, callable],
               n_buffers: int | Mapping[str, int], n_seeds: int | Mapping[str, int],
               n_sims: int = 4000, seed: int = 0) -> list[RuleRates]:
  """``RuleRates`` of every rule of ``null.RULES`` per regime's mean curve (``curves``:
  {regime: f}) at its ``n_buffers`` buffers and ``n_seeds`` seeds (one int for every
  regime, or {regime: int}); ``n_sims`` simulated studies per rate (half that per step of
  the search for the seeds a used rule needs)."""
  nb = n_buffers if isinstance(n_buffers, Mapping) else {g: n_buffers for g in curves}
  ns = n_seeds if isinstance(n_seeds, Mapping) else {g: n_seeds for g in curves}
  out = []
  for name, rule in null.RULES.items():
    fpr, power, need = {}, {}, {}
    for g, f in curves.items():
      k, n = nb[g] + 1, ns[g]
      fpr[g] = null.rate(rule, noise, f, [0.0] * k, n, n_sims, seed)
      power[g] = null.rate(rule, noise, f, null.savings_one(k, null.SAVING), n, n_sims, seed)
      if name in USED:
        need[g] = null.seeds_for_power(rule, noise, f, null.savings_one(k, null.SAVING),
                                       start=n, n_sims=max(n_sims // 2, 1), seed=seed)
    out.append(RuleRates(rule, fpr, power, need, USED.get(name, "")))
  return out


# --- the theory's y* against the runs on the compute axis ---------------------------------

@dataclasses.dataclass(frozen=True)
class YStarCheck:
  """At one μ: the theory's y* beside the runs' best y.

  Attributes:
    mu: μ. theory_y: the theory's y* at the regime's α, ρ (NaN when unknown). theory_grid:
    the regime's grid y nearest it (log scale). grid: the y's the regime ran (sorted).
    best: the configuration with the highest mean AUC on the compute axis; best_y its y.
    ys: the y's of the configurations not shown worse than ``best`` (paired t, one-sided,
    5%/(n − 1)), ``best_y`` included. predicted: the y the sweep file registered for this
    μ before the runs (``report.y_star_test``; NaN when none).
  """

  mu: float
  theory_y: float
  theory_grid: float
  grid: tuple
  best: str
  best_y: float
  ys: tuple
  predicted: float = float("nan")

  @property
  def informative(self) -> bool:
    """Whether the runs exclude some y of the grid (else they cannot tell)."""
    return set(self.ys) != set(self.grid)

  @property
  def agree(self) -> bool:
    """The theory's grid y is among the y's not shown worse, and the runs excluded some."""
    return self.informative and self.theory_grid in self.ys

  @property
  def registered(self) -> bool:
    """Whether a prediction was registered for this μ before the runs."""
    return self.predicted == self.predicted

  @property
  def agree_predicted(self) -> bool:
    """The registered y is among the y's not shown worse, and the runs excluded some."""
    return self.registered and self.informative and self.predicted in self.ys


def best_y_rises(checks: Sequence[YStarCheck]) -> bool:
  """Whether the best y never falls as μ grows (the theory's y*(μ) is non-decreasing,
  paper App. 9.3.2), over ``checks`` sorted by μ."""
  ys = [c.best_y for c in sorted(checks, key=lambda c: c.mu)]
  return all(b >= a for a, b in zip(ys, ys[1:]))


def y_star_checks(runs: Mapping[str, list], roles: Mapping[str, str], reference: str,
                  y_of: Mapping[str, float], alpha: float, rho: float,
                  x_bounds: Sequence[float], y_bounds: Sequence[float],
                  mus: Sequence[float] = MUS,
                  predicted: Sequence[float] | None = None) -> list[YStarCheck]:
  """``YStarCheck`` per μ of ``mus`` over on-policy and the fixed buffers (the self-tuning
  buffer changes y as it runs, so it has no one y).

  AUC on the compute axis: ``stats.log_auc`` of each run's ``cost_curve(μ)`` up to the
  seed's on-policy run's C (the least of a seed's runs: every run generates as much, and
  a buffer trains more).

  Args:
    runs, roles, reference: as ``regime_evidence``. y_of: {configuration: y = B/R}.
    alpha, rho: the regime's measured constants. x_bounds, y_bounds: the theory's box.
    mus: the μ's. predicted: the y registered per μ before the runs, or None.

  Returns:
    One check per μ ([] with fewer than 2 configurations or 2 seeds).

  Raises:
    ValueError: ``predicted`` not one y per μ.
  """
  if predicted is not None and len(predicted) != len(mus):
    raise ValueError(f"report.y_star_test predicted: one y per μ of {tuple(mus)}, got "
                     f"{tuple(predicted)}")
  cands = [n for n in runs if runs[n] and roles.get(n) in ("onpolicy", "fixed")]
  seeds = sorted(set.intersection(*(set(by_seed(runs[n])) for n in cands))) if cands else []
  if len(cands) < 2 or len(seeds) < 2:
    return []
  grid = tuple(sorted({float(y_of[n]) for n in cands}))
  out = []
  for i, mu in enumerate(mus):
    ref = by_seed(runs[reference])
    budget = {s: float(ref[s].cost_curve(mu)[0][-1]) for s in seeds}
    auc = {n: np.array([float(stats.log_auc(*by_seed(runs[n])[s].cost_curve(mu), budget[s]))
                        for s in seeds]) for n in cands}
    best = max(cands, key=lambda n: auc[n].mean())
    others = [n for n in cands if n != best]
    worse = {n for n in others
             if null.decide_t((auc[best] - auc[n])[None, :], null.ALPHA / len(others), False)}
    ys = tuple(sorted({float(y_of[n]) for n in cands if n not in worse}))
    ty = theory_design(mu, alpha, rho, x_bounds, y_bounds)[1]
    tg = min(grid, key=lambda y: abs(math.log2(y) - math.log2(ty))) if ty == ty else float("nan")
    pred = float(predicted[i]) if predicted is not None else float("nan")
    out.append(YStarCheck(mu, ty, tg, grid, best, float(y_of[best]), ys, pred))
  return out
