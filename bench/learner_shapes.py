"""Learner-step time against the packed shape's cost: a batch in its own shape and in a larger one.

``train.compile_cost_steps`` (``train/shape_reuse.py``) runs a batch in a compiled larger
packed shape while the waste stays under c steps, with the waste measured by the shape's
cost, S · (R · W + G · N) slots (``packing.PlanShape.cost``: the trunk's slots plus the
output head's). That is right when a step's time follows its shape's cost. This benchmark
checks it on the preset's batches.

Protocol: a randomly initialised decoder at SmolLM2-135M's shapes (``bench/prompt_sharing.py``)
takes jaxreplay's packed learner step (PPO-clip, GRPO advantages, token-mean, the head's
log-softmax in chunks of 32, 4 micro-batches, ``algo.share_prompts``, AdamW), as
configs/smollm2_135m.py runs it, on batches of 4 prompts of 60 tokens (left-padded to 96)
× 8 completions of up to 128 tokens:

* ``short``: every completion 10 tokens (the preset's batches once the model answers briefly);
* ``one_long``: the same with one completion at the 128-token limit, in its own shape;
* ``one_long_rented``: that batch in the shape of ``mid`` (the larger shape renting uses);
* ``mid``: completions uniform in [12, 40) with one at 128, the first such draw whose own
  shape has 7 rows (as the preset's compiled long-phase shape).

Each case: one call to compile, then the median of ``--steps`` calls. Ends with

  learner_shapes ms_per_cost_short=F ms_per_cost_one_long=F ms_per_cost_rented=F rented_vs_own=F

(milliseconds per unit of cost for the three cases, and the rented step's time over the
own-shape step's for the same batch; the cost model predicts rented_vs_own =
cost(rented) / cost(own)).

Usage: python bench/learner_shapes.py [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from prompt_sharing import SMOLLM2_135M, time_step  # noqa: E402  (this folder is sys.path[0])

PROMPT_WIDTH, MAX_NEW, GROUPS, GROUP_SIZE, PROMPT = 96, 128, 4, 8, 60


def make_batch(lengths, vocab: int, seed: int = 0):
  """A Rollout of GROUPS × GROUP_SIZE rows: equal prompts per group, completions of ``lengths``."""
  from jaxreplay.rollout import Rollout
  rng = np.random.default_rng(seed)
  b, t = GROUPS * GROUP_SIZE, PROMPT_WIDTH + MAX_NEW
  tokens = np.zeros((b, t), np.int32)
  comp = np.zeros((b, t), bool)
  prompts = rng.integers(1, vocab, (GROUPS, PROMPT))
  for i, n in enumerate(lengths):
    tokens[i, PROMPT_WIDTH - PROMPT:PROMPT_WIDTH] = prompts[i // GROUP_SIZE]
    tokens[i, PROMPT_WIDTH:PROMPT_WIDTH + n] = rng.integers(1, vocab, n)
    comp[i, PROMPT_WIDTH:PROMPT_WIDTH + n] = True
  rewards = rng.integers(0, 2, b).astype(np.float32)
  adv = rewards - rewards.reshape(GROUPS, -1).mean(1).repeat(GROUP_SIZE)
  return Rollout(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(tokens > 0),
                 completion_mask=jnp.asarray(comp),
                 behaviour_logprobs=jnp.asarray(np.where(comp, -np.log(vocab), 0.0), jnp.float32),
                 rewards=jnp.asarray(rewards), advantages=jnp.asarray(adv, jnp.float32),
                 group_id=jnp.asarray(np.arange(b) // GROUP_SIZE, jnp.int32),
                 policy_version=jnp.zeros(b, jnp.int32), newest_version=jnp.zeros(b, jnp.int32),
                 truncated=jnp.asarray(np.asarray(lengths) >= MAX_NEW))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=3, help="timed steps per case (after 1 compile)")
  a = p.parse_args()
  from flax import nnx

  from jaxreplay.models import Transformer
  from jaxreplay.models.hf import config_from_hf
  from jaxreplay.rl import packing
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step

  cfg = dataclasses.replace(config_from_hf(SMOLLM2_135M, dtype="float32", param_dtype="float32"),
                            attention="xla")
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant", logprob_chunk=32,
                  grad_accum_steps=4, share_prompts=True)
  opt = make_optimizer(spec, 0)
  step = make_train_step(graphdef, opt, spec, 1.0)

  def plan_of(batch, shape=None):
    return step.plan_batch(np.asarray(batch.attention_mask),
                           completion=np.asarray(batch.completion_mask),
                           tokens=np.asarray(batch.tokens), shape=shape)

  n = GROUPS * GROUP_SIZE
  one_long = make_batch([MAX_NEW] + [10] * (n - 1), cfg.vocab_size)
  for seed in range(1000):
    lengths = np.random.default_rng(seed).integers(12, 40, n)
    lengths[0] = MAX_NEW
    mid = make_batch(lengths, cfg.vocab_size)
    if packing.plan_shape(plan_of(mid)).rows == 7:
      break
  else:
    raise SystemExit("no draw of the mid batch packs into 7 rows")
  rented = packing.plan_shape(plan_of(mid))
  cases = (("short", make_batch([10] * n, cfg.vocab_size), None),
           ("one_long", one_long, None), ("one_long_rented", one_long, rented),
           ("mid", mid, None))
  per_cost, secs = {}, {}
  for name, batch, shape in cases:
    plan = plan_of(batch, shape)
    sh = packing.plan_shape(plan)
    state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
    first, secs[name], m = time_step(step, state, batch, plan, a.steps)
    per_cost[name] = secs[name] / sh.cost * 1e3
    print(f"{name:16s} S={sh.steps} R={sh.rows} W={sh.width} N={sh.scored} cost {sh.cost:5d}  "
          f"first {first:5.1f} s  step {secs[name]:5.2f} s  {per_cost[name]:.2f} ms/cost  "
          f"loss {float(m['loss']):+.6f}", flush=True)
  print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs")
  print(f"learner_shapes ms_per_cost_short={per_cost['short']:.2f} "
        f"ms_per_cost_one_long={per_cost['one_long']:.2f} "
        f"ms_per_cost_rented={per_cost['one_long_rented']:.2f} "
        f"rented_vs_own={secs['one_long_rented'] / secs['one_long']:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
