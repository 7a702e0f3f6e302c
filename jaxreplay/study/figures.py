"""The report's figures (matplotlib, Agg): accuracy curves per configuration, the median over
seeds as a line and the interquartile range as a band."""

from __future__ import annotations

from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.study.runs import Analysis, RunData  # noqa: E402
from jaxreplay.study.stats import quantiles  # noqa: E402


def aggregate(runs: list[RunData], x, y: str) -> np.ndarray:
  """[n, 4] (median x, q25 y, median y, q75 y) over seeds at the evaluation steps every
  seed has (x: a record key or a function of (run, record))."""
  steps = None
  for r in runs:
    s = {e["step"] for e in r.evals if y in e}
    steps = s if steps is None else steps & s
  out = []
  for st in sorted(steps or ()):
    xs, ys = [], []
    for r in runs:
      rec = next(e for e in r.evals if e["step"] == st)
      xs.append(rec.get(x, float("nan")) if isinstance(x, str) else x(r, rec))
      ys.append(rec[y])
    q = quantiles(ys)
    out.append((quantiles(xs)[1], q[0], q[1], q[2]))
  return np.array(out, float).reshape(-1, 4)


def styles(configs: list[dict]) -> dict[str, tuple]:
  fams = list(dict.fromkeys(c.get("family", c["name"]) for c in configs))
  cmap = plt.get_cmap("tab10")
  dashes = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
  seen: dict[str, int] = {}
  out = {}
  for c in configs:
    f = c.get("family", c["name"])
    i = seen.get(f, 0)
    seen[f] = i + 1
    out[c["name"]] = (cmap(fams.index(f) % 10), dashes[i % len(dashes)])
  return out


def plot_band(ax, runs: list[RunData], x, y: str, style: tuple, label: str,
              lw: float = 1.5) -> int:
  """Draws the median over seeds of ``y`` against ``x`` (``aggregate``) as a line and its
  interquartile range as a band on ``ax``; returns 1 if anything was drawn, else 0."""
  a = aggregate(runs, x, y)
  if not len(a):
    return 0
  color, ls = style
  ax.plot(a[:, 0], a[:, 2], color=color, linestyle=ls, marker=".", lw=lw, label=label)
  ax.fill_between(a[:, 0], a[:, 1], a[:, 3], color=color, alpha=0.12, lw=0)
  return 1


def plot_panels(an: Analysis, configs: list[dict], panels: list[tuple], path: str,
                target: float | None = None) -> int:
  """One figure with a panel per (title, x, y, xlabel): median line and IQR band per
  configuration. Returns the number of non-empty series drawn."""
  style = styles(configs)
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
  drawn = 0
  for ax, (title, x, y, xlabel) in zip(axes[0], panels):
    for c in configs:
      rs = an.runs.get(c["name"], [])
      if not rs:
        continue
      drawn += plot_band(ax, rs, x, y, style[c["name"]], f"{c['name']} ({len(rs)})")
    if target is not None and "sampled" in y:
      ax.axhline(target, color="k", lw=0.8, ls=":", label="target (on-policy final)")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(y.replace("eval/", "held-out "))
    ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
             title="configuration (seeds)", title_fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return drawn


def plot_regimes(panels: Sequence[tuple[str, list[dict], dict, float | None]], path: str) -> None:
  """One panel per regime: held-out sampled accuracy against generated tokens, median and
  IQR band over seeds per configuration; the dotted line is on-policy's final accuracy.

  Args:
    panels: (regime name, its configuration dicts, {configuration: [RunData]}, on-policy's
      final accuracy or None) per panel. path: the PNG's path.
  """
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, (name, configs, runs, target) in zip(axes[0], panels):
    style = styles(configs)
    for c in configs:
      rs = runs.get(c["name"]) or []
      if not rs:
        continue
      plot_band(ax, rs, "generated_tokens", "eval/acc_sampled", style[c["name"]],
                f"{c['name'].removeprefix(name + '_')} ({len(rs)})", lw=1.4)
    if target is not None:
      ax.axhline(target, color="k", lw=0.8, ls=":")
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out sampled accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
