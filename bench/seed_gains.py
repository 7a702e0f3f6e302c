"""Held-out gains of a preset over seeds, and two configurations compared seed by seed.

Reads finished runs (``WORKDIR/summary.json``, ``WORKDIR/metrics/*.jsonl`` and, when present,
``WORKDIR/time.txt``: ``/usr/bin/time -f "%e s wall %M KB maxrss"``), one or more per arm:

  python bench/seed_gains.py --arm full='runs/sums_seed*' --arm lora8='runs/sums_lora_seed*' \
      --out bench/results/smollm2_sums_seeds.json

``--previous FILE`` keeps the runs an earlier ``--out`` recorded (more seeds added to the
same arms later, the first ones' workdirs gone).

For each arm and each grade (greedy / sampled x math reward, strict, lenient): the accuracy
before and after RL per seed and the gain after - before, its mean over seeds and 95% Student
t interval (``study.stats.paired``: each seed is its own control). With a second arm: the
arms' accuracies after RL compared seed by seed (the same seeds, the same held-out
questions), second arm minus first. Also per run: wall seconds, peak resident memory, the
learner's median seconds per update that moved the weights (steps 4 on: the first ones
compile) and per rollout it trained on.

Prints one markdown table per arm and the comparison, then a JSON summary (``--out``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import numpy as np

from jaxreplay.study import stats

GRADES = ("greedy", "sampled", "greedy_strict", "sampled_strict", "greedy_lenient",
          "sampled_lenient")


def read_run(workdir: str) -> dict:
  """One finished run: its seed, accuracies before/after per grade, time and memory.

  Returns:
    dict: ``seed``; ``before`` / ``after`` {grade: fraction}; ``wall_s`` (summary);
    ``time_wall_s`` and ``maxrss_gb`` from ``time.txt`` (None without it);
    ``learner_update_s`` (median seconds of the learner steps that moved the weights, from
    step 4) and ``learner_s_per_rollout`` (the same steps' seconds over the rollouts they
    trained on, after ``algo.drop_zero_advantage``); ``moved_steps``, the learner steps
    that changed the weights.

  Raises:
    FileNotFoundError: no ``summary.json`` (an unfinished run).
  """
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  rows = []
  for path in sorted(glob.glob(os.path.join(workdir, "metrics", "*.jsonl"))):
    with open(path) as f:
      rows += [json.loads(line) for line in f if line.strip()]
  steps = sorted((r for r in rows if r.get("step", 0) >= 1 and "train_s" in r),
                 key=lambda r: r["step"])
  update_s, per_rollout = [], []
  prev = 0.0
  for r in steps:
    dt, prev = r["train_s"] - prev, r["train_s"]  # train_s is cumulative
    moved = not r.get("zero_gradient_skipped", 0.0) and not r.get("skipped_update", 0.0)
    if r["step"] >= 4 and moved:
      update_s.append(dt)
      kept = config["train"]["batch_size"] * (1.0 - r.get("dropped_zero_advantage", 0.0))
      per_rollout.append(dt / max(kept, 1.0))
  out = {"workdir": workdir, "seed": config["seed"],
         "before": {g: summary[f"acc_{g}_before"] for g in GRADES},
         "after": {g: summary[f"acc_{g}_after"] for g in GRADES},
         "wall_s": round(summary["wall_seconds"], 1),
         "learner_update_s": round(float(np.median(update_s)), 2) if update_s else None,
         "learner_s_per_rollout": round(float(np.median(per_rollout)), 3) if per_rollout
         else None,
         "moved_steps": sum(1 for r in steps if not r.get("zero_gradient_skipped", 0.0)
                            and not r.get("skipped_update", 0.0)),
         "time_wall_s": None, "maxrss_gb": None}
  out["recorded_form"] = recorded_form(workdir)
  time_txt = os.path.join(workdir, "time.txt")
  if os.path.exists(time_txt):
    m = re.search(r"([\d.]+) s wall (\d+) KB maxrss", open(time_txt).read())
    if m:
      out["time_wall_s"], out["maxrss_gb"] = float(m[1]), round(int(m[2]) / 2**20, 2)
  return out


# a one-line answer to a two-term sum: "75 - 32 = 43", "Solve: 89 + 87 = 176."
ONE_LINE = re.compile(r"^\s*(Solve:?\s*)?-?\d+\s*[-+]\s*-?\d+\s*=\s*-?\d+\.?\s*$")


def recorded_form(workdir: str) -> dict | None:
  """Of the completions the first and the last evaluation recorded
  (``samples/eval_STEP.jsonl``): how many, how many are one-line answers (``ONE_LINE``), and
  how many of those and of the rest are right by the lenient grade. None without records.

  Returns:
    {"first" | "last": {"step", "n", "one_line", "one_line_right", "other_right"}} or None.
  """
  files = sorted(glob.glob(os.path.join(workdir, "samples", "eval_*.jsonl")),
                 key=lambda f: int(re.search(r"eval_(\d+)", f)[1]))
  if not files:
    return None
  out = {}
  for label, path in (("first", files[0]), ("last", files[-1])):
    with open(path) as f:
      recs = [json.loads(line) for line in f if line.strip()]
    one = [bool(ONE_LINE.match(r["completion"])) for r in recs]
    right = [bool(r.get("lenient", 0)) for r in recs]
    out[label] = {"step": int(re.search(r"eval_(\d+)", path)[1]), "n": len(recs),
                  "one_line": sum(one), "one_line_right": sum(o and g for o, g in zip(one, right)),
                  "other_right": sum(g and not o for o, g in zip(one, right))}
  return out


def arm_summary(runs: list[dict]) -> dict:
  """Per grade: before/after per seed and the gain's mean with its 95% t interval."""
  out = {}
  for g in GRADES:
    before = [r["before"][g] for r in runs]
    after = [r["after"][g] for r in runs]
    c = stats.paired(after, before)
    out[g] = {"before_s": before, "after_s": after, "before_mean": float(np.mean(before)),
              "after_mean": float(np.mean(after)), "gain_mean": c.mean,
              "gain_t95": list(c.t), "gain_s": list(c.diff_s)}
  return out


def compare(a: list[dict], b: list[dict]) -> dict:
  """Arm ``b`` minus arm ``a`` after RL, seed by seed (the seeds both ran)."""
  by_seed = {r["seed"]: r for r in a}
  pairs = [(by_seed[r["seed"]], r) for r in b if r["seed"] in by_seed]
  out = {"seeds": [p[0]["seed"] for p in pairs]}
  for g in GRADES:
    c = stats.paired([q["after"][g] for _, q in pairs], [p["after"][g] for p, _ in pairs])
    out[g] = {"diff_mean": c.mean, "diff_t95": list(c.t), "diff_s": list(c.diff_s),
              "p_improve": c.p_improve}
  return out


def table(heads: list[str], rows: dict, cells, extra: str = "") -> None:
  """Prints a markdown table, one row per grade: ``cells(rows[grade])`` gives the leading
  columns (strings), the 95% interval, the per-seed values and, with ``extra``, one more."""
  cols = ["grade", *heads, "95% t interval", "per seed"] + ([extra] if extra else [])
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for g in GRADES:
    *lead, t95, per_seed = cells(rows[g])[:len(heads) + 2]
    tail = cells(rows[g])[len(heads) + 2:]
    print("| " + " | ".join([g, *lead, f"[{fmt(t95[0])}, {fmt(t95[1])}]",
                             ", ".join(fmt(v) for v in per_seed), *tail]) + " |")


def fmt(x: float) -> str:
  return "nan" if x is None or not np.isfinite(x) else f"{x:+.3f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--arm", action="append", required=True,
                  help="NAME=GLOB of run directories (repeat for a second arm)")
  ap.add_argument("--out", default="")
  ap.add_argument("--previous", default="",
                  help="an earlier --out JSON: its runs of each arm are kept beside the runs "
                       "matched now (whose workdirs may be gone); a seed matched now wins")
  args = ap.parse_args(argv)
  previous = {}
  if args.previous:
    with open(args.previous) as f:
      previous = json.load(f)["runs"]
  arms = {}
  for spec in args.arm:
    name, _, pattern = spec.partition("=")
    dirs = sorted(d for d in glob.glob(pattern) if os.path.exists(os.path.join(d,
                                                                                "summary.json")))
    runs = {r["seed"]: r for r in previous.get(name, [])}
    runs.update((r["seed"], r) for r in map(read_run, dirs))
    if not runs:
      raise SystemExit(f"--arm {spec}: no finished run (a summary.json) matches {pattern!r}"
                       + (f" and {args.previous} has no arm {name!r}" if previous else ""))
    arms[name] = sorted(runs.values(), key=lambda r: r["seed"])
  result = {"arms": {}, "runs": {n: rs for n, rs in arms.items()}}
  for name, runs in arms.items():
    s = arm_summary(runs)
    result["arms"][name] = s
    print(f"\n{name}: {len(runs)} seeds {[r['seed'] for r in runs]}")
    table(["before (mean)", "after (mean)", "gain"], s, lambda x: (
        f"{x['before_mean']:.3f}", f"{x['after_mean']:.3f}", fmt(x["gain_mean"]),
        x["gain_t95"], x["gain_s"]))
    for r in runs:
      print(f"  seed {r['seed']}: wall {r['wall_s']} s (time: {r['time_wall_s']}), max RSS "
            f"{r['maxrss_gb']} GB, learner {r['learner_update_s']} s per update, "
            f"{r['learner_s_per_rollout']} s per trained rollout; recorded form "
            f"{r['recorded_form']}")
  names = list(arms)
  if len(names) == 2:
    c = compare(arms[names[0]], arms[names[1]])
    result["comparison"] = {"a": names[0], "b": names[1], **c}
    print(f"\n{names[1]} - {names[0]} after RL, seeds {c['seeds']}")
    table(["difference"], c, lambda x: (fmt(x["diff_mean"]), x["diff_t95"], x["diff_s"],
                                       f"{x['p_improve']:.2f}"), extra="P(improvement)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(json.dumps({n: {g: round(s[g]["gain_mean"], 4) for g in GRADES}
                    for n, s in result["arms"].items()}))


if __name__ == "__main__":
  main()
