"""Plots of one or more runs: ``python -m jaxreplay.plot RUN_DIR [RUN_DIR ...] [--out DIR]``.

Writes PNG files (one curve per run): held-out accuracy against generated tokens (the
paper's compute axis), against learner steps and against measured time (generation +
training + evaluation seconds) and, when logged, against estimated generation FLOPs;
training-batch entropy against steps (with the held-out fresh-sample entropy), the
staleness histogram of the sampled batches summed over the run, how often the trained
samples had been used, and, for finished runs (``summary.json``), the compute ledger: μ and
γ, and where the generated tokens went.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.train.metrics import read_metrics  # noqa: E402


def series(recs: list[dict], x_key: str, y_key: str) -> np.ndarray:
  """The points (x, y) of the records that hold both keys, in record order.

  Args:
    recs: metric records (``train.metrics.read_metrics``). x_key, y_key: record keys.

  Returns:
    [n, 2] float64 array, n >= 0.
  """
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


def plot_runs(run_dirs: list[str], out_dir: str, strict: bool = False) -> list[str]:
  """Draws the comparison figures for ``run_dirs`` into ``out_dir``.

  Figures: ``acc_vs_tokens``, ``acc_vs_steps``, ``acc_vs_time`` (and ``acc_vs_gen_flops``
  when logged), ``entropy``, ``staleness``, ``replay`` (mean uses of the trained samples,
  counting that use, and the fraction drawn for the first time, per learner step) and,
  when a run has its ``summary.json``, ``ledger`` (μ and γ from FLOPs and from measured
  time; generated tokens split into trained on at least once, overwritten in the buffer
  unused and still unused at the end, next to trained tokens counted with reuse).

  Args:
    run_dirs: run directories holding metrics (``metrics/``, or an old run's ``metrics.jsonl``).
    out_dir: where the PNG files go (created).
    strict: after writing the figures, raise if some run contributed no point to one of
      them (a run without evaluations, metrics lacking a plotted key, no
      ``summary.json``): for notebooks and tests, where an empty curve must fail.

  Returns:
    The paths of the PNG files written.

  Raises:
    FileNotFoundError: a run directory without metrics.
    ValueError: with ``strict``, a run with an empty series; the message lists each run
      and figure.
  """
  os.makedirs(out_dir, exist_ok=True)
  names = run_labels(run_dirs)
  runs = {name: _elapsed(read_metrics(d)) for name, d in zip(names, run_dirs)}
  for recs in runs.values():  # the step-0 evaluation sits at zero cost
    if recs and "eval/acc_sampled" in recs[0]:
      recs[0].setdefault("generated_tokens", 0)
      recs[0].setdefault("time_s", 0.0)
  paths, empty = [], []
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
        pts = series(recs, x_key, y_key)
        if len(pts):
          ax.plot(pts[:, 0], pts[:, 1], style, ms=3, label=f"{name} ({y_key.split('_')[-1]})")
        else:
          empty.append(f"{name}: {fname} ({y_key})")
    ax.set_xlabel(label)
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out_dir, fname, paths)
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, recs in runs.items():
    pts = series(recs, "step", "entropy")
    if len(pts):
      ax.plot(pts[:, 0], pts[:, 1], label=name)
    else:
      empty.append(f"{name}: entropy.png (entropy)")
    fresh = series(recs, "step", "eval/entropy_fresh")
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
    if hists and np.sum(hists) > 0:
      h = np.sum(hists, axis=0)
      ax.bar(np.arange(len(h)) + i * width, h / h.sum(), width=width, label=name)
    else:
      empty.append(f"{name}: staleness.png (staleness_hist)")
  ax.set_xlabel("staleness (policy versions; last bin = tail)")
  ax.set_ylabel("fraction of trained samples")
  ax.legend(fontsize=7)
  _save(fig, out_dir, "staleness.png", paths)
  fig, (ax_uses, ax_new) = plt.subplots(1, 2, figsize=(10, 4))
  for name, recs in runs.items():
    uses, new = series(recs, "step", "replay_count_mean"), series(recs, "step", "frac_never_used")
    if len(uses) and len(new):
      ax_uses.plot(uses[:, 0], uses[:, 1], label=name)
      ax_new.plot(new[:, 0], new[:, 1], label=name)
    else:
      empty.append(f"{name}: replay.png (replay_count_mean, frac_never_used)")
  ax_uses.set_ylabel("uses of a trained sample so far\n(this one included; batch mean)")
  ax_new.set_ylabel("fraction of the batch drawn for the first time")
  for ax in (ax_uses, ax_new):
    ax.set_xlabel("learner step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  _save(fig, out_dir, "replay.png", paths)
  ledgers = {}
  for name, d in zip(names, run_dirs):
    path = os.path.join(d, "summary.json")
    if os.path.exists(path):
      with open(path) as f:
        ledgers[name] = json.load(f)["ledger"]
    else:
      empty.append(f"{name}: ledger.png (no summary.json: the run has not finished)")
  if ledgers:
    _plot_ledger(ledgers, out_dir, paths)
  if strict and empty:
    raise ValueError("empty plotted series: " + "; ".join(empty))
  return paths


def _plot_ledger(ledgers: dict[str, dict], out_dir: str, paths: list[str]) -> None:
  """``ledger.png``: μ and γ per run (FLOPs, measured time), and the token ledger."""
  fig, (ax_cost, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.6))
  keys = [("mu_flops", "μ (FLOPs)"), ("mu_time", "μ (time)"),
          ("gamma_flops", "γ (FLOPs)"), ("gamma_time", "γ (time)")]
  width = 0.8 / len(ledgers)
  for i, (name, led) in enumerate(ledgers.items()):
    vals = [float(led.get(k, float("nan"))) for k, _ in keys]
    bars = ax_cost.bar(np.arange(len(keys)) + i * width, vals, width=width, label=name)
    ax_cost.bar_label(bars, fmt="%.2f", fontsize=7)
  ax_cost.axhline(1.0, color="k", lw=0.8, ls=":")
  ax_cost.set_xticks(np.arange(len(keys)) + width * (len(ledgers) - 1) / 2)
  ax_cost.set_xticklabels([label for _, label in keys])
  ax_cost.set_ylabel("ratio")
  ax_cost.set_title("μ: generate one rollout ÷ train on one\n"
                    "γ: cost per update ÷ on-policy's", fontsize=9)
  ax_cost.legend(fontsize=7)
  parts = [("first_use_tokens", "trained on at least once"),
           ("evicted_unused_tokens", "overwritten before any use"),
           ("unused_in_buffer_tokens", "still unused at the end")]
  y = np.arange(len(ledgers))
  for j, (k, label) in enumerate(parts):
    left = np.array([sum(led.get(p, 0) for p, _ in parts[:j]) for led in ledgers.values()])
    ax_tok.barh(y - 0.2, [led.get(k, 0) for led in ledgers.values()], height=0.35, left=left,
                label=f"generated: {label}", color=f"C{j}")
  ax_tok.barh(y + 0.2, [led.get("trained_tokens", 0) for led in ledgers.values()], height=0.35,
              label="trained, counted with reuse", color="C3")
  ax_tok.set_yticks(y)
  ax_tok.set_yticklabels(list(ledgers))
  ax_tok.set_xlabel("completion tokens")
  ax_tok.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
  _save(fig, out_dir, "ledger.png", paths)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("run_dirs", nargs="+")
  p.add_argument("--out", default=None, help="output folder (default: FIRST_RUN/plots)")
  a = p.parse_args(argv)
  for path in plot_runs(a.run_dirs, a.out or os.path.join(a.run_dirs[0], "plots")):
    print(path)


if __name__ == "__main__":
  main()
