"""pass@k (unbiased estimator of Chen et al. 2021) against exact enumeration."""

import itertools
import math

import numpy as np
import pytest

from jaxreplay.train.evaluate import pass_at_k


def _reference(n, c, k):
  """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
  samples = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 4, 7, 16])
def test_pass_at_k_matches_subset_enumeration(n):
  for k in range(1, n + 1):
    for c in range(n + 1):
      got = pass_at_k(np.array([n]), np.array([c]), k)[0]
      assert got == pytest.approx(_reference(n, c, k), abs=1e-12), (n, c, k)
      assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_by_hand_and_vectorised():
  # n = 4, c = 1: pass@1 = 1/4, pass@2 = 1 − C(3,2)/C(4,2) = 1/2, pass@4 = 1
  np.testing.assert_allclose(pass_at_k(np.array([4, 4, 4]), np.array([1, 0, 4]), 2),
                             [0.5, 0.0, 1.0])
  assert pass_at_k(np.array([4]), np.array([1]), 1)[0] == 0.25
  assert pass_at_k(np.array([4]), np.array([1]), 4)[0] == 1.0
  with pytest.raises(ValueError, match="k <= samples"):
    pass_at_k(np.array([4]), np.array([1]), 8)
