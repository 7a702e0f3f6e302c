"""Evaluation noise at fixed parameters: one held-out evaluation repeated under several keys.

  python bench/eval_noise.py --config configs/sweep/where_replay_pays.py \
      --run lr5e-5_onpolicy --seed 0 --keys 8 \
      --out data/sweeps/where_replay_pays.eval_noise.json

A sweep run's held-out curve jitters for two reasons: the sampled pass draws fresh
completions at every evaluation (noise at fixed parameters), and the policy moves between
evaluations. This bench separates the first: it restores the run's policy twice — the
warm-started base policy (step 0) and the run's last checkpoint — and evaluates each one
``--keys`` times with different PRNG keys, exactly as the trainer does (``Run.evaluate``:
the same held-out examples, ``eval.samples_per_example`` samples each). The SD over keys
of the sampled accuracy is the evaluation's own noise; the regime map prints it beside the
noise model's evaluation jitter fitted to the runs (``jaxreplay.regime_map``, reading
``--out``). The greedy pass is deterministic, so its SD over keys must be 0.

The run's directory is copied before it is restored (``loop.restore`` rewrites
``config.json``); the sweep's directory and archive are only read. Prints one line per
policy, last: ``eval_noise sd_sampled_final=… sd_sampled_base=… keys=K``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxreplay import config as config_lib  # noqa: E402
from jaxreplay import sweep as sweep_lib  # noqa: E402
from jaxreplay.train import loop  # noqa: E402


def evaluate_keys(cfg, keys: int, base_key: int = 10_000) -> tuple[int, list[dict]]:
  """The policy a workdir restores to (its latest checkpoint, or the base policy when the
  workdir holds none), evaluated once per key.

  Args:
    cfg: a trainer config (ConfigDict) whose ``workdir`` may be written.
    keys: evaluations (>= 2). base_key: the keys are ``fold_in(PRNGKey(base_key), k)``.

  Returns:
    (the checkpoint's step, one ``Run.evaluate`` dict per key).
  """
  job, carry = loop.restore(config_lib.validate(cfg), log=lambda *_: None)
  root = jax.random.PRNGKey(base_key)
  return carry.step, [job.evaluate(carry.state.params, key=jax.random.fold_in(root, k))
                      for k in range(keys)]


def summarize(evals: list[dict]) -> dict:
  """Mean and SD (ddof 1) over keys of the sampled and greedy accuracy (accuracy units)."""
  out = {}
  for k in ("acc_sampled", "acc_greedy"):
    v = np.array([float(e[k]) for e in evals])
    out[k] = v.tolist()
    out[f"mean_{k}"] = float(v.mean())
    out[f"sd_{k}"] = float(v.std(ddof=1))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", required=True, help="the sweep file")
  p.add_argument("--workdir", help="the sweep's directory (default: the file's workdir)")
  p.add_argument("--run", required=True, help="configuration name")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--keys", type=int, default=8)
  p.add_argument("--out", help="write the measurement as JSON here")
  a = p.parse_args(argv)
  if a.keys < 2:
    p.error(f"--keys {a.keys}: an SD needs at least 2 evaluations")
  sweep = sweep_lib.load_sweep(a.config)
  workdir = a.workdir or sweep["workdir"]
  runs = [r for r in sweep_lib.plan(sweep, workdir) if r.name == a.run and r.seed == a.seed]
  if not runs:
    names = sorted({c["name"] for c in sweep["configurations"]})
    p.error(f"--run {a.run} --seed {a.seed}: not in the sweep (configurations: {names})")
  run = runs[0]
  if not sweep_lib.finished(run, sweep_lib.resolved_config(sweep, run, workdir).train.steps):
    p.error(f"{run.workdir}: not a finished run (run the sweep or --import-runs first)")
  t0 = time.time()
  result = {"run": a.run, "seed": a.seed, "keys": a.keys}
  with tempfile.TemporaryDirectory() as tmp:
    for label, src in (("base", None), ("final", run.workdir)):
      wd = os.path.join(tmp, label)
      if src is None:
        os.makedirs(wd)
      else:
        shutil.copytree(src, wd, ignore=shutil.ignore_patterns("sweep.log"))
      cfg = sweep_lib.resolved_config(sweep, run, workdir)
      cfg.unlock()
      cfg.workdir = wd
      cfg.lock()
      step, evals = evaluate_keys(cfg, a.keys)
      s = summarize(evals)
      result[label] = {"step": step, **s}
      print(f"{label} policy (step {step}): sampled accuracy {s['mean_acc_sampled']:.4f} "
            f"± {s['sd_acc_sampled']:.4f} (SD over {a.keys} keys), greedy "
            f"{s['mean_acc_greedy']:.4f} ± {s['sd_acc_greedy']:.4f}", flush=True)
      examples = cfg.eval.num_examples
      spe = cfg.eval.samples_per_example
  result.update(examples=examples, samples_per_example=spe,
                provenance={"command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                            "date": time.strftime("%Y-%m-%d"), "machine": platform.processor()
                            or platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
                            "seconds": round(time.time() - t0, 1)})
  if a.out:
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
  print(f"eval_noise sd_sampled_final={result['final']['sd_acc_sampled']:.4f} "
        f"sd_sampled_base={result['base']['sd_acc_sampled']:.4f} keys={a.keys}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
