"""Which compiled static shape a call runs in: its own, or a larger one already compiled.

A jitted function compiles once per static shape. The packed learner's shape (S steps of
R rows of width W, N scored slots: ``packing.PlanShape``) follows the batch's lengths, so
while a run's completions shorten it meets a new shape at nearly every step, and on a CPU
compiling one costs a few learner steps (docs/performance.md). A batch also fits any
compiled shape at least as large, at the price of the empty slots it then runs.

``ShapeReuse`` decides between the two as in deterministic ski rental (Karlin, Manasse,
Rudolph and Sleator 1988, "Competitive snoopy caching", Algorithmica 3: 79–119): a call
whose own shape is not compiled runs in the cheapest compiled shape it fits (rent) while
the work wasted on empty slots since the last compilation stays under ``buy_cost``; the
call that would reach it compiles its own shape instead (buy). The waste between two
compilations stays under ``buy_cost``, so a run that compiles k shapes wastes less than
(k + 1) · ``buy_cost`` calls' work on empty slots: about its compilations' cost again, at
most. The debt is one for all
shapes, not one per shape, because while lengths drift a run rarely meets a shape twice.
The choice depends on shapes alone, not on clocks, so the same config and seed give the
same metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any


@dataclasses.dataclass
class ShapeReuse:
  """The shapes a jitted function has compiled, and the rent-or-buy choice for a call.

  Attributes:
    buy_cost: ≥ 0, the work of compiling a shape, in calls of that shape's own work; 0
      compiles every call's own shape (no reuse).
    compiled: the shapes compiled so far (in order of first use).
    debt: the work wasted on empty slots since the last compilation, each call's waste in
      calls of its own shape's work (cost(shape) / cost(own) − 1).
    rented: calls that ran in a larger compiled shape.
  """

  buy_cost: float
  compiled: list = dataclasses.field(default_factory=list)
  debt: float = 0.0
  rented: int = 0

  def choose(self, own: Hashable, own_value: Any, cost: Callable[[Hashable], float],
             fit: Callable[[Hashable], Any]) -> tuple[Hashable, Any]:
    """The shape a call runs in, and its value (the call's input laid out in it).

    Args:
      own: the call's own shape. own_value: the input laid out in ``own``.
      cost: shape -> its work per call (> 0, any unit).
      fit: shape -> the input laid out in that shape, or None where it does not fit.

    Returns:
      (shape, value): ``own`` and ``own_value`` when ``own`` is compiled, when no
      compiled shape fits, or when renting would take the debt to ``buy_cost`` (``own``
      is then compiled and the debt cleared); else the cheapest compiled shape that fits
      and its layout.
    """
    if own in self.compiled or self.buy_cost <= 0:
      return self._buy(own), own_value
    for shape in sorted(self.compiled, key=cost):
      value = fit(shape)
      if value is None:
        continue
      debt = self.debt + max(0.0, cost(shape) / cost(own) - 1.0)
      if debt >= self.buy_cost:
        break
      self.debt = debt
      self.rented += 1
      return shape, value
    return self._buy(own), own_value

  def _buy(self, own: Hashable) -> Hashable:
    if own not in self.compiled:
      self.compiled.append(own)
      self.debt = 0.0
    return own
