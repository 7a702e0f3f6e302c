"""Scorer throughput next to generation throughput: can scoring bottleneck a learner step?

Scoring: ``--completions`` chain-of-thought-shaped completions (a few sentences of working,
then a final answer in one of the forms the math reward reads: ``\\boxed{}`` with fractions,
decimals, thousands separators, percentages, ``#### N``, ``<answer>`` tags, a final number;
about a third wrong), each against its gold parsed once, scored by ``MathReward`` in this
process (the cost of the work itself) and through ``tasks.scoring.Scorer`` pools of 1 and 2
worker processes (started and warmed before timing). Generation: ``sampling.generate`` on
the embedded default's decoder shape (random weights, 0.9M parameters) and on ``--layers`` x
``--hidden`` (a larger random decoder), ``--batch`` prompts of ``--prompt`` tokens, exactly
``--new`` new tokens each (no stop id), after a compile warm-up. Both are printed as
completions per second, medians of ``--rounds`` rounds.

Usage: python bench/score.py [--completions 512 --batch 128 --new 256 --rounds 3]
Keep other work off the machine: the numbers move ~2x on a shared 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxreplay.tasks.base import Example  # noqa: E402
from jaxreplay.tasks.math_answer import MathReward, parse_gold  # noqa: E402
from jaxreplay.tasks.scoring import Scorer  # noqa: E402


def completions(n: int, seed: int = 0) -> tuple[list[str], list[Example]]:
  """n (completion, example) pairs: random golds, answers in varied forms, ~1/3 wrong."""
  rng = random.Random(seed)
  texts, examples = [], []
  for _ in range(n):
    a, b = rng.randint(1, 99), rng.randint(2, 12)
    kind = rng.randrange(7)
    gold = {0: f"\\frac{{{a}}}{{{b}}}", 1: str(a * 1000), 2: f"{a}.5", 3: f"{a}\\%",
            4: str(-a), 5: str(a), 6: f"{a}\\sqrt{{2}}"}[kind]
    wrong = rng.random() < 0.33
    v = a + 1 if wrong else a
    answer = {0: f"\\boxed{{\\dfrac{{{v}}}{{{b}}}}}", 1: f"\\boxed{{{v},000}}", 2: f"#### {v}.50",
              3: f"<answer>{v / 100}</answer>", 4: f"so it is {-v}.", 5: f"\\fbox{{{v}}}",
              6: f"\\boxed{{\\sqrt{{{2 * v * v}}}}}"}[kind]
    work = " ".join(f"Step {i}: {rng.randint(1, 999)} + {rng.randint(1, 99)} = {rng.randint(1, 999)}."
                    for i in range(rng.randint(3, 10)))
    texts.append(f"{work} Therefore the answer is {answer}")
    examples.append(Example(prompt="q", answer=gold, gold=parse_gold(gold)))
  return texts, examples


def time_scoring(scorer, texts, examples, rounds: int) -> tuple[float, np.ndarray]:
  rates, rewards = [], None
  for _ in range(rounds):
    t0 = time.perf_counter()
    rewards, failures = scorer(texts, examples)
    rates.append(len(texts) / (time.perf_counter() - t0))
    assert failures == 0, failures
  return statistics.median(rates), rewards


def time_generation(layers, hidden, heads, kv_heads, ffn, vocab, batch, prompt, new, rounds):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxreplay.models.transformer import Transformer, TransformerConfig
  from jaxreplay.sampling import generate
  cfg = TransformerConfig(vocab_size=vocab, d_model=hidden, n_layers=layers, n_heads=heads,
                          n_kv_heads=kv_heads, head_dim=hidden // heads, d_ff=ffn)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 3, vocab, jnp.int32)
  mask = jnp.ones((batch, prompt), bool)

  def once(k):
    g = generate(graphdef, params, tokens, mask, jax.random.key(k), max_new_tokens=new,
                 temperature=1.0, eos_ids=(), pad_id=0)
    jax.block_until_ready(g.tokens)

  once(0)  # compile
  rates = []
  for r in range(rounds):
    t0 = time.perf_counter()
    once(r + 1)
    rates.append(batch / (time.perf_counter() - t0))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return statistics.median(rates), n_params


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--completions", type=int, default=512)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--batch", type=int, default=128, help="rows per generate call (R)")
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--new", type=int, default=256, help="new tokens per completion")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--hidden", type=int, default=512)
  args = p.parse_args(argv)

  texts, examples = completions(args.completions)
  print(f"scoring {len(texts)} completions (mean {np.mean([len(t) for t in texts]):.0f} chars)")
  rows = []
  local = Scorer(MathReward())
  rate, ref = time_scoring(local, texts, examples, args.rounds)
  rows.append(("math reward, in this process", rate))
  for k in (1, 2):
    pool = Scorer(MathReward(), workers=k, timeout_s=30.0)
    pool(texts[:4], examples[:4])  # start and warm the workers
    rate, got = time_scoring(pool, texts, examples, args.rounds)
    np.testing.assert_array_equal(got, ref)  # pooled rewards equal in-process ones
    rows.append((f"math reward, pool of {k} worker{'s' * (k > 1)}", rate))
    pool.close()
  print(f"  fraction correct {ref.mean():.3f}")
  for name, (layers, hidden, heads, kv, ffn, vocab) in {
      "default decoder (4 x 128)": (4, 128, 4, 2, 384, 300),
      f"random decoder ({args.layers} x {args.hidden})": (args.layers, args.hidden, 8, 2,
                                                          4 * args.hidden, 8192)}.items():
    rate, n = time_generation(layers, hidden, heads, kv, ffn, vocab, args.batch, args.prompt,
                              args.new, args.rounds)
    rows.append((f"generate, {name}, {n / 1e6:.1f}M params, B={args.batch}, "
                 f"{args.new} new tokens", rate))
  width = max(len(r[0]) for r in rows)
  print(f"{'':{width}}  completions/s")
  for name, rate in rows:
    print(f"{name:{width}}  {rate:10.1f}")


if __name__ == "__main__":
  main()
