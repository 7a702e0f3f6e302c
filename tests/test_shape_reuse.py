"""``train.shape_reuse.ShapeReuse``: the rent-or-buy choice of a compiled shape, by hand."""

import pytest

from jaxreplay.train.shape_reuse import ShapeReuse


def _call(reuse, own, ran):
  """One call whose shape is its work ``own`` (an int); it fits any compiled shape at
  least as large. Appends the shape it runs in to ``ran``."""
  shape, value = reuse.choose(own, f"own {own}", cost=lambda s: s,
                              fit=lambda s: f"in {s}" if s >= own else None)
  assert value == (f"own {own}" if shape == own else f"in {shape}")
  ran.append(shape)


def test_ski_rental_by_hand():
  reuse, ran = ShapeReuse(buy_cost=1.0), []
  _call(reuse, 100, ran)           # nothing compiled: buy 100
  _call(reuse, 80, ran)            # rent 100: debt 0.25
  _call(reuse, 50, ran)            # 100 wastes 1.0: debt 1.25 would pass 1: buy 50, debt 0
  _call(reuse, 90, ran)            # rent 100: 1/9
  _call(reuse, 40, ran)            # rent 50: 1/9 + 1/4
  _call(reuse, 45, ran)            # rent 50: 1/9 + 1/4 + 1/9
  _call(reuse, 25, ran)            # 50 would waste 1.0 more (40 was rented): buy 25
  _call(reuse, 120, ran)           # nothing fits: buy 120
  _call(reuse, 80, ran)            # rent 100 (cheapest that fits): 0.25
  _call(reuse, 50, ran)            # compiled
  assert ran == [100, 100, 50, 100, 50, 50, 25, 120, 100, 50]
  assert reuse.compiled == [100, 50, 25, 120]
  assert reuse.rented == 5
  assert reuse.debt == pytest.approx(0.25)


def test_zero_buy_cost_compiles_every_shape():
  reuse, ran = ShapeReuse(buy_cost=0.0), []
  for own in (100, 80, 80, 90):
    _call(reuse, own, ran)
  assert ran == [100, 80, 80, 90] and reuse.rented == 0 and reuse.compiled == [100, 80, 90]
