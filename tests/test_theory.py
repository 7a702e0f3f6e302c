"""Theory module against the paper's numbers and a brute-force minimisation of J(x, y)."""

import numpy as np
import pytest

from jaxreplay import theory


@pytest.mark.parametrize("mu,rho,alpha,x,y", [
    (5.28, 0.1, 0.25, 2.43, 3.21), (5.28, 0.1, 0.1, 14.3, 5.58), (6.84, 0.05, 0.1, 24.2, 8.65)])
def test_power_law_closed_form_matches_notes(mu, rho, alpha, x, y):
  xs, ys = theory.power_law_design(mu, rho, alpha)
  assert xs == pytest.approx(x, abs=0.05) and ys == pytest.approx(y, abs=0.01)


@pytest.mark.parametrize("mu,rho,alpha", [(5.28, 0.1, 0.25), (6.84, 0.05, 0.1), (4.0, 0.3, 0.2)])
def test_closed_form_and_general_minimiser_match_brute_force(mu, rho, alpha):
  s2 = theory.power_law_sigma2_bar(alpha, tau=3.0)
  lx, ly = np.meshgrid(np.linspace(np.log(0.05), np.log(500), 1500),
                       np.linspace(np.log(0.05), np.log(100), 1500))
  x, y = np.exp(lx), np.exp(ly)
  j = (x / 3.0) ** (2 * alpha) / (2 * alpha + 1) * (1 + y / mu) * (1 / y + 1 / x + rho)
  i = np.unravel_index(np.argmin(j), j.shape)
  xb, yb = x[i], y[i]
  for xs, ys in (theory.power_law_design(mu, rho, alpha), theory.optimal_design(mu, rho, s2)):
    assert xs == pytest.approx(xb, rel=0.02) and ys == pytest.approx(yb, rel=0.02)
    assert theory.objective(xs, ys, mu, rho, s2) <= j[i] * (1 + 1e-6)


def test_compute_ratio_table1():
  # eq. 2 values; the paper prints 0.43 for (5,3) and 0.65 for (6,2) at μ = 5.28 (Table 1),
  # and 0.41 for (6,2) at μ = 6.84 (Table 3), a typo for 0.51 per our notes
  assert theory.compute_ratio(5 / 3, 5.28) == pytest.approx(0.4246, abs=1e-3)
  assert theory.compute_ratio(6 / 2, 5.28) == pytest.approx(0.6369, abs=1e-3)
  assert theory.compute_ratio(6 / 2, 6.84) == pytest.approx(0.5102, abs=1e-3)
  with pytest.raises(ValueError):
    theory.compute_ratio(0, 5.0)


def test_design_moves_with_mu_rho_alpha():
  base = theory.power_law_design(5.0, 0.1, 0.2)
  assert all(a > b for a, b in zip(theory.power_law_design(8.0, 0.1, 0.2), base))
  assert all(a < b for a, b in zip(theory.power_law_design(5.0, 0.3, 0.2), base))
  assert all(a < b for a, b in zip(theory.power_law_design(5.0, 0.1, 0.3), base))


def test_cli_suggests_n_and_r(capsys):
  theory.main(["--mu", "5.28", "--rho", "0.1", "--alpha", "0.25", "--batch_size", "60"])
  out = capsys.readouterr().out
  assert "x*=N/R=2.43" in out and "y*=B/R=3.21" in out and "R ≈ 19" in out


def test_cli_notes_when_the_optimal_buffer_is_below_the_trainer_minimum(capsys):
  """x* = 0.44 (mu 0.497, rho 0.1, alpha 0.25): N ≈ 245 < R ≈ 562, which the trainer refuses."""
  theory.main(["--mu", "0.497", "--rho", "0.1", "--alpha", "0.25", "--batch_size", "256"])
  out = capsys.readouterr().out
  assert "R ≈ 562 rollouts per step, N ≈ 245" in out
  assert "use N = 562" in out
  # mu 1, rho 0.1, alpha 0.1: x* = 6.67 ≥ y* = 2.0, so N ≈ 853 ≥ max(R ≈ 128, B = 256)
  theory.main(["--mu", "1", "--rho", "0.1", "--alpha", "0.1", "--batch_size", "256"])
  out = capsys.readouterr().out
  assert "R ≈ 128 rollouts per step, N ≈ 853" in out and "note:" not in out
  with pytest.raises(SystemExit):  # rho outside (0, 1]: an argparse error, no traceback
    theory.main(["--mu", "1", "--rho", "0", "--alpha", "0.1"])
