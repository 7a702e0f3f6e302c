"""Correctness probe of JAX's Pallas GPU paged-attention kernel against a dense reference.

``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`` (Triton lowering) is a
candidate for the decode engine's attention over a paged KV cache; before any use, this
checks its output on the real GPU. For each case (grouped-query heads, head size 128,
pages of 16 tokens scattered by a random block table, per-sequence lengths that include
1, a page boundary and the full width) and each dtype (float32, bfloat16) it prints the
largest absolute error of

* the kernel, and
* a plain XLA gather-then-attend in the same dtype (float32 accumulation), the baseline of
  what rounding alone costs,

against a float64 NumPy reference computed from the same (dtype-rounded) inputs, and the
median time of each over ``--reps`` calls. The kernel does not scale the logits: q is
pre-scaled by 1/sqrt(head size) for all three.

Usage (GPU): python bench/paged_attention_probe.py
          CPU smoke (Pallas interpreter, small cases): python bench/paged_attention_probe.py --interpret
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# (name, batch, q heads, kv heads, head size, page size, pages per sequence)
CASES = (
    ("gqa 16/2 (8 per kv head)", 8, 16, 2, 128, 16, 64),
    ("gqa 14/2 (7 per kv head: padded to block_h)", 8, 14, 2, 128, 16, 64),
    ("gqa 32/8 (4 per kv head)", 8, 32, 8, 128, 16, 64),
    ("gqa 16/2, batch 64, 2048 tokens", 64, 16, 2, 128, 16, 128),
)
SMALL = (("gqa 4/2 (interpret)", 4, 4, 2, 128, 16, 16),)


def make_case(b, h, k, d, page, pps, dtype, seed=0):
  """Inputs of one case: q [B, H, D] (pre-scaled), k/v pages [K, B·pps, page, D], a random
  block table [B, pps] (a permutation of all pages) and int32 lengths [B] in [1, pps·page]."""
  rng = np.random.RandomState(seed)
  width = pps * page
  q = rng.randn(b, h, d).astype(np.float32) / np.sqrt(d)
  kp = rng.randn(k, b * pps, page, d).astype(np.float32)
  vp = rng.randn(k, b * pps, page, d).astype(np.float32)
  tables = rng.permutation(b * pps).reshape(b, pps).astype(np.int32)
  lengths = rng.randint(1, width + 1, b).astype(np.int32)
  fixed = [1, page, page + 1, width]
  lengths[:min(b, len(fixed))] = fixed[:b]
  # the inputs as the kernel sees them (rounded to dtype), then float64 for the reference
  q, kp, vp = (x.astype(jnp.dtype(dtype)).astype(np.float32) for x in (q, kp, vp))
  return q, kp, vp, tables, lengths


def reference(q, kp, vp, tables, lengths):
  """Dense float64 attention of each sequence's first ``length`` cached tokens."""
  b, h, d = q.shape
  k = kp.shape[0]
  g = h // k
  out = np.zeros((b, h, d))
  for i in range(b):
    n = int(lengths[i])
    keys = kp[:, tables[i]].reshape(k, -1, d)[:, :n].astype(np.float64)  # [K, n, D]
    vals = vp[:, tables[i]].reshape(k, -1, d)[:, :n].astype(np.float64)
    qi = q[i].reshape(k, g, d).astype(np.float64)
    logits = np.einsum("kgd,knd->kgn", qi, keys)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[i] = np.einsum("kgn,knd->kgd", p, vals).reshape(h, d)
  return out


@jax.jit
def xla_dense(q, kp, vp, tables, lengths):
  """Gather the pages, then masked attention in the inputs' dtype, float32 accumulation."""
  b, h, d = q.shape
  k = kp.shape[0]
  keys = kp[:, tables].reshape(k, b, -1, d)  # [K, B, S, D]
  vals = vp[:, tables].reshape(k, b, -1, d)
  qg = q.reshape(b, k, h // k, d)
  logits = jnp.einsum("bkgd,kbsd->bkgs", qg, keys, preferred_element_type=jnp.float32)
  mask = jnp.arange(keys.shape[2])[None, :] < lengths[:, None]  # [B, S]
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("bkgs,kbsd->bkgd", p.astype(q.dtype), vals, preferred_element_type=jnp.float32)
  return o.reshape(b, h, d).astype(q.dtype)


def median_s(fn, reps):
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke)")
  p.add_argument("--reps", type=int, default=20)
  a = p.parse_args()
  from jax.experimental.pallas.ops.gpu import paged_attention as pa

  dev = jax.devices()[0]
  print(f"device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}; "
        f"{'interpreter' if a.interpret else 'Triton kernel'}; kernel defaults block_h=16, "
        "pages_per_compute_block=8, k_splits=16")
  print("| case | dtype | kernel max abs err | XLA dense max abs err | max abs ref | "
        "kernel ms | XLA dense ms |")
  print("|---|---|---|---|---|---|---|")
  failures = 0
  for name, b, h, k, d, page, pps in (SMALL if a.interpret else CASES):
    for dtype in (jnp.float32, jnp.bfloat16):
      dn = jnp.dtype(dtype).name
      q, kp, vp, tables, lengths = make_case(b, h, k, d, page, pps, dtype)
      ref = reference(q, kp, vp, tables, lengths)
      args = tuple(jnp.asarray(x, dtype) for x in (q, kp, vp)) + (
          jnp.asarray(tables), jnp.asarray(lengths))
      k_splits = min(16, pps)
      try:
        kern = lambda: pa.paged_attention(*args, k_splits=k_splits, interpret=a.interpret)  # noqa: E731
        out = np.asarray(kern().astype(jnp.float32), np.float64)
        err = float(np.abs(out - ref).max())
        bad = int((~np.isfinite(out)).sum())
        t_kern = median_s(kern, a.reps)
        kern_cell = f"{err:.3g}" + (f" ({bad} non-finite)" if bad else "")
        kern_ms = f"{t_kern * 1e3:.3f}"
      except Exception as e:  # noqa: BLE001 - a probe: report and go on
        failures += 1
        kern_cell, kern_ms = f"failed: {type(e).__name__}", "-"
        print("".join(traceback.format_exception_only(type(e), e)).strip()[-800:])
      dense = lambda: xla_dense(*args)  # noqa: E731
      out_x = np.asarray(dense().astype(jnp.float32), np.float64)
      err_x = float(np.abs(out_x - ref).max())
      t_x = median_s(dense, a.reps)
      print(f"| {name}, B={b}, D={d}, page {page} × {pps}, lengths {lengths.min()}–"
            f"{lengths.max()} | {dn} | {kern_cell} | {err_x:.3g} | {np.abs(ref).max():.3g} | "
            f"{kern_ms} | {t_x * 1e3:.3f} |", flush=True)
  print(f"kernel failures: {failures}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
