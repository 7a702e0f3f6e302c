"""Rounds streamed through one set of decode slots against one engine call per round.

``python bench/stream_rounds.py [--rounds 12 --slots 64 --group 8 --reps 3]``

The actor–learner split's generator decodes round after round of R requests. One
``engine.run`` per round waits for the round's longest completion while the slots its
finished requests free sit idle (its tail shrinks to smaller slot buckets). ``engine.stream``
takes the next round's requests into those slots as soon as every request it holds is
admitted (at most ``engine.ROUNDS_IN_FLIGHT`` rounds held; a stream never shrinks).

Protocol: a random 2-layer decoder (d = 256, vocab 8,192, float32) on the CPU; each round
R = ``--slots`` requests (``--slots / --group`` prompts of ~32 real tokens padded to 96,
G = ``--group``), completion lengths forced to lognormal draws with the shape of real RL
runs at 1/4 scale (mean 75, cap 256, 2% truncated; ``generate.lognormal_lengths``), a new
draw and key per round. Both sides decode the same rounds with S = R slots and 16-step
chunks, on the contiguous KV cache and on the paged one; every round's tokens must come out
equal. Measured in the same run, for each cache: decode steps (sum over chunks of the steps
run), slot occupancy (row-steps that sampled a token ÷ row-steps run), KV positions read
(``EngineStats.kv_read``) and wall time on this host (median of ``--reps`` interleaved
repetitions, after a pass that compiles). Decode steps are what an accelerator pays when a
step's cost is its weight reads; on the CPU a step's cost follows the slots it decodes and,
with the contiguous cache, the attention width of its longest slot, which a stream keeps
wide (long stragglers beside fresh requests). Last line::

  stream_rounds rounds=N steps_stream_vs_rounds=F occupancy_stream=F occupancy_rounds=F time_stream_vs_rounds=F kv_read_stream_vs_rounds=F time_stream_vs_rounds_paged=F kv_read_stream_vs_rounds_paged=F
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
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--slots", type=int, default=64, help="S = R requests per round")
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--reps", type=int, default=3)
  return p.parse_args(argv)


def compare(engine, graphdef, params, rounds: list, kw: dict, reps: int) -> dict:
  """One ``engine.run`` per round against ``engine.stream`` of the same rounds.

  Args:
    engine: ``jaxreplay.sampling.engine``. graphdef, params: the policy. rounds: (prompt
      tokens, mask, key, index, forced lengths) per round. kw: the engine's settings.
    reps: timed repetitions of each side, interleaved.

  Returns:
    {"rounds" | "stream": {"steps", "chunks", "row_steps", "kv_read": ints, "occupancy":
     useful ÷ all row-steps, "time": median seconds}}.

  Raises:
    AssertionError: a round's tokens differ between the two.
  """
  import numpy as np

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
    return [out[j] for j in range(len(rounds))], [st]

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

  result, outs = {}, {}
  for name, fn in (("rounds", one_call_per_round), ("stream", streamed)):
    outs[name], stats, steps = counted(fn)  # also compiles
    total = lambda k: sum(getattr(s, k) for s in stats)  # noqa: E731
    result[name] = dict(steps=steps, chunks=total("chunks"), row_steps=total("row_steps"),
                        kv_read=total("kv_read"),
                        occupancy=total("useful_row_steps") / total("row_steps"), time=[])
  for j, (x, y) in enumerate(zip(outs["rounds"], outs["stream"])):
    assert np.array_equal(x, y), f"round {j}: the stream's tokens differ from run's"
  for _ in range(reps):  # interleaved: drift on a shared host hits both sides alike
    for name, fn in (("rounds", one_call_per_round), ("stream", streamed)):
      t0 = time.perf_counter()
      fn()
      result[name]["time"].append(time.perf_counter() - t0)
  for r in result.values():
    r["time"] = statistics.median(r["time"])
  return result


def main(argv=None) -> int:
  """Runs the comparison; prints the measurements and, last, the key=value line."""
  a = parse(argv)
  import jax
  import numpy as np
  from flax import nnx

  from generate import left_padded_prompts, lognormal_lengths
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
    toks, mask = left_padded_prompts(rng, n_prompts, real, width, cfg.vocab_size)
    rounds.append((toks, mask, jax.random.key(j), j, lognormal_lengths(rng, a.slots, mean, cap)))
  lengths = np.concatenate([r[4] for r in rounds])
  print(f"{a.rounds} rounds of {a.slots} requests ({n_prompts} prompts x G={a.group}), "
        f"S={a.slots} slots; lengths mean {lengths.mean():.1f}, cap {cap}, truncated "
        f"{np.mean(lengths == cap):.3f}", flush=True)
  line = f"stream_rounds rounds={a.rounds}"
  for cache in ("contiguous", "paged"):
    kw = dict(max_new_tokens=cap, temperature=1.0, eos_ids=(eos,), pad_id=0,
              group_size=a.group, slots=a.slots, chunk_steps=16, paged=cache == "paged",
              page_size=16)
    r = compare(engine, graphdef, params, rounds, kw, a.reps)
    print(f"{cache} KV cache:", flush=True)
    for name in ("rounds", "stream"):
      print(f"  {'one call per round' if name == 'rounds' else 'stream':18s} "
            f"{r[name]['steps']} decode steps, {r[name]['chunks']} chunks, "
            f"{r[name]['row_steps']} row-steps, occupancy {r[name]['occupancy']:.3f}, "
            f"{r[name]['kv_read']} KV positions read, {r[name]['time']:.2f} s "
            f"(median of {a.reps})", flush=True)
    ratio = lambda k: r["stream"][k] / r["rounds"][k]  # noqa: E731
    suffix = "" if cache == "contiguous" else "_paged"
    if cache == "contiguous":
      line += (f" steps_stream_vs_rounds={ratio('steps'):.3f}"
               f" occupancy_stream={r['stream']['occupancy']:.3f}"
               f" occupancy_rounds={r['rounds']['occupancy']:.3f}")
    line += (f" time_stream_vs_rounds{suffix}={ratio('time'):.3f}"
             f" kv_read_stream_vs_rounds{suffix}={ratio('kv_read'):.3f}")
  print("every round's tokens equal on both sides, both caches", flush=True)
  print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
