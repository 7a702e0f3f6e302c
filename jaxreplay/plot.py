"""Plots of one or more runs: ``python -m jaxreplay.plot RUN_DIR [RUN_DIR ...] [--out DIR]``.

Writes PNG files (one curve per run): held-out accuracy against generated tokens (the
paper's compute axis), against learner steps and against measured time (generation +
training + evaluation seconds) and, when logged, against estimated generation FLOPs;
training-batch entropy against steps (with the held-out fresh-sample entropy), and the
staleness histogram of the sampled batches summed over the run.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.train.metrics import read_metrics  # noqa: E402


def _series(recs, x_key, y_key):
  pts = [(r[x_key], r[y_key]) for r in recs if x_key in r and y_key in r]
  return np.array(pts, dtype=float).reshape(-1, 2)


def _elapsed(recs):
  """Adds ``time_s`` (generate + train + eval seconds) to each record that has them."""
  for r in recs:
    if "generate_s" in r:
      r["time_s"] = r["generate_s"] + r["train_s"] + r.get("eval_s", 0.0)
  return recs


def _save(fig, out_dir: str, name: str, paths: list[str]) -> None:
  fig.tight_layout()
  paths.append(os.path.join(out_dir, name))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)


def run_labels(run_dirs: list[str]) -> list[str]:
  """Shortest distinct trailing path of each run directory (``default``, or
  ``a/default`` and ``b/default`` when two runs share a folder name)."""
  parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
  for n in range(1, max(len(p) for p in parts) + 1):
    labels = ["/".join(p[-n:]) for p in parts]
    if len(set(labels)) == len(labels):
      return labels
  return [os.path.normpath(d) for d in run_dirs]


def plot_runs(run_dirs: list[str], out_dir: str) -> list[str]:
  """Draws the comparison figures for ``run_dirs`` into ``out_dir``.

  Args:
    run_dirs: run directories holding ``metrics.jsonl``.
    out_dir: where the PNG files go (created).

  Returns:
    The paths of the PNG files written.

  Raises:
    FileNotFoundError: a run directory without ``metrics.jsonl``.
  """
  os.makedirs(out_dir, exist_ok=True)
  runs = {name: _elapsed(read_metrics(d)) for name, d in zip(run_labels(run_dirs), run_dirs)}
  for recs in runs.values():  # the step-0 evaluation sits at zero cost
    if recs and "eval/acc_sampled" in recs[0]:
      recs[0].setdefault("generated_tokens", 0)
      recs[0].setdefault("time_s", 0.0)
  paths = []
  axes = [("generated_tokens", "generated tokens", "acc_vs_tokens.png"),
          ("step", "learner step", "acc_vs_steps.png"),
          ("time_s", "measured time (s)", "acc_vs_time.png")]
  if any("generation_flops" in r for recs in runs.values() for r in recs):
    for recs in runs.values():
      if recs and "eval/acc_sampled" in recs[0]:
        recs[0].setdefault("generation_flops", 0.0)
    axes.append(("generation_flops", "estimated generation FLOPs", "acc_vs_gen_flops.png"))
  for x_key, label, fname in axes:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in runs.items():
      for y_key, style in (("eval/acc_sampled", "-o"), ("eval/acc_greedy", "--s")):
        pts = _series(recs, x_key, y_key)
        if len(pts):
          ax.plot(pts[:, 0], pts[:, 1], style, ms=3, label=f"{name} ({y_key.split('_')[-1]})")
    ax.set_xlabel(label)
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out_dir, fname, paths)
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, recs in runs.items():
    pts = _series(recs, "step", "entropy")
    if len(pts):
      ax.plot(pts[:, 0], pts[:, 1], label=name)
    fresh = _series(recs, "step", "eval/entropy_fresh")
    if len(fresh):
      ax.plot(fresh[:, 0], fresh[:, 1], "--o", ms=3, label=f"{name} (fresh samples, held-out)")
  ax.set_xlabel("learner step")
  ax.set_ylabel("entropy (nats/token)")
  ax.legend(fontsize=7)
  _save(fig, out_dir, "entropy.png", paths)
  fig, ax = plt.subplots(figsize=(6, 4))
  width = 0.8 / max(len(runs), 1)
  for i, (name, recs) in enumerate(runs.items()):
    hists = [r["staleness_hist"] for r in recs if "staleness_hist" in r]
    if hists:
      h = np.sum(hists, axis=0)
      ax.bar(np.arange(len(h)) + i * width, h / h.sum(), width=width, label=name)
  ax.set_xlabel("staleness (policy versions; last bin = tail)")
  ax.set_ylabel("fraction of trained samples")
  ax.legend(fontsize=7)
  _save(fig, out_dir, "staleness.png", paths)
  return paths


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("run_dirs", nargs="+")
  p.add_argument("--out", default=None, help="output folder (default: FIRST_RUN/plots)")
  a = p.parse_args(argv)
  for path in plot_runs(a.run_dirs, a.out or os.path.join(a.run_dirs[0], "plots")):
    print(path)


if __name__ == "__main__":
  main()
