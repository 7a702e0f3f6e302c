"""Times ``replay.add`` / ``replay.sample`` against flashbax's item buffer on identical shapes.

Rollouts of T = 256 tokens (tokens int32, completion mask bool, behaviour log-probs float32 per
token; reward, advantage and version per rollout), adds of N = 64 rollouts, batches of
B = 128, capacities 1e3, 1e4, 1e5, buffers full. Both libraries get the same items and keys,
run through their jitted functions (ours: ``replay.make_replay_buffer``'s bundle, whose
``sample`` donates and returns only what sampling changes; flashbax: ``jax.jit`` of its
``add`` with the state donated and of its ``sample``, which returns no state), are warmed up
before timing, and are timed call by call with ``block_until_ready``. A third column times
``jax.jit(replay.sample)`` with the whole state donated and returned, to show what the
calling convention costs. The calls are interleaved because this machine's speed drifts: every
round runs one add and one sample of each library at every capacity, the order alternating
from round to round, and the table reports median times and medians of per-round ratios
(also for the cost of sampling at 1e5 against 1e3). Our sampler draws without duplicates
and updates the items' use counters; flashbax's draws with replacement and updates nothing.

Issue 2 targets: ours / flashbax <= 1 for add and for sample, and our sample at C = 1e5 within
1.5x of C = 1e3.

Usage (flashbax is a bench-only dependency: ``pip install -e '.[bench]'``):
  python bench/buffer.py [--reps 500] [--capacities 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay import replay  # noqa: E402

T, N, B = 256, 64, 128


def rollouts(n: int, seed: int = 0) -> dict:
  k = jax.random.key(seed)
  return {"tokens": jax.random.randint(k, (n, T), 0, 32000, jnp.int32),
          "completion_mask": jnp.ones((n, T), bool),
          "behaviour_logprobs": -jax.random.uniform(k, (n, T), jnp.float32),
          "rewards": jnp.ones((n,), jnp.float32),
          "advantages": jnp.zeros((n,), jnp.float32),
          "policy_version": jnp.zeros((n,), jnp.int32)}


def timed(fn, *args):
  t = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return out, time.perf_counter() - t


class Contender:
  """One capacity: our buffer and flashbax's, filled, jitted with donation, and timed."""

  def __init__(self, capacity: int, fbx):
    fill, self.new = rollouts(capacity, 1), rollouts(N, 2)
    self.version = jnp.zeros((N,), jnp.int32)
    rb = replay.make_replay_buffer(capacity, B)  # the library's jitted bundle
    self.add, self.sample = rb.add, rb.sample
    # Also timed: `replay.sample` jitted whole, the full state donated and returned.
    self.raw_sample = jax.jit(lambda s, k, v, t: replay.sample(s, k, B, v, t),
                              donate_argnums=0)
    self.ours, self.raw = (self.add(rb.init(self.new), fill, jnp.zeros((capacity,), jnp.int32),
                                    jnp.int32(0)) for _ in range(2))
    self.fbx = fbx
    if fbx is not None:
      buf = fbx.make_item_buffer(max_length=capacity, min_length=1, sample_batch_size=B,
                                 add_batches=True)
      self.f_add = jax.jit(buf.add, donate_argnums=0)
      self.f_sample = jax.jit(buf.sample)
      self.theirs = self.f_add(buf.init(jax.tree.map(lambda x: x[0], self.new)), fill)
    self.times = {"add": [], "sample": [], "raw_sample": [], "fbx_add": [], "fbx_sample": []}

  def round_ours(self, key, step):
    self.ours, t_add = timed(self.add, self.ours, self.new, self.version, step)
    (self.ours, _), t_sample = timed(self.sample, self.ours, key, step, step)
    (self.raw, _), t_raw = timed(self.raw_sample, self.raw, key, step, step)
    return t_add, t_sample, t_raw

  def round_theirs(self, key):
    if self.fbx is None:
      return np.nan, np.nan
    self.theirs, t_add = timed(self.f_add, self.theirs, self.new)
    _, t_sample = timed(self.f_sample, self.theirs, key)
    return t_add, t_sample

  def round(self, i, key, step, keep):
    """One add and one sample each; who goes first alternates with i."""
    if i % 2:
      t = self.round_ours(key, step) + self.round_theirs(key)
    else:
      theirs = self.round_theirs(key)
      t = self.round_ours(key, step) + theirs
    if keep:
      for name, x in zip(("add", "sample", "raw_sample", "fbx_add", "fbx_sample"), t):
        self.times[name].append(x)


def bench(capacities: list[int], reps: int, fbx) -> dict:
  """Per capacity: median seconds per call and median per-round ours / flashbax ratios.

  Every round visits every capacity (in alternating order), so the cost ratio between two
  capacities is also a median of per-round ratios, not a comparison across drifting time.
  """
  contenders = {c: Contender(c, fbx) for c in capacities}
  keys = [jax.random.key(i) for i in range(reps + 5)]
  steps = [jnp.int32(i) for i in range(reps + 5)]
  for i in range(reps + 5):  # the first 5 rounds compile and warm up; dropped
    for c in (capacities if i % 2 else capacities[::-1]):
      contenders[c].round(i, keys[i], steps[i], keep=i >= 5)
  out = {}
  for c, con in contenders.items():
    r = {k: np.array(v) for k, v in con.times.items()}
    out[c] = {k: float(np.median(v)) for k, v in r.items()}
    out[c]["add_ratio"] = float(np.median(r["add"] / r["fbx_add"]))
    out[c]["sample_ratio"] = float(np.median(r["sample"] / r["fbx_sample"]))
    out[c]["raw_ratio"] = float(np.median(r["raw_sample"] / r["fbx_sample"]))
    out[c]["sample_raw"] = r["sample"]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=500)
  ap.add_argument("--capacities", type=str, default="1000,10000,100000")
  args = ap.parse_args()
  try:
    import flashbax as fbx
  except ImportError:
    fbx = None
    print("flashbax is not importable (pip install -e '.[bench]'): timing jaxreplay only")
  caps = [int(c) for c in args.capacities.split(",")]
  t0 = time.perf_counter()
  rows = bench(caps, args.reps, fbx)
  us = lambda s: f"{1e6 * s:.0f}"
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, load "
        f"average {load:.1f}; T={T}, add N={N}, sample B={B}; median of {args.reps} "
        f"interleaved rounds (µs); ratio = median of per-round ours / flashbax; "
        f"{time.perf_counter() - t0:.0f} s")
  print("| capacity | add | flashbax add | add ratio | sample (no dup) "
        "| flashbax sample (w/ repl.) | sample ratio | whole-state jit | its ratio |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for c, r in rows.items():
    print(f"| {c:,} | {us(r['add'])} | {us(r['fbx_add'])} | {r['add_ratio']:.2f} | "
          f"{us(r['sample'])} | {us(r['fbx_sample'])} | {r['sample_ratio']:.2f} | "
          f"{us(r['raw_sample'])} | {r['raw_ratio']:.2f} |")
  flat = np.median(rows[caps[-1]]["sample_raw"] / rows[caps[0]]["sample_raw"])
  print(f"our sample at C={caps[-1]:,} / at C={caps[0]:,}: {flat:.2f}x, median of per-round "
        f"ratios (target <= 1.5)")


if __name__ == "__main__":
  main()
