"""Matmul rates of this machine's XLA backend by precision, at the SmolLM2-135M MLP's shape.

A [M, D] × [D, F] product (default 768 × 576 × 1536: a 768-token learner batch through the
gate projection) in three precisions, jitted, timed as the best of 3 rounds of ``--calls``:

* ``f32``: float32 operands and result (what ``model.dtype="float32"`` runs);
* ``bf16``: bfloat16 operands and result (what ``model.dtype="bfloat16"`` asks of a dot);
* ``bf16_to_f32``: bfloat16 operands, float32 result
  (``preferred_element_type=float32``), the form some CPU kernels (AMX, AVX-512 BF16) take.

With ``--torch`` it also times PyTorch's CPU matmul (the test extras' torch, the TRL peer's
library) in float32 and in bfloat16, and under ``torch.autocast("cpu", bfloat16)`` with float32
inputs, as a peer run with ``bf16=True`` would, each the best of 3 rounds of ``--calls``.

Ends with ``matmul_rates f32_gflops=F bf16_gflops=F bf16_to_f32_gflops=F`` (GFLOP/s, 2·M·D·F
per product), after the line ``torch_matmul_rates f32_gflops=F bf16_gflops=F autocast_gflops=F``
with ``--torch``.

Usage: python bench/matmul_rates.py [--m 768 --d 576 --f 1536 --calls 30] [--torch]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def rate(fn, x, w, flops: float, calls: int) -> float:
  """GFLOP/s of ``fn(x, w)``, jitted: the best of 3 rounds of ``calls`` calls."""
  f = jax.jit(fn)
  jax.block_until_ready(f(x, w))
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(calls):
      y = f(x, w)
    jax.block_until_ready(y)
    best = min(best, (time.perf_counter() - t0) / calls)
  return flops / best / 1e9


def torch_rates(a, flops: float) -> None:
  """Prints PyTorch's CPU matmul rates (GFLOP/s) at the same shape: float32, bfloat16, and
  float32 inputs under bfloat16 autocast; each the best of 3 rounds of ``a.calls``."""
  import torch

  def best(fn) -> float:
    fn()
    t = float("inf")
    for _ in range(3):
      t0 = time.perf_counter()
      for _ in range(a.calls):
        fn()
      t = min(t, (time.perf_counter() - t0) / a.calls)
    return flops / t / 1e9

  g = torch.Generator().manual_seed(0)
  x, w = torch.randn(a.m, a.d, generator=g), torch.randn(a.d, a.f, generator=g)
  xb, wb = x.bfloat16(), w.bfloat16()

  def autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
      return x @ w

  r = {"f32": best(lambda: x @ w), "bf16": best(lambda: xb @ wb), "autocast": best(autocast)}
  print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
  print(f"torch_matmul_rates f32_gflops={r['f32']:.0f} bf16_gflops={r['bf16']:.0f} "
        f"autocast_gflops={r['autocast']:.0f}")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--m", type=int, default=768)
  p.add_argument("--d", type=int, default=576)
  p.add_argument("--f", type=int, default=1536)
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--torch", action="store_true", help="also time PyTorch's CPU matmul")
  a = p.parse_args()
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (a.m, a.d))
  w = jax.random.normal(kw, (a.d, a.f))
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  flops = 2.0 * a.m * a.d * a.f
  r = {"f32": rate(jnp.dot, x, w, flops, a.calls),
       "bf16": rate(jnp.dot, xb, wb, flops, a.calls),
       "bf16_to_f32": rate(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                           xb, wb, flops, a.calls)}
  if a.torch:
    torch_rates(a, flops)
  print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
        f"[{a.m}, {a.d}] x [{a.d}, {a.f}]")
  print(f"matmul_rates f32_gflops={r['f32']:.0f} bf16_gflops={r['bf16']:.0f} "
        f"bf16_to_f32_gflops={r['bf16_to_f32']:.0f}")
  return 0


if __name__ == "__main__":
  main()
