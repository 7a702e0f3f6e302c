"""Times ``replay.add`` / ``replay.sample`` against flashbax's item buffer on identical shapes.

Rollouts of T = 256 tokens (tokens int32, completion mask bool, behaviour log-probs float32 per
token; reward, advantage and version per rollout), adds of N = 64 rollouts, batches of
B = 128, capacities 1e3, 1e4, 1e5, buffers full. Both libraries get the same items and keys,
run jitted with their state donated (flashbax's ``sample`` returns no state, so there is
nothing to donate), are warmed up before timing, and are timed call by call with
``block_until_ready``. The calls are interleaved (ours, theirs, theirs, ours, ...: the order
alternates every round) because this machine's speed drifts; the table reports median times
and the median of the per-round ratios. Our sampler draws without duplicates and updates the
items' use counters; flashbax's draws with replacement and updates nothing.

Issue 2 targets: ours / flashbax <= 1 for add and for sample, and our sample at C = 1e5 within
1.5x of C = 1e3.

Usage (flashbax is a bench-only dependency: ``pip install -e '.[bench]'``):
  python bench/buffer.py [--reps 300] [--capacities 1000,10000,100000]
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


def bench(capacity: int, reps: int, fbx) -> dict:
  """Median seconds per call and median per-round ratios, for one capacity."""
  fill, new = rollouts(capacity, 1), rollouts(N, 2)
  version = jnp.zeros((N,), jnp.int32)
  add = jax.jit(replay.add, donate_argnums=0)
  sample = jax.jit(lambda s, k, v, t: replay.sample(s, k, B, v, t), donate_argnums=0)
  ours = add(replay.init(new, capacity), fill, jnp.zeros((capacity,), jnp.int32), 0)
  if fbx is not None:
    buf = fbx.make_item_buffer(max_length=capacity, min_length=1, sample_batch_size=B,
                               add_batches=True)
    f_add = jax.jit(buf.add, donate_argnums=0)
    f_sample = jax.jit(buf.sample)
    theirs = f_add(buf.init(jax.tree.map(lambda x: x[0], new)), fill)
  else:
    theirs = None
  del fill
  keys = [jax.random.key(i) for i in range(reps + 5)]
  steps = [jnp.int32(i) for i in range(reps + 5)]

  def round_ours(state, i):
    state, t_add = timed(add, state, new, version, steps[i])
    (state, _), t_sample = timed(sample, state, keys[i], steps[i], steps[i])
    return state, t_add, t_sample

  def round_theirs(state, i):
    if fbx is None:
      return None, np.nan, np.nan
    state, t_add = timed(f_add, state, new)
    _, t_sample = timed(f_sample, state, keys[i])
    return state, t_add, t_sample

  res = {"add": [], "sample": [], "fbx_add": [], "fbx_sample": []}
  for i in range(reps + 5):  # the first 5 rounds compile and warm up; dropped
    if i % 2:
      ours, *t_ours = round_ours(ours, i)
      theirs, *t_theirs = round_theirs(theirs, i)
    else:
      theirs, *t_theirs = round_theirs(theirs, i)
      ours, *t_ours = round_ours(ours, i)
    if i >= 5:
      for name, t in zip(("add", "sample", "fbx_add", "fbx_sample"), t_ours + t_theirs):
        res[name].append(t)
  r = {k: np.array(v) for k, v in res.items()}
  out = {k: float(np.median(v)) for k, v in r.items()}
  out["add_ratio"] = float(np.median(r["add"] / r["fbx_add"]))
  out["sample_ratio"] = float(np.median(r["sample"] / r["fbx_sample"]))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=300)
  ap.add_argument("--capacities", type=str, default="1000,10000,100000")
  args = ap.parse_args()
  try:
    import flashbax as fbx
  except ImportError:
    fbx = None
    print("flashbax is not importable (pip install -e '.[bench]'): timing jaxreplay only")
  caps = [int(c) for c in args.capacities.split(",")]
  t0 = time.perf_counter()
  rows = {c: bench(c, args.reps, fbx) for c in caps}
  us = lambda s: f"{1e6 * s:.0f}"
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, load "
        f"average {load:.1f}; T={T}, add N={N}, sample B={B}; median of {args.reps} "
        f"interleaved rounds (µs); ratio = median of per-round ours / flashbax; "
        f"{time.perf_counter() - t0:.0f} s")
  print("| capacity | add | flashbax add | add ratio | sample (no dup) "
        "| flashbax sample (w/ repl.) | sample ratio |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for c, r in rows.items():
    print(f"| {c:,} | {us(r['add'])} | {us(r['fbx_add'])} | {r['add_ratio']:.2f} | "
          f"{us(r['sample'])} | {us(r['fbx_sample'])} | {r['sample_ratio']:.2f} |")
  lo, hi = rows[caps[0]]["sample"], rows[caps[-1]]["sample"]
  print(f"our sample at C={caps[-1]:,} / at C={caps[0]:,}: {hi / lo:.2f}x (target <= 1.5)")


if __name__ == "__main__":
  main()
