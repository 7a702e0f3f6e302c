"""The paper's optimal buffer design (Arnal et al. 2026, §4 Thm 4.5 and App. 9.3.2).

With compute C = (B + μR)·T fixed and C → ∞, the bound depends on the staleness horizon
x = N/R (maximum age, in learner steps) and the replay ratio y = B/R (mean uses per
rollout) through

    J(x, y) = σ̄²(x) · (1 + y/μ) · (1/y + 1/x + ρ),

σ̄²(x) the mean gradient-noise variance over staleness 0..x−1, μ the cost of generating
one rollout over the cost of training on one, ρ ∈ [0, 1] the correlation constant.

Command line (suggests N and R for a batch size B):
  python -m jaxreplay.theory --mu 5.28 --rho 0.1 --alpha 0.25 --batch_size 256
  python -m jaxreplay.theory --run_dir runs/default --rho 0.1 --alpha 0.25
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

import numpy as np
from scipy import optimize


def compute_ratio(w_over_t: float, mu: float) -> float:
  """Per-update cost with a buffer over cost without, γ = (1 + W/T)/(1 + μ) (paper eq. 2).

  Args:
    w_over_t: inference workers per trainer W/T (> 0). mu: generation/training cost ratio (> 0).

  Raises:
    ValueError: non-positive inputs.
  """
  if w_over_t <= 0 or mu <= 0:
    raise ValueError(f"W/T={w_over_t} and mu={mu} must be > 0")
  return (1.0 + w_over_t) / (1.0 + mu)


def objective(x: float, y: float, mu: float, rho: float,
              sigma2_bar: Callable[[float], float]) -> float:
  """J(x, y) = σ̄²(x)(1 + y/μ)(1/y + 1/x + ρ) (paper Thm 4.5). x, y > 0; unitless."""
  return sigma2_bar(x) * (1.0 + y / mu) * (1.0 / y + 1.0 / x + rho)


def power_law_sigma2_bar(alpha: float, tau: float = 1.0) -> Callable[[float], float]:
  """σ̄²(x) ≈ (x/τ)^{2α}/(2α+1) for σ(s) = (s/τ)^α (paper App. 9.3.2)."""
  return lambda x: (x / tau) ** (2 * alpha) / (2 * alpha + 1)


def optimal_y(x: float, mu: float, rho: float) -> float:
  """y*(x) = √(μ / (ρ + 1/x)), the minimiser of J over y at fixed x (paper Thm 4.5)."""
  return math.sqrt(mu / (rho + 1.0 / x))


def optimal_design(mu: float, rho: float, sigma2_bar: Callable[[float], float],
                   x_max: float = 1e4) -> tuple[float, float]:
  """General minimiser (x*, y*): x* = argmin_x σ̄²(x)(1/√μ + √(ρ + 1/x))², y* = y*(x*).

  Args:
    mu: > 0. rho: in [0, 1]. sigma2_bar: non-decreasing σ̄²(x) for x > 0.
    x_max: upper end of the search (learner steps).

  Returns:
    (x*, y*) as floats (x* may sit at ``x_max`` when σ̄² grows too slowly to stop it).

  Raises:
    ValueError: mu <= 0 or rho outside [0, 1].
  """
  if mu <= 0 or not 0 <= rho <= 1:
    raise ValueError(f"mu={mu} must be > 0 and rho={rho} in [0, 1]")
  f = lambda lx: sigma2_bar(math.exp(lx)) * (1 / math.sqrt(mu) + math.sqrt(rho + math.exp(-lx))) ** 2
  grid = np.linspace(math.log(1e-3), math.log(x_max), 400)
  i = int(np.argmin([f(g) for g in grid]))
  lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
  res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded",
                                 options={"xatol": 1e-10})
  x = math.exp(res.x)
  return x, optimal_y(x, mu, rho)


def power_law_design(mu: float, rho: float, alpha: float) -> tuple[float, float]:
  """Closed form for σ(s) = (s/τ)^α, α < 1/2 (paper App. 9.3.2; τ drops out).

  y* = (−α + √(α² + μρ(1−2α)))/ρ and x* = y*²/(μ − ρ y*²).

  Raises:
    ValueError: alpha not in (0, 1/2), rho not in (0, 1], or mu <= 0.
  """
  if not 0 < alpha < 0.5 or not 0 < rho <= 1 or mu <= 0:
    raise ValueError(f"need 0 < alpha={alpha} < 0.5, 0 < rho={rho} <= 1, mu={mu} > 0")
  y = (-alpha + math.sqrt(alpha ** 2 + mu * rho * (1 - 2 * alpha))) / rho
  return y * y / (mu - rho * y * y), y


def power_law_design_bounded(mu: float, rho: float, alpha: float,
                             x_bounds: tuple[float, float] = (1e-3, 1e4),
                             y_bounds: tuple[float, float] = (1e-3, 1e4)) -> tuple[float, float]:
  """Minimiser of J(x, y) over a box for σ(s) = (s/τ)^α (paper Thm 4.5, App. 9.3.2).

  σ̄²(x) = (x/τ)^{2α}/(2α+1) (``power_law_sigma2_bar``; τ drops out). At fixed x, J is
  convex in y with minimiser ``optimal_y(x)`` (Thm 4.5: (1 + y/μ)(1/y + a) =
  1/y + a + 1/μ + a·y/μ), so the box's best y is that value clipped to ``y_bounds``;
  x then minimises J(x, clip(y*(x))) over ``x_bounds`` (a 256-point log grid, refined by
  bounded Brent on the bracket). When the unconstrained optimum lies inside the box this
  is the closed form of ``power_law_design`` (to ~1e-8 relative); unlike it, this also
  takes α = 0 or α >= 1/2 and ρ = 0.

  Args:
    mu: μ > 0. rho: ρ in [0, 1]. alpha: α >= 0.
    x_bounds: (x_lo, x_hi), 0 < x_lo <= x_hi, staleness horizon N/R in learner steps.
    y_bounds: (y_lo, y_hi), 0 < y_lo <= y_hi, replay ratio B/R.

  Returns:
    (x*, y*) floats inside the box.

  Raises:
    ValueError: inputs outside those ranges.
  """
  (x_lo, x_hi), (y_lo, y_hi) = x_bounds, y_bounds
  if mu <= 0 or not 0 <= rho <= 1 or alpha < 0:
    raise ValueError(f"need mu={mu} > 0, rho={rho} in [0, 1], alpha={alpha} >= 0")
  if not 0 < x_lo <= x_hi or not 0 < y_lo <= y_hi:
    raise ValueError(f"need 0 < x_lo <= x_hi ({x_bounds}) and 0 < y_lo <= y_hi ({y_bounds})")
  s2 = power_law_sigma2_bar(alpha)
  y_of = lambda x: min(max(optimal_y(x, mu, rho), y_lo), y_hi)
  f = lambda lx: objective(math.exp(lx), y_of(math.exp(lx)), mu, rho, s2)
  lo, hi = math.log(x_lo), math.log(x_hi)
  if hi - lo < 1e-12:
    return x_lo, y_of(x_lo)
  grid = np.linspace(lo, hi, 256)
  i = int(np.argmin([f(g) for g in grid]))
  a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
  res = optimize.minimize_scalar(f, bounds=(a, b), method="bounded", options={"xatol": 1e-12})
  lx = res.x if res.fun <= f(grid[i]) else grid[i]
  x = min(max(math.exp(lx), x_lo), x_hi)
  return x, y_of(x)


def mu_from_run(run_dir: str) -> dict[str, float]:
  """μ from a run's last metrics record: ``mu_time`` (time per rollout generated ÷ time per
  sample trained: moves with the machine's load), ``mu_flops`` (the same in estimated
  FLOPs, ``train.accounting``: the run's own; NaN in records without FLOP counts), and the
  paper's estimator K_train/K_inf (App. 10.4) for reference.

  Raises:
    FileNotFoundError: no metric records. ValueError: no step record yet.
  """
  from jaxreplay.train import accounting  # imports this module
  from jaxreplay.train.metrics import read_records
  recs = read_records(run_dir)
  last = next((r for r in reversed(recs) if "generate_s" in r), None)
  if last is None:
    raise ValueError(f"{run_dir} has no step record")
  per_rollout = last["generate_s"] / max(last["generated_rollouts"], 1)
  per_sample = last["train_s"] / max(last["trained_samples"], 1)
  return {"mu_time": per_rollout / per_sample,
          "mu_flops": accounting.mu(last.get("generation_flops", 0.0), last["generated_rollouts"],
                                    last.get("training_flops", 0.0), last["trained_samples"]),
          "replay_ratio": last["trained_samples"] / max(last["generated_rollouts"], 1)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--mu", type=float, help="generation/training cost ratio μ")
  p.add_argument("--run_dir", help="estimate μ from this run's metric records")
  p.add_argument("--rho", type=float, required=True)
  p.add_argument("--alpha", type=float, required=True)
  p.add_argument("--batch_size", type=int, default=256, help="B")
  a = p.parse_args(argv)
  mu = a.mu if a.mu is not None else (mu_from_run(a.run_dir)["mu_time"] if a.run_dir else None)
  if mu is None:
    p.error("give --mu or --run_dir")
  try:
    x, y = power_law_design(mu, a.rho, a.alpha)
  except ValueError as e:  # parameters outside the closed form's domain
    p.error(str(e))
  r = a.batch_size / y
  n = x * r
  print(f"mu={mu:.3f} rho={a.rho} alpha={a.alpha}: x*=N/R={x:.2f} steps, y*=B/R={y:.2f}")
  print(f"for B={a.batch_size}: R ≈ {r:.0f} rollouts per step, N ≈ {n:.0f}")
  need = max(r, a.batch_size)
  if n < need:  # the trainer needs the buffer to hold a whole step and a whole batch
    print(f"note: N < max(R, B) = {need:.0f}; the trainer needs buffer.capacity >= "
          f"rollout.per_step and >= train.batch_size, so use N = {need:.0f} (the constrained "
          "optimum lies on that boundary)")


if __name__ == "__main__":
  main()
