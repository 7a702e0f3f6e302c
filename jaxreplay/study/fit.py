"""The saturating compute curve of ScaleRL (Khatri et al. 2025, "The Art of Scaling
Reinforcement Learning Compute for LLMs", arXiv 2510.13786, eq. 1):

    R(C) = R0 + (A − R0) / (1 + (C_mid / C)^B),

R0 the accuracy before training (C → 0), A the asymptote (C → ∞), C_mid the compute at which
half of the gain A − R0 is made, B > 0 the steepness (larger: the gain comes over fewer
doublings). A bounds what a method can reach; B and C_mid how fast it gets there.

``fit_curve`` fits (A, B, C_mid) with ``scipy.optimize.curve_fit`` to the pooled evaluations of
a configuration's seeds, R0 fixed to the mean accuracy at C = 0 (every run starts from its
seed's warm start); ``fit_seeds`` adds the seed bootstrap's percentile intervals (resample
seeds, pool, refit: the seeds are the independent units). The asymptote is *identified*
(``SaturatingFit.identified``) only when the curve reaches past its midpoint within the data
in at least (1 + level)/2 of the resamples and A's interval stays off its upper bound; a
curve still rising at its last evaluation says little about its ceiling, and then only
(B, C_mid) are compared.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Sequence

import numpy as np
from scipy import optimize

from jaxreplay.study.stats import LEVEL

A_MAX = 1.0              # accuracy's ceiling: an A at this bound is not identified
B_BOUNDS = (0.05, 20.0)  # the steepness' search range


def saturating(c: np.ndarray, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
  """R(C) = R0 + (A − R0)/(1 + (C_mid/C)^B); float64 like ``c`` (C > 0; C = 0 gives R0)."""
  c = np.asarray(c, np.float64)
  with np.errstate(divide="ignore", over="ignore"):
    z = np.where(c > 0, (c_mid / np.maximum(c, 1e-300)) ** b, np.inf)
  return r0 + (a - r0) / (1.0 + z)


@dataclasses.dataclass(frozen=True)
class SaturatingFit:
  """A fitted curve and, from ``fit_seeds``, its seed-bootstrap intervals.

  Attributes:
    r0, a, b, c_mid: the parameters (C_mid in the compute axis' units).
    c_max: the largest compute in the data. rmse: root-mean-square residual (accuracy).
    a_ci, b_ci, c_mid_ci: (lo, hi) percentile intervals, (NaN, NaN) without a bootstrap.
    past_mid: share of the bootstrap fits with C_mid < their c_max (NaN without them).
  """

  r0: float
  a: float
  b: float
  c_mid: float
  c_max: float
  rmse: float
  a_ci: tuple = (float("nan"), float("nan"))
  b_ci: tuple = (float("nan"), float("nan"))
  c_mid_ci: tuple = (float("nan"), float("nan"))
  past_mid: float = float("nan")
  level: float = LEVEL

  @property
  def identified(self) -> bool:
    """Whether A is identified: C_mid < c_max in >= (1 + level)/2 of the bootstrap fits and
    the intervals of A and B off their bounds (``A_MAX``, ``B_BOUNDS``: a fit at a bound is a
    step or a line, not a saturating curve); without a bootstrap, the same of the point fit."""
    lo_b, hi_b = (self.b, self.b) if self.b_ci[0] != self.b_ci[0] else self.b_ci
    off_b = lo_b > B_BOUNDS[0] * 1.01 and hi_b < B_BOUNDS[1] * 0.99
    if not self.a_ci[1] == self.a_ci[1]:
      return self.c_mid < self.c_max and self.a < A_MAX - 1e-3 and off_b
    return self.past_mid >= (1 + self.level) / 2 and self.a_ci[1] < A_MAX - 1e-3 and off_b


def fit_curve(c_p: np.ndarray, acc_p: np.ndarray, r0: float) -> SaturatingFit:
  """Least-squares (A, B, C_mid) at fixed R0.

  Args:
    c_p: float [P] compute (> 0; points at C = 0 are left out: they fix R0). acc_p: float
      [P] accuracies. r0: the accuracy at C = 0.

  Returns:
    ``SaturatingFit`` without intervals.

  Raises:
    ValueError: fewer than 3 points with C > 0. RuntimeError: ``curve_fit`` did not converge.
  """
  c, y = np.asarray(c_p, np.float64), np.asarray(acc_p, np.float64)
  keep = c > 0
  c, y = c[keep], y[keep]
  if len(c) < 3:
    raise ValueError(f"a saturating fit needs >= 3 points with C > 0 (got {len(c)})")
  lc = np.log(c)

  def f(lcv, a, b, lmid):
    return r0 + (a - r0) / (1.0 + np.exp(b * (lmid - lcv)))

  lo = [min(r0, y.min()) - 0.5, B_BOUNDS[0], lc.min() - math.log(1e3)]
  hi = [A_MAX, B_BOUNDS[1], lc.max() + math.log(1e3)]
  best = None
  for lmid0 in np.quantile(lc, [0.25, 0.5, 0.9]):  # a few starts: the surface has ridges
    p0 = [min(max(y.max() + 0.02, lo[0] + 1e-3), A_MAX - 1e-3), 1.0, lmid0]
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p, _ = optimize.curve_fit(f, lc, y, p0=p0, bounds=(lo, hi), maxfev=600)
    except RuntimeError:
      continue
    sse = float(np.sum((f(lc, *p) - y) ** 2))
    if best is None or sse < best[1]:
      best = (p, sse)
  if best is None:
    raise RuntimeError("curve_fit did not converge from any start")
  (a, b, lmid), sse = best
  return SaturatingFit(r0=float(r0), a=float(a), b=float(b), c_mid=float(math.exp(lmid)),
                       c_max=float(c.max()), rmse=math.sqrt(sse / len(c)))


def _pool(curves: Sequence[tuple[np.ndarray, np.ndarray]], idx: Sequence[int]):
  c = np.concatenate([np.asarray(curves[i][0], np.float64) for i in idx])
  y = np.concatenate([np.asarray(curves[i][1], np.float64) for i in idx])
  r0 = float(np.mean(y[c <= 0])) if np.any(c <= 0) else float(y[np.argmin(c)])
  return c, y, r0


def fit_seeds(curves: Sequence[tuple[np.ndarray, np.ndarray]], level: float = LEVEL,
              n_boot: int = 400, seed: int = 0) -> SaturatingFit:
  """``fit_curve`` on the pooled seeds with seed-bootstrap percentile intervals.

  Args:
    curves: per seed (compute [E], accuracy [E]) with the C = 0 evaluation included (R0 is
      the mean accuracy there; without one, the accuracy at the smallest C).
    level: two-sided level. n_boot: resamples (each distinct multiset of seeds is
      refitted once, ~60 ms). seed: the resampling generator's seed.

  Returns:
    ``SaturatingFit`` with intervals (without them with one seed, ``n_boot`` < 1 or no
    resample that fits).

  Raises:
    ValueError / RuntimeError: as ``fit_curve`` on the pooled data.
  """
  n = len(curves)
  point = fit_curve(*_pool(curves, range(n)))
  if n < 2 or n_boot < 1:
    return point
  rng = np.random.default_rng(seed)
  draws, cache = [], {}
  for _ in range(n_boot):
    idx = tuple(sorted(rng.integers(0, n, n)))  # few seeds: few distinct resamples, fit once
    if idx not in cache:
      c, y, r0 = _pool(curves, idx)
      try:
        cache[idx] = fit_curve(c, y, r0)
      except (ValueError, RuntimeError):
        cache[idx] = None
    if cache[idx] is not None:
      draws.append(cache[idx])
  if not draws:
    return point
  q = ((1 - level) / 2, (1 + level) / 2)

  def ci(vals):
    return tuple(float(v) for v in np.quantile(vals, q))

  past = np.mean([d.c_mid < d.c_max for d in draws]) if draws else float("nan")
  return dataclasses.replace(point, a_ci=ci([d.a for d in draws]),
                             b_ci=ci([d.b for d in draws]),
                             c_mid_ci=ci([d.c_mid for d in draws]), past_mid=float(past),
                             level=level)
