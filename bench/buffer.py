"""Times ``replay.add`` / ``replay.sample`` against flashbax's item buffer on identical shapes.

Rollouts of 256 tokens (tokens int32, completion mask bool, behaviour log-probs float32 per
token, reward / advantage / version per rollout); adds of N = 64 rollouts, batches of
B = 128; capacities 1e3, 1e4, 1e5; buffers full. Both libraries run jitted with the state
donated, interleaved call by call (this machine's speed drifts), and the table reports
medians and median ratios. Our sampler draws without duplicates; flashbax's draws with
replacement. Issue 2 targets: ours/flashbax <= 1 for add and sample, and our sample at 1e5
within 1.5x of 1e3.

Usage (flashbax is a bench-only dependency):
  PYTHONPATH=/path/to/flashbax nice -n 19 python bench/replay.py [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay import replay

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
  fill, new = rollouts(capacity, 1), rollouts(N, 2)
  v = jnp.zeros((N,), jnp.int32)
  ours = replay.init(new, capacity)
  ours = jax.jit(replay.add, donate_argnums=0)(ours, fill, jnp.zeros((capacity,), jnp.int32), 0)
  add = jax.jit(replay.add, donate_argnums=0)
  sample = jax.jit(lambda s, k, v, t: replay.sample(s, k, B, v, t), donate_argnums=0)
  res = {"add": [], "sample": [], "fbx_add": [], "fbx_sample": []}
  if fbx is not None:
    buf = fbx.make_item_buffer(max_length=capacity, min_length=1, sample_batch_size=B,
                               add_batches=True)
    theirs = buf.add(buf.init(jax.tree.map(lambda x: x[0], new)), fill)
    f_add = jax.jit(buf.add, donate_argnums=0)
    f_sample = jax.jit(buf.sample)
  for i in range(reps + 3):  # first 3 = compile / warm-up, dropped
    key = jax.random.key(i)
    ours, t_add = timed(add, ours, new, v, jnp.int32(i))
    (ours, _), t_sample = timed(sample, ours, key, jnp.int32(i), jnp.int32(i))
    if fbx is not None:
      theirs, tf_add = timed(f_add, theirs, new)
      _, tf_sample = timed(f_sample, theirs, key)
    if i >= 3:
      res["add"].append(t_add)
      res["sample"].append(t_sample)
      if fbx is not None:
        res["fbx_add"].append(tf_add)
        res["fbx_sample"].append(tf_sample)
  out = {k: float(np.median(x)) for k, x in res.items() if x}
  if fbx is not None:
    out["add_ratio"] = float(np.median(np.array(res["add"]) / np.array(res["fbx_add"])))
    out["sample_ratio"] = float(np.median(np.array(res["sample"]) / np.array(res["fbx_sample"])))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=200)
  ap.add_argument("--capacities", type=str, default="1000,10000,100000")
  args = ap.parse_args()
  try:
    import flashbax as fbx
  except ImportError:
    fbx = None
    print("flashbax not importable: timing jaxreplay only")
  caps = [int(c) for c in args.capacities.split(",")]
  rows = {c: bench(c, args.reps, fbx) for c in caps}
  us = lambda s: f"{1e6 * s:9.1f}"
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, T={T}, add N={N}, sample B={B}, "
        f"median of {args.reps} interleaved calls (µs)")
  print("| capacity | add | fbx add | add ratio | sample (no dup) | fbx sample (w/ repl.) "
        "| sample ratio |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for c, r in rows.items():
    print(f"| {c:,} | {us(r['add'])} | {us(r.get('fbx_add', np.nan))} | "
          f"{r.get('add_ratio', np.nan):.2f} | {us(r['sample'])} | "
          f"{us(r.get('fbx_sample', np.nan))} | {r.get('sample_ratio', np.nan):.2f} |")
  lo, hi = rows[caps[0]]["sample"], rows[caps[-1]]["sample"]
  print(f"our sample cost at C={caps[-1]:,} / C={caps[0]:,}: {hi / lo:.2f}x (target <= 1.5)")


if __name__ == "__main__":
  main()
