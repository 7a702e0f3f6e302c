"""Cost of top-p sampling at a 152k vocabulary: one token per row, top-p 0.95 vs none.

Times ``jaxreplay.sampling.generate.sample_token`` (temperature 1) on [B, V] float32
logits with ``top_p=0.95`` and with ``top_p=1`` and prints the ratio, for three logit
shapes (each row's nucleus size at 0.95 is printed with it):

* ``peaked``: an LLM-like next-token distribution: a bulk of ``2 * randn`` logits and a
  head of 8 tokens 1.5 apart whose top stands ``h ~ U(8, 20)`` above the bulk's maximum,
  so the head holds most of the mass and the nucleus is 1 to a few hundred tokens (a
  head at h = 6 would leave ~80% of the mass in the bulk and a nucleus of ~12k tokens);
* ``randn3``: ``3 * randn`` with no head (a nucleus of ~9% of V, ~13k tokens);
* ``flat``: ``0.5 * randn`` (a nucleus of most of the vocabulary).

Usage: python bench/topp.py [--batch 64] [--vocab 152064] [--reps 7]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ("peaked", "randn3", "flat")


def make_logits(shape: str, batch: int, vocab: int, seed: int = 0) -> np.ndarray:
  """[batch, vocab] float32 logits of the named shape (see the module docstring)."""
  rng = np.random.default_rng(seed)
  if shape == "randn3":
    return (3.0 * rng.standard_normal((batch, vocab))).astype(np.float32)
  if shape == "flat":
    return (0.5 * rng.standard_normal((batch, vocab))).astype(np.float32)
  if shape != "peaked":
    raise ValueError(f"shape={shape!r} must be one of {SHAPES}")
  x = 2.0 * rng.standard_normal((batch, vocab))
  head = x.max(-1, keepdims=True) + rng.uniform(8.0, 20.0, (batch, 1)) - 1.5 * np.arange(8)
  ids = np.stack([rng.choice(vocab, 8, replace=False) for _ in range(batch)])
  np.put_along_axis(x, ids, head, axis=-1)
  return x.astype(np.float32)


def _time(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  best = float("inf")
  for _ in range(reps):  # the minimum: other processes share this CPU
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def step_times(logits, top_p: float = 0.95, reps: int = 7) -> tuple[float, float]:
  """(seconds with ``top_p``, seconds with top_p = 1) of one ``sample_token`` call."""
  from jaxreplay.sampling.generate import sample_token
  x = jnp.asarray(logits)
  key = jax.random.key(0)
  with_p = jax.jit(lambda k, l: sample_token(k, l, 1.0, 0, top_p))
  without = jax.jit(lambda k, l: sample_token(k, l, 1.0, 0, 1.0))
  return _time(with_p, key, x, reps=reps), _time(without, key, x, reps=reps)


def nucleus_sizes(logits, top_p: float = 0.95) -> np.ndarray:
  """[B] int: tokens kept per row by ``process_logits`` at ``top_p``."""
  from jaxreplay.models.logit_processing import process_logits
  return np.asarray((process_logits(jnp.asarray(logits), 1.0, 0, top_p) > -jnp.inf).sum(-1))


def measure_topp_ratio(batch: int = 64, vocab: int = 152064, shape: str = "peaked",
                       reps: int = 7) -> float:
  """Time of ``sample_token`` with top-p 0.95 over its time without, on ``shape`` logits."""
  with_p, without = step_times(make_logits(shape, batch, vocab), reps=reps)
  return with_p / without


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--vocab", type=int, default=152064)
  ap.add_argument("--reps", type=int, default=7)
  args = ap.parse_args()
  for shape in SHAPES:
    logits = make_logits(shape, args.batch, args.vocab)
    sizes = nucleus_sizes(logits)
    with_p, without = step_times(logits, reps=args.reps)
    print(f"{shape}: top_p=0.95 {with_p * 1e3:.1f} ms, top_p=1 {without * 1e3:.1f} ms, "
          f"ratio {with_p / without:.2f}; nucleus sizes min/median/max "
          f"{sizes.min()}/{int(np.median(sizes))}/{sizes.max()}")
  print(f"topp_ratio={measure_topp_ratio(args.batch, args.vocab, reps=args.reps):.3f}")


if __name__ == "__main__":
  main()
