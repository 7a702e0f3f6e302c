"""What recording completions costs a learner step, measured in one process.

    python bench/record_overhead.py [--config configs/default.py] [--reps 6] [--set KEY=VALUE ...]

Builds the run (a 20-step warm start cached under /tmp unless ``--set`` says otherwise), fills
the buffer once, then alternates, after one untimed warm-up of each:

* a learner step as the lagged strategy runs it: GENERATE + INSERT one round, SAMPLE + UPDATE;
* what a recording step adds before the update: the batch's first ``log.record_rollouts`` rows
  drawn again and scored (``samples.peek_trained``), decoded and written
  (``samples.train_records`` + ``samples.write``).

and one evaluation without records against the same evaluation (same key) with its
``eval.record`` questions' records built and written. Prints the medians and the ratios
``step_with_train_record / step`` at ``log.record_every`` = 1 (the worst case) and at the
run's own interval (``eval.every``), and ``eval_with_records / eval``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> dict:
  """Runs the measurement; returns the medians (seconds) and ratios it prints."""
  import jax
  import numpy as np

  from jaxreplay import config as config_lib
  from jaxreplay.train import lagged, samples
  from jaxreplay.train.build import build

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--reps", type=int, default=6)
  p.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE")
  a = p.parse_args(argv)
  tmp = tempfile.mkdtemp(prefix="record-overhead-")
  c = config_lib.load_config(a.config)
  config_lib.apply_overrides(c, [f"workdir={tmp}/run", f"warmstart.cache_dir={tmp}/base",
                                 "warmstart.steps=20", "log.progress=False",
                                 "log.tensorboard=False", "log.record_every=1",
                                 "eval.num_examples=64", *a.set])
  job, carry = build(config_lib.validate(c), log=lambda *_: None)
  every = max(c.eval.every, 1)

  def block(x):
    return jax.block_until_ready(x)

  step_t, rec_t = [], []
  key = jax.random.key(0)
  carry, _ = lagged.generate_and_insert(job, carry, 0, jax.random.fold_in(key, 0))
  for i in range(a.reps + 1):
    k_gen, k_sample = jax.random.split(jax.random.fold_in(key, i + 1))
    t0 = time.perf_counter()
    carry, _ = lagged.generate_and_insert(job, carry, i + 1, k_gen)
    state, buffer, m = job.fns.learner_step(carry.state, carry.buffer, k_sample)
    block((state, buffer, m))
    t1 = time.perf_counter()
    carry = carry.replace(state=state, buffer=buffer)
    trained = samples.peek_trained(job, carry.state.params, carry.buffer, k_sample,
                                   carry.state.step, 1)
    samples.write(tmp, f"train_{i}.jsonl", i, samples.train_records(job.io, trained))
    t2 = time.perf_counter()
    if i:  # the first of each is the warm-up (compiles)
      step_t.append(t1 - t0)
      rec_t.append(t2 - t1)
  ev_off, ev_on = [], []
  for i in range(a.reps + 1):  # pairs in alternating order; the first pair is the warm-up
    k = jax.random.fold_in(key, 100 + i)
    times = {}
    for recorded in ((False, True) if i % 2 else (True, False)):
      t0 = time.perf_counter()
      if recorded:
        _, records = samples.split(job.evaluate(carry.state.params, key=k))
        samples.write(tmp, f"eval_{i}.jsonl", i, records)
      else:  # the same evaluation (same key), no records
        job.evaluate(carry.state.params, key=k, record=())
      times[recorded] = time.perf_counter() - t0
    if i:
      ev_off.append(times[False])
      ev_on.append(times[True])
  med = {k: float(np.median(v)) for k, v in (("step_s", step_t), ("train_record_s", rec_t),
                                             ("eval_s", ev_off), ("eval_recorded_s", ev_on))}
  med["ratio_every_step"] = (med["step_s"] + med["train_record_s"]) / med["step_s"]
  med["ratio_every_eval_interval"] = 1 + med["train_record_s"] / (every * med["step_s"])
  med["ratio_eval"] = med["eval_recorded_s"] / med["eval_s"]
  print(f"config={a.config} R={c.rollout.per_step} B={c.train.batch_size} "
        f"record_rollouts={c.log.record_rollouts} eval.record={c.eval.record} reps={a.reps}")
  print(" ".join(f"{k}={v:.4f}" for k, v in med.items()))
  return med


if __name__ == "__main__":
  main()
