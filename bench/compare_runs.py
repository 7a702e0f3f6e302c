"""Are two runs' metrics identical? ``python bench/compare_runs.py RUN_A RUN_B [--ignore KEY ...]``

Reads both runs' metric records (the last record per step, ``train.metrics.read_metrics``)
and compares every key of every step exactly, except wall-clock timers and the keys given
with ``--ignore``. Prints the number of records and keys compared and each difference;
exits 1 if any. Used to show that a refactor leaves a run's trajectory bit-identical, e.g.
the default's first 10 steps at two commits (same ``--config.*`` overrides, same seed).
"""

from __future__ import annotations

import argparse
import sys

from jaxreplay.train.metrics import read_metrics

TIMERS = ("generate_s", "train_s", "eval_s", "learner_wait_s", "generator_wait_s")


def differences(a: list[dict], b: list[dict], ignore: set[str]) -> list[str]:
  """Lines describing every step / key where records ``a`` and ``b`` differ (exact ``!=``)."""
  out = []
  if [r["step"] for r in a] != [r["step"] for r in b]:
    return [f"steps differ: {[r['step'] for r in a]} vs {[r['step'] for r in b]}"]
  for ra, rb in zip(a, b):
    ka, kb = set(ra) - ignore, set(rb) - ignore
    if ka != kb:
      out.append(f"step {ra['step']}: keys only in one run: {sorted(ka ^ kb)}")
    out += [f"step {ra['step']} {k}: {ra[k]!r} vs {rb[k]!r}" for k in sorted(ka & kb)
            if ra[k] != rb[k]]
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("run_a")
  p.add_argument("run_b")
  p.add_argument("--ignore", nargs="*", default=[], help="keys not compared (besides timers)")
  args = p.parse_args(argv)
  a, b = read_metrics(args.run_a), read_metrics(args.run_b)
  ignore = set(TIMERS) | set(args.ignore)
  diff = differences(a, b, ignore)
  n_keys = len(set(a[-1]) - ignore) if a else 0
  print(f"records {len(a)}, keys compared in the last record {n_keys}, differences {len(diff)}")
  for line in diff:
    print(line)
  return 1 if diff else 0


if __name__ == "__main__":
  sys.exit(main())
