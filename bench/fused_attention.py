"""Full-sequence attention through the platform's fused kernel against XLA's, at learner widths.

``models.attention.causal_attention`` runs the learner's causal attention within packed
segments through cuDNN's fused flash attention on a GPU, the Pallas splash kernel on a TPU,
or XLA's dense-mask attention (which forms the [B, H, T, T] scores). For each case (rows
of T tokens holding three packed sequences and some padding, grouped-query heads) this
times a jitted forward + backward of the attention alone with the platform's kernel and
with XLA, both in bfloat16 (median of ``--reps`` calls after one compiling call), and
prints the largest absolute difference of each output from a float32 XLA computation on
the same bfloat16 inputs (the rounding baseline), over real tokens.

The last line is
``fused_attention platform=P impl=I fwd_bwd_fused_vs_xla=F max_err_fused=F max_err_xla=F``
for the last (largest) case: the fused kernel's time as a fraction of XLA's.

Usage (GPU or TPU): python bench/fused_attention.py
          CPU smoke (splash in Pallas interpret mode, one small case, times meaningless):
          python bench/fused_attention.py --interpret
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# (name, rows B, positions T, query heads H, KV heads K, head size E)
CASES = (
    ("Qwen2.5-0.5B widths, 16 x 512", 16, 512, 14, 2, 64),
    ("Qwen2.5-0.5B widths, 4 x 4096", 4, 4096, 14, 2, 64),
    ("Qwen2.5-7B widths, 2 x 4096", 2, 4096, 28, 4, 128),
)
SMALL = (("interpret smoke, 2 x 256", 2, 256, 4, 2, 64),)


def segments(b: int, t: int) -> np.ndarray:
  """[B, T] int32: three packed sequences of 40%, 35% and 20% of the row, then padding (-1)."""
  cuts = np.cumsum([int(t * 0.4), int(t * 0.35), int(t * 0.2)])
  pos = np.arange(t)
  seg = np.where(pos < cuts[0], 1, np.where(pos < cuts[1], 2, np.where(pos < cuts[2], 3, -1)))
  return np.broadcast_to(seg, (b, t)).astype(np.int32)


def timed(f, args, reps: int) -> float:
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--interpret", action="store_true",
                 help="CPU smoke: splash in Pallas interpret mode on one small case")
  a = p.parse_args()
  from jaxreplay.models import attention

  platform = jax.default_backend()
  impl = "splash" if a.interpret else attention.resolve("auto", platform)
  if impl == "xla":
    print(f"no fused attention on platform {platform!r}: run on a GPU or TPU, or --interpret")
    return 1
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, fused impl {impl}")
  print()
  print("| case | fused fwd+bwd ms | xla fwd+bwd ms | fused / xla | max err fused | max err xla |")
  print("|---|---|---|---|---|---|")
  line = ""
  for name, b, t, h, kh, e in (SMALL if a.interpret else CASES):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, e)), jnp.bfloat16) for n in (h, kh, kh))
    seg = jnp.asarray(segments(b, t))
    real = (np.asarray(seg) >= 0)[:, :, None, None]

    def fwd_bwd(which):
      def loss(q, k, v):
        out = attention.causal_attention(q, k, v, impl=which, segment_ids=seg)
        return jnp.sum(jnp.where(real, out, 0).astype(jnp.float32))
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    fwd = {w: jax.jit(lambda q, k, v, w=w: attention.causal_attention(q, k, v, impl=w,
                                                                       segment_ids=seg))
           for w in (impl, "xla")}
    ref = np.asarray(attention.causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                impl="xla", segment_ids=seg))
    err = {w: float(np.abs(np.where(real, np.asarray(fwd[w](q, k, v), np.float32) - ref, 0)).max())
           for w in fwd}
    s = {w: timed(fwd_bwd(w), (q, k, v), a.reps) for w in (impl, "xla")}
    ratio = s[impl] / s["xla"]
    print(f"| {name} | {s[impl] * 1e3:.2f} | {s['xla'] * 1e3:.2f} | {ratio:.3f} | "
          f"{err[impl]:.2e} | {err['xla']:.2e} |", flush=True)
    line = (f"fused_attention platform={platform} impl={impl} fwd_bwd_fused_vs_xla={ratio:.3f} "
            f"max_err_fused={err[impl]:.2e} max_err_xla={err['xla']:.2e}")
  print()
  print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
