"""The decode engine's host check, blocking or overlapped (``sampler.overlap_host_check``).

``python bench/host_check.py [--slots 32] [--chunk 16] [--scale 0.25] [--rounds 3]``

Decodes the same ragged requests (lognormal completion lengths of mean 300 × scale, capped at
1024 × scale, forced with ``forced_lengths``; ``bench/generate.py``'s realistic shape) with
a small random decoder twice per round — the host reading each chunk before dispatching the
next, and dispatching it first — and prints the engine's row-steps and the median wall time
of each, ending with::

  host_check rows_overlap_vs_blocking=F time_overlap_vs_blocking=F chunk_s=F

rows: row-steps decoded (overlapped ÷ blocking: the price of refilling a freed slot a chunk
later); time: median seconds (overlapped ÷ blocking: on a CPU the device computes on the
host's cores, so only the Python between chunks can overlap); chunk_s: the blocking run's
seconds per chunk. On an accelerator the gain is the host's round trip per chunk against a
chunk's decode time — not measured here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  """Runs both host loops on the same requests; prints their ratios last; returns 0."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--chunk", type=int, default=16, help="decode steps per chunk (k)")
  p.add_argument("--scale", type=float, default=0.25, help="lengths × this (1: mean 300)")
  p.add_argument("--rounds", type=int, default=3)
  a = p.parse_args(argv)

  import jax
  from flax import nnx

  from generate import lognormal_lengths
  from jaxreplay.models import Transformer, TransformerConfig
  from jaxreplay.sampling import generate

  cfg = TransformerConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=64, d_ff=1024)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  rng = np.random.RandomState(0)
  cap, width, g = int(round(1024 * a.scale)), int(round(384 * a.scale)), 8
  n_req = 4 * a.slots
  lengths = lognormal_lengths(rng, n_req, 300 * a.scale, cap)
  toks = rng.randint(2, cfg.vocab_size, (n_req // g, width))
  mask = np.ones(toks.shape, bool)

  def run(overlap: bool):
    gen, st = generate(graphdef, params, toks, mask, jax.random.key(0), max_new_tokens=cap,
                       temperature=1.0, eos_ids=(1,), pad_id=0, group_size=g, slots=a.slots,
                       chunk_steps=a.chunk, forced_lengths=lengths, return_stats=True,
                       overlap_host_check=overlap)
    jax.block_until_ready(gen.tokens)
    return gen, st

  out, times = {}, {False: [], True: []}
  for overlap in (False, True):
    out[overlap] = run(overlap)  # compiles
  assert np.array_equal(np.asarray(out[False][0].tokens), np.asarray(out[True][0].tokens))
  for _ in range(a.rounds):
    for overlap in (False, True):  # interleaved: drift on a shared machine hits both
      t0 = time.perf_counter()
      run(overlap)
      times[overlap].append(time.perf_counter() - t0)
  blocking, overlapped = out[False][1], out[True][1]
  t_b, t_o = statistics.median(times[False]), statistics.median(times[True])
  print(f"requests {n_req}, lengths mean {lengths.mean():.1f} cap {cap}, S={a.slots}, "
        f"k={a.chunk}; same tokens both ways")
  for name, st, t in (("blocking", blocking, t_b), ("overlapped", overlapped, t_o)):
    print(f"{name}: {st.row_steps} row-steps ({st.useful_row_steps} useful), {st.chunks} "
          f"chunks, {st.inserts} inserts, median {t:.3f} s")
  print(f"host_check rows_overlap_vs_blocking={overlapped.row_steps / blocking.row_steps:.3f} "
        f"time_overlap_vs_blocking={t_o / t_b:.3f} chunk_s={t_b / blocking.chunks:.4f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
