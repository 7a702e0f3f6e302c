"""Paired comparisons of learning curves over seeds, with intervals.

A *curve* is one run's held-out evaluations: ``tokens_e`` (float64 [E], generated tokens at
each evaluation, non-decreasing, step 0 at 0) and ``acc_e`` (float64 [E], sampled accuracy
in [0, 1]). Runs of one seed share the warm-started policy, so a configuration is compared
with a reference seed by seed (``paired``): the differences d_s cancel what a seed's
configurations share, and the statistics are over the S per-seed differences.

Summaries of one curve, each a float in accuracy units unless said otherwise:

  * ``log_auc``: the mean accuracy over the log-token axis from ``LO_FRAC``·budget to the
    budget (the reference's generated tokens), the curve interpolated linearly between
    evaluations; it rewards reaching an accuracy with fewer tokens at every scale.
  * ``smooth`` then ``at``: the accuracy at a fraction of the budget from the curve averaged
    over neighbouring evaluations (one evaluation's jitter is about as large as the
    differences studied; a first crossing of a raw curve is mostly a crossing of its noise).
  * ``first_crossing``: tokens at which a (smoothed) curve first reaches a target.

Intervals (``LEVEL`` = 95%): Student's t over seeds (``t_interval``; exact for normal
per-seed differences, the decision rules use it) and the seed bootstrap's percentile interval
(``bootstrap_interval``, ``scipy.stats.bootstrap``; Efron & Tibshirani 1993 §13). With 3
seeds the bootstrap has 10 distinct resamples and covers far below its nominal rate
(tests/test_study_stats.py measures it), so it is printed beside the t interval, never used
alone. Probability of improvement (Agarwal et al. 2021, "Deep RL at the edge of the
statistical precipice", §4.3): the share of seeds on which the configuration beats the
reference (ties count half). rliable (their library) computes it by Mann–Whitney over all
pairs of runs, which ignores the pairing by seed, and its stratified bootstrap stratifies
over tasks, of which a comparison here has one; it also needs arch, pandas and seaborn. So
both are computed here with scipy (``probability_of_improvement(paired=False)`` is rliable's
definition).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Sequence

import numpy as np
from scipy import stats as sps

LEVEL = 0.95       # two-sided level of every interval
LO_FRAC = 0.125    # the log-token axis starts at 1/8 of the budget (3 doublings)
N_GRID = 97        # points of the log-token grid (32 per doubling)
HALF_WIDTH = 1     # smoothing: the mean over an evaluation and 1 neighbour each side
INF = float("inf")


# --- quantiles (the seeds' spread) --------------------------------------------------------

def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
  """(q25, median, q75) of ``values`` with linear interpolation; +inf allowed.

  Interpolating towards +inf gives +inf (so the median of [1, inf, inf] is inf and of
  [1, 2, inf] is 2). NaNs are dropped. Empty input: three NaNs.
  """
  v = sorted(float(x) for x in values if not (isinstance(x, float) and math.isnan(x)))
  if not v:
    return (float("nan"),) * 3

  def q(p):
    pos = p * (len(v) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    if lo == hi or v[lo] == v[hi]:
      return v[lo]
    if math.isinf(v[hi]):
      return INF
    return v[lo] + (pos - lo) * (v[hi] - v[lo])

  return q(0.25), q(0.5), q(0.75)


def verdict(a: Sequence[float], b: Sequence[float], expect: str) -> str:
  """The interquartile-range rule: ``expect`` "higher" (A > B) or "lower" (A < B).

  Returns:
    "supported" when A's [q25, q75] lies strictly on the expected side of B's,
    "contradicted" when strictly on the other side, else "cannot tell" (also when either
    side has no finite or infinite value).

  Raises:
    ValueError: ``expect`` not in ("higher", "lower").
  """
  if expect not in ("higher", "lower"):
    raise ValueError(f"expect={expect!r} must be 'higher' or 'lower'")
  qa, qb = quantiles(a), quantiles(b)
  if any(math.isnan(x) for x in qa + qb):
    return "cannot tell"
  above, below = qa[0] > qb[2], qa[2] < qb[0]
  if expect == "lower":
    above, below = below, above
  return "supported" if above else "contradicted" if below else "cannot tell"


# --- one curve ----------------------------------------------------------------------------

def _check_curve(tokens_e: np.ndarray, acc_e: np.ndarray) -> None:
  if tokens_e.ndim != 1 or tokens_e.shape != acc_e.shape[-1:] or len(tokens_e) < 1:
    raise ValueError(f"a curve needs tokens [E] and accuracies [..., E], E >= 1 (got "
                     f"{tokens_e.shape} and {acc_e.shape})")
  if np.any(np.diff(tokens_e) < 0):
    raise ValueError("a curve's tokens must be non-decreasing")


def smooth(acc_e: np.ndarray, half_width: int = HALF_WIDTH, hold_first: bool = True) -> np.ndarray:
  """The moving mean over each evaluation and ``half_width`` neighbours each side.

  Args:
    acc_e: float [..., E] accuracies in evaluation order (leading axes: independent curves).
    half_width: int >= 0; the window is cut at the curve's ends (the last evaluation
      averages 1 + half_width values).
    hold_first: keep the first evaluation as it is and smooth the rest among themselves
      (the first is step 0, the warm start every run of a seed shares: averaging it with
      the first trained evaluation would let a run "reach" a target at no cost).

  Returns:
    float64 [..., E].

  Raises:
    ValueError: ``half_width`` < 0.
  """
  if half_width < 0:
    raise ValueError(f"half_width={half_width} must be >= 0")
  a = np.asarray(acc_e, np.float64)
  if hold_first and a.shape[-1] > 1:
    return np.concatenate([a[..., :1], smooth(a[..., 1:], half_width, False)], -1)
  e = a.shape[-1]
  c = np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, -1)], -1)
  lo = np.clip(np.arange(e) - half_width, 0, e)
  hi = np.clip(np.arange(e) + half_width + 1, 0, e)
  return (c[..., hi] - c[..., lo]) / (hi - lo)


def interp_weights(tokens_e: np.ndarray, t_q: np.ndarray) -> np.ndarray:
  """The matrix W [Q, E] with W @ acc_e = the curve linearly interpolated at ``t_q``.

  Outside [tokens_e[0], tokens_e[-1]] the curve is held at its end values (a run that
  stopped a few tokens short of the budget is read at its last evaluation). Linear in
  ``acc_e``, so one W serves every curve evaluated at the same tokens.

  Args:
    tokens_e: float [E], non-decreasing. t_q: float [Q] query tokens.

  Returns:
    float64 [Q, E], rows summing to 1.
  """
  x = np.asarray(tokens_e, np.float64)
  q = np.clip(np.asarray(t_q, np.float64), x[0], x[-1])
  w = np.zeros((len(q), len(x)))
  j = np.clip(np.searchsorted(x, q, side="right") - 1, 0, len(x) - 1)
  for i, (qi, ji) in enumerate(zip(q, j)):
    if ji == len(x) - 1 or x[ji + 1] == x[ji]:
      w[i, ji] = 1.0
    else:
      f = (qi - x[ji]) / (x[ji + 1] - x[ji])
      w[i, ji], w[i, ji + 1] = 1.0 - f, f
  return w


def at(tokens_e: np.ndarray, acc_e: np.ndarray, t: float) -> np.ndarray:
  """The curve (linearly interpolated, held at its ends) at ``t`` tokens; float [...]."""
  x = np.asarray(tokens_e, np.float64)
  a = np.asarray(acc_e, np.float64)
  _check_curve(x, a)
  return a @ interp_weights(x, np.array([t]))[0]


def log_grid(budget: float, lo_frac: float = LO_FRAC, n_grid: int = N_GRID) -> np.ndarray:
  """``n_grid`` log-spaced token counts from ``lo_frac``·budget to ``budget``; float64.

  Raises:
    ValueError: budget <= 0, lo_frac not in (0, 1) or n_grid < 2.
  """
  if not budget > 0 or not 0 < lo_frac < 1 or n_grid < 2:
    raise ValueError(f"need budget={budget} > 0, 0 < lo_frac={lo_frac} < 1, n_grid={n_grid} >= 2")
  return np.geomspace(lo_frac * budget, budget, n_grid)


def auc_weights(tokens_e: np.ndarray, budget: float, lo_frac: float = LO_FRAC,
                n_grid: int = N_GRID) -> np.ndarray:
  """w [E] with w @ acc_e = ``log_auc`` (trapezoids on the log grid); sums to 1."""
  g = log_grid(budget, lo_frac, n_grid)
  lg = np.log(g)
  trap = np.zeros(n_grid)
  trap[:-1] += np.diff(lg) / 2
  trap[1:] += np.diff(lg) / 2
  return (trap / (lg[-1] - lg[0])) @ interp_weights(tokens_e, g)


def log_auc(tokens_e: np.ndarray, acc_e: np.ndarray, budget: float,
            lo_frac: float = LO_FRAC, n_grid: int = N_GRID) -> np.ndarray:
  """Mean accuracy over the log-token axis, (1/ln(1/lo_frac)) ∫ acc(t) d ln t on
  [lo_frac·budget, budget], the curve linearly interpolated between evaluations.

  Args:
    tokens_e: float [E] generated tokens per evaluation, non-decreasing.
    acc_e: float [..., E] accuracies (leading axes: curves at the same tokens).
    budget: tokens (> 0), the reference's generated tokens.
    lo_frac, n_grid: the grid (``log_grid``).

  Returns:
    float64 [...], accuracy units (a curve constant at a has AUC a).

  Raises:
    ValueError: a malformed curve or grid.
  """
  x = np.asarray(tokens_e, np.float64)
  a = np.asarray(acc_e, np.float64)
  _check_curve(x, a)
  return a @ auc_weights(x, budget, lo_frac, n_grid)


def first_crossing(tokens_e: np.ndarray, acc_e: np.ndarray, target: float) -> float:
  """Tokens at which the linearly interpolated curve first reaches ``target``.

  Args:
    tokens_e: float [E]. acc_e: float [E] (smooth it first: ``smooth``). target: accuracy.

  Returns:
    Tokens (float, interpolated between the evaluations around the crossing; the first
    evaluation's tokens when it already reaches it); +inf when no evaluation reaches it.

  Raises:
    ValueError: a malformed curve.
  """
  x = np.asarray(tokens_e, np.float64)
  a = np.asarray(acc_e, np.float64)
  _check_curve(x, a)
  if a.ndim != 1:
    raise ValueError(f"first_crossing takes one curve (got accuracies {a.shape})")
  hit = np.nonzero(a >= target)[0]
  if not len(hit):
    return INF
  i = int(hit[0])
  if i == 0 or a[i] == a[i - 1]:
    return float(x[i])
  f = (target - a[i - 1]) / (a[i] - a[i - 1])
  return float(x[i - 1] + f * (x[i] - x[i - 1]))


# --- intervals over seeds -----------------------------------------------------------------

def t_interval(x_s: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
  """Student's t interval for the mean of ``x_s`` (float [S]): mean ± t_{(1+level)/2, S−1}
  · sd/√S. (NaN, NaN) for S < 2 or non-finite values."""
  x = np.asarray(x_s, np.float64)
  if len(x) < 2 or not np.all(np.isfinite(x)):
    return float("nan"), float("nan")
  h = sps.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
  return float(x.mean() - h), float(x.mean() + h)


def t_pvalue_greater(d: np.ndarray, axis: int = -1) -> np.ndarray:
  """One-sided p-value of Student's t test of mean(d) > 0 along ``axis``; float64 [...].

  NaN where the spread is 0 or fewer than 2 values (scipy's convention)."""
  with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.asarray(sps.ttest_1samp(d, 0.0, axis=axis, alternative="greater").pvalue,
                      np.float64)


def bootstrap_interval(x_s: Sequence[float], level: float = LEVEL, seed: int = 0,
                       statistic: Callable = np.mean,
                       n_resamples: int = 9999) -> tuple[float, float]:
  """The seed bootstrap's percentile interval of ``statistic`` (``scipy.stats.bootstrap``).

  Args:
    x_s: float [S] per-seed values; +inf allowed for ``np.median`` (an unreached target:
      the interval's end is then +inf).
    level: two-sided level. seed: the resampling generator's seed (the report is
      reproducible). statistic: a numpy reduction taking ``axis``.

  Returns:
    (lo, hi) floats; (v, v) when all values are equal; (NaN, NaN) when S < 2.
  """
  x = np.asarray(x_s, np.float64)
  if len(x) < 2:
    return float("nan"), float("nan")
  if np.all(x == x[0]):
    return float(x[0]), float(x[0])
  big = 1e300
  xf = np.where(np.isinf(x), np.sign(x) * big, x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    res = sps.bootstrap((xf,), statistic, confidence_level=level, method="percentile",
                        n_resamples=n_resamples, rng=np.random.default_rng(seed))
  lo, hi = (float(v) for v in (res.confidence_interval.low, res.confidence_interval.high))
  unbig = lambda v: math.copysign(INF, v) if abs(v) >= big / 10 else v  # noqa: E731
  return unbig(lo), unbig(hi)


def probability_of_improvement(a_s: Sequence[float], b_s: Sequence[float],
                               paired: bool = True) -> float:
  """P(A > B), ties counted half (Agarwal et al. 2021, §4.3).

  Args:
    a_s, b_s: float [S] per-seed values of the configuration and the reference (same
      seed order when ``paired``). paired: the share of seeds with a_s > b_s; else
      rliable's definition, the Mann–Whitney U over all S_a·S_b pairs of runs.

  Returns:
    A float in [0, 1]; NaN without values.

  Raises:
    ValueError: ``paired`` with different lengths.
  """
  a, b = np.asarray(a_s, np.float64), np.asarray(b_s, np.float64)
  if paired and a.shape != b.shape:
    raise ValueError(f"paired values need the same seeds (got {a.shape} and {b.shape})")
  if not len(a) or not len(b):
    return float("nan")
  if paired:
    return float(np.mean((a > b) + 0.5 * (a == b)))
  return float(sps.mannwhitneyu(a, b, alternative="greater").statistic / (len(a) * len(b)))


@dataclasses.dataclass(frozen=True)
class Comparison:
  """A configuration against a reference, seed by seed.

  Attributes:
    diff_s: per-seed differences (configuration − reference), tuple of floats [S].
    mean: their mean. t: the t interval (lo, hi). boot: the bootstrap interval (lo, hi).
    p_improve: the share of seeds with a positive difference (ties half).
    p_value: one-sided t test of mean > 0 (NaN when undefined).
  """

  diff_s: tuple
  mean: float
  t: tuple
  boot: tuple
  p_improve: float
  p_value: float

  @property
  def n(self) -> int:
    return len(self.diff_s)


def paired(a_s: Sequence[float], b_s: Sequence[float], level: float = LEVEL,
           seed: int = 0) -> Comparison:
  """``Comparison`` of per-seed values ``a_s`` against ``b_s`` (float [S] each, the same
  seed order). Differences in the values' units.

  Raises:
    ValueError: different lengths.
  """
  a, b = np.asarray(a_s, np.float64), np.asarray(b_s, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired values need the same seeds (got {a.shape} and {b.shape})")
  d = a - b
  p = float(t_pvalue_greater(d)) if len(d) >= 2 else float("nan")
  return Comparison(diff_s=tuple(float(v) for v in d), mean=float(d.mean()) if len(d) else
                    float("nan"), t=t_interval(d, level), boot=bootstrap_interval(d, level, seed),
                    p_improve=probability_of_improvement(a, b), p_value=p)


@dataclasses.dataclass(frozen=True)
class Ratio:
  """Per-seed ratios (tokens to a target over the reference's), summarised.

  Attributes:
    ratio_s: tuple of floats [S] (+inf: not reached). median: over seeds.
    boot: the seed bootstrap's interval of the median. geo: the geometric mean and
    geo_t, its t interval on the log scale (NaN when a seed did not reach the target).
    reached: seeds with a finite ratio.
  """

  ratio_s: tuple
  median: float
  boot: tuple
  geo: float
  geo_t: tuple
  reached: int


def ratio_summary(ratio_s: Sequence[float], level: float = LEVEL, seed: int = 0) -> Ratio:
  """``Ratio`` of per-seed ratios (float [S], > 0 or +inf)."""
  r = np.asarray(ratio_s, np.float64)
  fin = np.isfinite(r)
  nan2 = (float("nan"), float("nan"))
  if len(r) and fin.all():
    lo, hi = t_interval(np.log(r), level)
    geo, geo_t = float(np.exp(np.log(r).mean())), (math.exp(lo), math.exp(hi)) if lo == lo else nan2
  else:
    geo, geo_t = float("nan"), nan2
  return Ratio(ratio_s=tuple(float(v) for v in r), median=quantiles(r)[1],
               boot=bootstrap_interval(r, level, seed, statistic=np.median), geo=geo,
               geo_t=geo_t, reached=int(fin.sum()))
