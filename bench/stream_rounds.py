"""Rounds streamed through one set of decode slots against one engine call per round.

``python bench/stream_rounds.py [--rounds 6 --slots 64 --group 8 --reps 3]``

The actor–learner split's generator decodes round after round of R requests. One
``engine.run`` per round waits for the round's longest completion while the slots its
finished requests free sit idle (the tail shrinks to smaller buckets, but a decode step at
a few slots costs on an accelerator nearly what one at all of them does: it reads the same
weights). ``engine.stream`` takes the next round's requests into those slots as soon as
every request it holds is admitted (``ROUNDS_IN_FLIGHT`` rounds at most).

Protocol: a random 2-layer decoder (d = 256, vocab 8,192, float32) on the CPU; each round
R = ``--slots`` requests (``--slots / --group`` prompts of ~32 real tokens padded to 96,
G = ``--group``), completion lengths forced to lognormal draws with the shape of real RL
runs at 1/4 scale (mean 75, cap 256, 2% truncated; ``generate.lognormal_lengths``), a new
draw and key per round. Both sides decode the same rounds with S = R slots and 16-step
chunks; every round's tokens must come out equal. Measured in the same run: decode steps
(sum over chunks of the longest replica's steps: the device time on an accelerator, where
a step's cost barely depends on how many slots decode), slot occupancy (row-steps that
sampled a token ÷ row-steps run) and wall time on this host (median of ``--reps``
interleaved repetitions, after a compiling pass; on the CPU a step's cost follows the slots
it decodes, so the time gains less than the steps). Last line::

  stream_rounds rounds=N steps_stream_vs_rounds=F time_stream_vs_rounds=F occupancy_stream=F occupancy_rounds=F
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--slots", type=int, default=64, help="S = R requests per round")
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--reps", type=int, default=3)
  return p.parse_args(argv)


def main(argv=None) -> int:
  """Runs the comparison; prints the measurements and, last, the key=value line."""
  a = parse(argv)
  import jax
  import numpy as np
  from flax import nnx

  from generate import lognormal_lengths
  from jaxreplay.models import Transformer, TransformerConfig
  from jaxreplay.sampling import engine

  cfg = TransformerConfig(vocab_size=8192, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=64, d_ff=1024)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  cap, mean, width, real = 256, 75.0, 96, 32
  eos, n_prompts = 1, a.slots // a.group
  rng = np.random.RandomState(0)
  rounds = []
  for j in range(a.rounds):
    plen = np.clip(rng.normal(real, real / 4, n_prompts).round(), 4, width).astype(int)
    toks = np.zeros((n_prompts, width), np.int32)
    mask = np.zeros((n_prompts, width), bool)
    for i, n in enumerate(plen):
      toks[i, width - n:] = rng.randint(2, cfg.vocab_size, n)
      mask[i, width - n:] = True
    rounds.append((toks, mask, jax.random.key(j), j, lognormal_lengths(rng, a.slots, mean, cap)))
  lengths = np.concatenate([r[4] for r in rounds])
  print(f"{a.rounds} rounds of {a.slots} requests ({n_prompts} prompts x G={a.group}), "
        f"S={a.slots} slots; lengths mean {lengths.mean():.1f}, cap {cap}, truncated "
        f"{np.mean(lengths == cap):.3f}", flush=True)
  kw = dict(max_new_tokens=cap, temperature=1.0, eos_ids=(eos,), pad_id=0,
            group_size=a.group, slots=a.slots, chunk_steps=16)

  def one_call_per_round():
    out, stats = [], []
    for toks, mask, key, _, forced in rounds:
      *res, st = engine.run(graphdef, params, toks, mask, key, forced_lengths=forced, **kw)
      out.append(res[0])
      stats.append(st)
    return out, stats

  def streamed():
    queue, out = list(rounds), {}
    st = engine.stream(graphdef, params, lambda block: queue.pop(0) if queue else None,
                       lambda tag, tokens, *_: out.__setitem__(tag, tokens), **kw)
    return [out[j] for j in range(a.rounds)], [st]

  def counted(fn):
    """fn's outputs, stats and decode steps (each chunk's steps read on the host)."""
    steps, original = [], engine._decode_chunk

    def logged(*args, **kwargs):
      out = original(*args, **kwargs)
      steps.append(int(np.max(out[1])))
      return out

    engine._decode_chunk = logged
    try:
      out, stats = fn()
    finally:
      engine._decode_chunk = original
    return out, stats, sum(steps)

  base, base_stats, base_steps = counted(one_call_per_round)
  got, got_stats, got_steps = counted(streamed)
  for j, (x, y) in enumerate(zip(base, got)):
    assert np.array_equal(x, y), f"round {j}: the stream's tokens differ from run's"
  occ = lambda stats: (sum(s.useful_row_steps for s in stats)
                       / sum(s.row_steps for s in stats))
  print(f"one call per round: {base_steps} decode steps, {sum(s.chunks for s in base_stats)} "
        f"chunks, occupancy {occ(base_stats):.3f}", flush=True)
  print(f"stream:             {got_steps} decode steps, {got_stats[0].chunks} chunks, "
        f"occupancy {occ(got_stats):.3f}; every round's tokens equal", flush=True)

  times = {"rounds": [], "stream": []}
  for _ in range(a.reps):  # interleaved: drift on a shared host hits both sides alike
    for name, fn in (("rounds", one_call_per_round), ("stream", streamed)):
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  t_rounds, t_stream = (statistics.median(times[k]) for k in ("rounds", "stream"))
  print(f"wall time (median of {a.reps}): one call per round {t_rounds:.2f} s, stream "
        f"{t_stream:.2f} s", flush=True)
  print(f"stream_rounds rounds={a.rounds} steps_stream_vs_rounds={got_steps / base_steps:.3f} "
        f"time_stream_vs_rounds={t_stream / t_rounds:.3f} "
        f"occupancy_stream={occ(got_stats):.3f} occupancy_rounds={occ(base_stats):.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
