"""``train.shape_reuse.ShapeReuse``: the rent-or-buy choice of a compiled shape, by hand,
alone and in the packed learner step (``train.compile_cost_steps``)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay
from jaxreplay.rl import packing
from jaxreplay.rollout import empty_rollout
from jaxreplay.train.learner import make_learner_step
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


class _State(NamedTuple):
  step: jax.Array


def test_learner_step_rents_the_compiled_shape_then_compiles_its_own():
  """``make_learner_step(compile_cost_steps=2)``: four rows of 2 + 12 tokens pack into 4
  rows of 16 (shape A: 64 slots + 48 scored = 112); rows of 2 + 4 tokens then need 2 rows
  (shape B: 32 + 16 = 48). The first such batch runs in A (debt 112/48 − 1 = 1.33), the
  second would reach 2.67 ≥ 2 and compiles B; the update is traced once per shape."""
  width, b = 16, 4
  traced = []

  def train_step(state, items, weights, staleness, plan=None):
    traced.append(packing.plan_shape(plan))  # at trace time: once per compiled shape
    return state, {}

  def plan_batch(mask, multiple=1, advantages=None, completion=None, tokens=None, shape=None):
    return packing.plan_batch(mask, 1, 1, multiple=multiple, completion_bt=completion,
                              shape=shape)

  plan_batch.drops_zero_advantage = plan_batch.shares_prompts = False
  train_step.plan_batch = plan_batch
  step = make_learner_step(train_step, replay.make_replay_buffer(b, b), compile_cost_steps=2.0)
  a = packing.PlanShape(1, 4, 16, 48)
  b_shape = packing.PlanShape(1, 2, 16, 16)
  seen = []
  for completion in (12, 4, 4, 4):
    cols = np.arange(width)[None, :]
    attn = np.repeat((cols >= 2) & (cols < 4 + completion), b, 0)
    rows = empty_rollout(b, width).replace(attention_mask=jnp.asarray(attn),
                                           completion_mask=jnp.asarray(attn & (cols >= 4)))
    buf = replay.add(replay.init(empty_rollout(1, width), b), rows, jnp.zeros(b, jnp.int32), 0)
    _, _, metrics = step(_State(jnp.int32(0)), buf, jax.random.key(0))  # draws all four
    seen.append((int(metrics["learner_slots"]), int(metrics["learner_shapes"])))
  assert traced == [a, b_shape]
  assert seen == [(64, 1), (64, 1), (32, 2), (32, 2)]
