"""Where replay pays: the regime map of a sweep (NOTES.md §4, Thm 4.5, App. 9.3.2).

A regime-map sweep file (``report.kind = "regime_map"``, such as
``configs/sweep/where_replay_pays.py``) tags every configuration with its ``regime`` and a
``role``: ``onpolicy`` (N = R = B, the regime's reference), ``fixed`` (a FIFO buffer at a
fixed x = N/R, y = B/R) or ``auto`` (the self-tuning buffer, ``auto_replay``, whose runs
log the noise estimates ``noise/alpha`` and ``noise/rho``). All runs of a regime spend the
same generation budget. Per regime this module computes, from the runs' files alone:

  * the constants of the theory, per seed from the regime's ``auto`` runs: μ (generating one
    rollout over training on one sample, steady-state phase times, ``RunData.mu_time``), α
    (σ(s) ∝ s^α) and ρ (the correlation of reused samples) as the median over the run's
    estimates (``rl.noise``; NaN estimates — groups of equal rewards — left out); reported
    as median [IQR] over seeds;
  * the theory's (x*, y*): ``theory.power_law_design_bounded`` at the regime's median
    constants within the sweep's bounds (``report.x_bounds``, ``report.y_bounds``), ρ
    clipped to [0, 1] and α to >= 0 (an estimate may fall outside: noise);
  * generated tokens to reach on-policy's final accuracy, % of on-policy's
    (``report.Analysis`` with the regime's on-policy configuration as reference: the same
    definitions as the single-regime report, its module docstring);
  * the sweep's best configuration: the least median tokens-to-target among on-policy and
    the fixed buffers (on-policy wins ties); "replay pays" when a buffer, fixed or
    self-tuning, needs fewer tokens than on-policy (medians over seeds);
  * whether the theory matched: it predicts replay when y* rounds (nearest power of two)
    above 1;
  * the self-tuning acceptance: the ``auto`` runs' median tokens-to-target at most
    ``AUTO_TOLERANCE`` × the best fixed configuration's, and reached wherever on-policy is.

``write_map`` renders the "Where replay pays" section (between ``MAP_START`` and
``MAP_END``) and splices it into the results page, leaving the rest of the page as it is;
``report.write_report`` keeps the section when it rewrites the page.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from jaxreplay import theory

MAP_START = "<!-- where-replay-pays:start"
MAP_END = "<!-- where-replay-pays:end -->"
MAP_NOTE = ("<!-- where-replay-pays:start (written by `python -m jaxreplay.sweep --config "
            "configs/sweep/where_replay_pays.py --report-only`; do not edit by hand) -->")
AUTO_TOLERANCE = 1.10  # self-tuning may use up to 110% of the best fixed configuration's tokens
ROLES = ("onpolicy", "fixed", "auto")


def run_constants(run) -> dict[str, float]:
  """μ, α, ρ of one run and how many noise estimates it logged.

  Args:
    run: a ``report.RunData``.

  Returns:
    {"mu": μ from steady-state phase times (unitless, cost per generated rollout over cost
     per trained sample), "alpha": median ``noise/alpha``, "rho": median ``noise/rho``,
     "estimates": int count of records with a ``noise/alpha``} — NaN where absent.
  """
  def med(key):  # the metric files keep NaN as a string
    v = [float(r[key]) for r in run.records if key in r]
    v = [x for x in v if math.isfinite(x)]
    return float(np.median(v)) if v else float("nan")
  n = sum(1 for r in run.records if "noise/alpha" in r)
  return {"mu": run.mu_time(), "alpha": med("noise/alpha"), "rho": med("noise/rho"),
          "estimates": n}


def theory_design(mu: float, alpha: float, rho: float, x_bounds: Sequence[float],
                  y_bounds: Sequence[float]) -> tuple[float, float]:
  """(x*, y*) of the power-law bound at measured constants (paper App. 9.3.2, Thm 4.5).

  Args:
    mu: μ > 0. alpha: α (clipped to >= 0). rho: ρ (clipped to [0, 1]).
    x_bounds, y_bounds: (lo, hi) of the staleness horizon x = N/R (learner steps) and the
      replay ratio y = B/R.

  Returns:
    (x*, y*) floats, or two NaNs when a constant is NaN or μ <= 0.
  """
  if not (mu > 0 and alpha == alpha and rho == rho):
    return float("nan"), float("nan")
  return theory.power_law_design_bounded(mu, min(max(rho, 0.0), 1.0), max(alpha, 0.0),
                                         tuple(x_bounds), tuple(y_bounds))


def round_design(x: float, y: float) -> tuple[int, int]:
  """The grid point nearest (x*, y*): y to the nearest power of two (log scale), x to the
  nearest whole number of learner steps, at least y (the trainer needs N >= B).

  Returns:
    (x, y) ints; (1, 1) is on-policy. Raises ValueError on NaN input.
  """
  if not (x == x and y == y):
    raise ValueError(f"cannot round a NaN design (x={x}, y={y})")
  yr = 2 ** max(0, round(math.log2(max(y, 1.0))))
  return max(int(round(x)), yr, 1), yr


class Regime:
  """The runs and numbers of one regime.

  Attributes:
    name: the regime's name. configs: its configuration dicts, sweep order.
    analysis: ``report.Analysis`` against its on-policy configuration, or None without one.
    constants: [per-seed ``run_constants``] of its ``auto`` runs.
    design: the theory's (x*, y*) at the median constants (NaNs when unknown).
    seed_designs: [(x*, y*)] at each self-tuning run's own constants.
  """

  def __init__(self, name: str, configs: list[dict], runs: dict, x_bounds, y_bounds,
               target_last: int):
    from jaxreplay import report
    self.name, self.configs = name, configs
    self.by_role = {r: [c["name"] for c in configs if c.get("role") == r] for r in ROLES}
    ref = self.by_role["onpolicy"][0] if self.by_role["onpolicy"] else None
    present = {c["name"]: runs.get(c["name"], []) for c in configs}
    self.analysis = None
    if ref and present[ref]:
      self.analysis = report.Analysis(present, ref, float("nan"), target_last=target_last)
    self.reference = ref
    self.runs = present
    self.constants = [run_constants(r) for n in self.by_role["auto"] for r in present[n]]
    med = {k: report.quantiles([c[k] for c in self.constants])[1]
           for k in ("mu", "alpha", "rho")}
    self.median = med
    self.design = theory_design(med["mu"], med["alpha"], med["rho"], x_bounds, y_bounds)
    self.seed_designs = [theory_design(c["mu"], c["alpha"], c["rho"], x_bounds, y_bounds)
                         for c in self.constants]

  def pct(self, name: str) -> list[float]:
    """Per-seed generated tokens to on-policy's final accuracy, % of on-policy's."""
    return self.analysis.values(name, "tokens_to_target_pct") if self.analysis else []

  def median_pct(self, name: str) -> float:
    """Median over seeds of ``pct(name)`` (+inf unless more than half reached; NaN: none)."""
    from jaxreplay import report
    return report.quantiles(self.pct(name))[1]

  def best_fixed(self) -> str | None:
    """The least median tokens-to-target among on-policy and the fixed buffers (on-policy
    first, so it wins ties); None when none has a finite median."""
    cands = [n for n in self.by_role["onpolicy"] + self.by_role["fixed"] if self.runs[n]]
    vals = {n: self.median_pct(n) for n in cands}
    fin = {n: v for n, v in vals.items() if math.isfinite(v)}
    return min(fin, key=fin.get) if fin else None

  def xy(self, name: str) -> tuple[float, float]:
    """Nominal (x, y) of a configuration from its first run's config.json."""
    rs = self.runs.get(name) or []
    if not rs:
      return float("nan"), float("nan")
    v = rs[0].nominal()
    return v["x"], v["y"]

  def best_replay(self) -> str | None:
    """The buffer (fixed or self-tuning) with the least median tokens-to-target; None when
    none has a finite median."""
    cands = [n for n in self.by_role["fixed"] + self.by_role["auto"] if self.runs[n]]
    fin = {n: self.median_pct(n) for n in cands if math.isfinite(self.median_pct(n))}
    return min(fin, key=fin.get) if fin else None

  def replay_pays(self) -> bool | None:
    """Whether a buffer, fixed or self-tuning, reaches on-policy's final accuracy with fewer
    generated tokens than on-policy (medians over seeds); None without on-policy runs."""
    if self.reference is None or not self.runs[self.reference] or self.analysis is None:
      return None
    best = self.best_replay()
    return best is not None and self.median_pct(best) < self.median_pct(self.reference)

  def theory_says_replay(self) -> bool | None:
    x, y = self.design
    if not (x == x and y == y):
      return None
    return round_design(x, y)[1] > 1

  def auto_verdict(self) -> tuple[str, float]:
    """("yes" | "no" | "–", ratio of the self-tuning median tokens to the best fixed's)."""
    best, autos = self.best_fixed(), [n for n in self.by_role["auto"] if self.runs[n]]
    if best is None or not autos:
      return "–", float("nan")
    a, b = self.median_pct(autos[0]), self.median_pct(best)
    ratio = a / b if b > 0 and math.isfinite(b) else float("nan")
    if not math.isfinite(a):
      return "no (not reached)", ratio
    return ("yes" if ratio <= AUTO_TOLERANCE + 1e-9 else "no"), ratio

  def controller(self) -> dict[str, Any]:
    """The self-tuning runs' last knobs, number of changes, seconds spent estimating and
    seconds of generation + training + evaluation + estimation (per seed lists)."""
    out = {"R": [], "max_staleness": [], "changes": [], "y": [], "x": [], "estimate_s": [],
           "wall_s": []}
    for n in self.by_role["auto"]:
      for r in self.runs[n]:
        recs = [e for e in r.records if "auto/R" in e]
        if not recs:
          continue
        last = recs[-1]
        R = last["auto/R"]
        s = last.get("auto/max_staleness", -1)
        b = r.batch_size or float("nan")
        out["R"].append(R)
        out["max_staleness"].append(s)
        out["y"].append(b / R)
        out["x"].append(s + 1 if s >= 0 else r.cfg("buffer.capacity", 0) / R)
        out["changes"].append(sum(int(e.get("auto/changed", 0)) for e in r.records))
        out["estimate_s"].append(sum(e.get("auto/estimate_s", 0.0) for e in r.records))
        out["wall_s"].append(sum(last.get(k, 0.0) for k in ("generate_s", "train_s", "eval_s"))
                             + out["estimate_s"][-1])
    return out


def regimes_of(sweep: dict, runs: dict) -> list[Regime]:
  """The sweep's regimes in file order.

  Raises:
    ValueError: a configuration without ``regime`` or with a ``role`` outside ``ROLES``.
  """
  rep = sweep.get("report", {}) or {}
  order: dict[str, list[dict]] = {}
  for c in sweep["configurations"]:
    if "regime" not in c or c.get("role") not in ROLES:
      raise ValueError(f"configuration {c.get('name')!r}: a regime map needs 'regime' and "
                       f"'role' in {ROLES} (got {c.get('regime')!r}, {c.get('role')!r})")
    order.setdefault(c["regime"], []).append(c)
  xb = tuple(rep.get("x_bounds", (1.0, 64.0)))
  yb = tuple(rep.get("y_bounds", (1.0, 16.0)))
  return [Regime(k, v, runs, xb, yb, int(rep.get("target_last", 1))) for k, v in order.items()]


def _yes(v: bool | None, yes: str, no: str) -> str:
  return "–" if v is None else yes if v else no


def summary_sentences(regimes: list[Regime]) -> str:
  """The map in two sentences (the README's headline states them)."""
  from jaxreplay import report
  pays = [g for g in regimes if g.replay_pays()]
  done = [g for g in regimes if g.replay_pays() is not None]
  consts = "; ".join(f"{g.name}: μ = {report.fmt(g.median['mu'], 2)}, α = "
                     f"{report.fmt(g.median['alpha'], 2)}, ρ = {report.fmt(g.median['rho'], 2)}"
                     for g in done)
  if not done:
    return "No regime has its on-policy and fixed runs yet."
  if not pays:
    first = (f"In none of the {len(done)} regimes did a replay buffer, fixed or self-tuning, "
             "reach on-policy's final accuracy with fewer generated tokens than on-policy")
  else:
    parts = [f"{g.name} (`{g.best_replay()}`: {report.fmt(g.median_pct(g.best_replay()), 0)}% "
             "of on-policy's tokens)" for g in pays]
    rest = [g.name for g in done if g not in pays]
    first = (f"Replay saved generation in {len(pays)} of {len(done)} regimes, "
             + ", ".join(parts) + (f", and not in {', '.join(rest)}" if rest else ""))
  autos = [g.auto_verdict() for g in done]
  ok = sum(v == "yes" for v, _ in autos)
  second = (f"the measured constants ({consts}) put the theory's optimum "
            + ("at on-policy or near it" if not any(g.theory_says_replay() for g in done)
               else "at a buffer in " + ", ".join(g.name for g in done
                                                  if g.theory_says_replay()))
            + f", and the self-tuning buffer met its target (≤ {AUTO_TOLERANCE:.0%} of the "
            f"best fixed configuration's tokens) in {ok} of {len(done)}.")
  return f"{first}; {second}"


def _verdict_cell(g: Regime, verdict: str, ratio: float, best_xy) -> str:
  """The self-tuning verdict, its ratio to the best fixed configuration's tokens and, when it
  fails, where the controller settled (median over seeds) against the best fixed (x, y)."""
  from jaxreplay import report
  cell = f"{verdict} ({report.fmt(ratio, 2)}×)" if math.isfinite(ratio) else verdict
  k = g.controller()
  if verdict.startswith("no") and k["x"]:
    x, y = report.quantiles(k["x"])[1], report.quantiles(k["y"])[1]
    cell += (f": it settled at (x, y) = ({report.fmt(x, 0)}, {report.fmt(y, 2)}), the best "
             f"fixed is ({report.fmt(best_xy[0], 0)}, {report.fmt(best_xy[1], 0)})")
  return cell


def render_map(sweep: dict, regimes: list[Regime], figure: str | None) -> list[str]:
  """The "Where replay pays" section, markers included (markdown lines)."""
  from jaxreplay import report
  fq = report.fmt_q
  L = [MAP_NOTE, "", "## Where replay pays", "",
       f"Sweep `configs/sweep/where_replay_pays.py` ({len(regimes)} regimes × "
       f"{len(sweep['seeds'])} seeds; per regime on-policy, two fixed FIFO buffers and the "
       "self-tuning buffer at one generation budget). μ, α, ρ: median [IQR] over the "
       "self-tuning runs' seeds (μ from phase times at the R the controller ran; \"μ "
       "on-policy\": the same at R = B, from the on-policy runs; α, ρ the median of each "
       "run's buffer estimates, `rl.noise`; ρ is clipped to [0, 1] and α to ≥ 0 before the "
       "theory, as the controller does). Theory: `theory.power_law_design_bounded` at the "
       "median constants within the sweep's bounds, and its y* at each seed's own "
       "constants. Tokens: generated tokens to reach the regime's "
       "on-policy final accuracy (the mean of its last "
       f"{int((sweep.get('report') or {}).get('target_last', 1))} evaluation(s)), % of "
       "on-policy's, median [IQR] over seeds (k/n: seeds that reach it). Sweep's best: the "
       "least tokens among on-policy and the fixed buffers (on-policy wins ties). \"Replay "
       "pays\": a buffer, fixed or self-tuning, needs fewer tokens than on-policy. The theory "
       "predicts replay when its y* rounds above 1.", "",
       f"**{summary_sentences(regimes)}**", ""]
  rows = []
  for g in regimes:
    best = g.best_fixed()
    autos = [n for n in g.by_role["auto"] if g.runs[n]]
    x, y = g.design
    bx, by = g.xy(best) if best else (float("nan"), float("nan"))
    verdict, ratio = g.auto_verdict()
    mu = [c["mu"] for c in g.constants]
    mu_on = [r.mu_time() for n in g.by_role["onpolicy"] for r in g.runs[n]]
    al = [c["alpha"] for c in g.constants]
    rh = [c["rho"] for c in g.constants]

    def reach(n):
      v = g.pct(n)
      return f"{sum(math.isfinite(t) for t in v)}/{len(v)}"

    rows.append([
        g.name, fq(mu, 2), fq(mu_on, 2), fq(al, 2), fq(rh, 2),
        f"({report.fmt(x, 2)}, {report.fmt(y, 2)})",
        fq([d[1] for d in g.seed_designs], 2),
        f"`{best}` ({report.fmt(bx, 0)}, {report.fmt(by, 0)})" if best else "–",
        (f"{fq(g.pct(best), 0)} ({reach(best)})" if best else "–"),
        (f"{fq(g.pct(autos[0]), 0)} ({reach(autos[0])})" if autos else "–"),
        _yes(g.replay_pays(), "yes", "no"),
        _yes(None if g.replay_pays() is None or g.theory_says_replay() is None
             else g.replay_pays() == g.theory_says_replay(), "yes", "no"),
        _verdict_cell(g, verdict, ratio, (bx, by))])
  L += report._table(["regime", "μ", "μ on-policy", "α", "ρ", "theory's (x*, y*)",
                      "y* per seed", "sweep's best (x, y)",
                      "best fixed: tokens, % of on-policy", "self-tuning: tokens, % of on-policy",
                      "replay pays", "theory matched", "self-tuning ≤ 110% of best fixed"],
                     rows) + [""]
  why = (sweep.get("report") or {}).get("why")  # the sweep file's measured explanation
  if why and any(g.auto_verdict()[0].startswith("no") for g in regimes):
    L += [f"Where self-tuning misses its target: {why}", ""]

  # every configuration of every regime
  L += ["Every configuration (final sampled accuracy: mean of the last evaluations; "
        "plateau: on-policy's final minus the evaluations before, near 0 when it has "
        "stopped improving):", ""]
  rows = []
  for g in regimes:
    an = g.analysis
    for c in g.configs:
      n = c["name"]
      if not g.runs[n] or an is None:
        rows.append([g.name, f"`{n}`", c.get("role", ""), "–", "–", "–", "–", "–"])
        continue
      x, y = g.xy(n)
      xy = "auto" if c.get("role") == "auto" else f"({report.fmt(x, 0)}, {report.fmt(y, 0)})"
      v = g.pct(n)
      rows.append([g.name, f"`{n}`", c.get("role", ""), xy,
                   fq(an.values(n, "final_sampled")), fq(v, 0),
                   f"{sum(math.isfinite(t) for t in v)}/{len(v)}",
                   fq(an.values(n, "final_minus_previous"), 3) if n == g.reference else ""])
  L += report._table(["regime", "configuration", "role", "(x, y)", "final sampled",
                      "tokens to on-policy's final, %", "reached", "plateau check"],
                     rows) + [""]

  # the controller
  L += ["The self-tuning runs' last setting (median [IQR] over seeds) and how often the "
        "controller changed it:", ""]
  rows = []
  for g in regimes:
    k = g.controller()
    if not k["R"]:
      continue
    share = [e / w if w else float("nan") for e, w in zip(k["estimate_s"], k["wall_s"])]
    rows.append([g.name, fq(k["R"], 0), fq(k["y"], 2), fq(k["x"], 1), fq(k["changes"], 0),
                 fq(k["estimate_s"], 0), fq(share, 2)])
  L += report._table(["regime", "R (rollouts per step)", "y = B/R", "x (steps kept)",
                      "changes", "estimating (s)", "estimating, share of the run's phases"],
                     rows) + [""]
  if figure:
    L += [f"![Held-out sampled accuracy against generated tokens, per regime]({figure})", ""]
  L += [MAP_END]
  return L


def plot_map(regimes: list[Regime], path: str) -> None:
  """One panel per regime: held-out sampled accuracy against generated tokens, median and
  IQR band over seeds per configuration; the dotted line is on-policy's final accuracy."""
  from jaxreplay import report
  plt = report.plt
  fig, axes = plt.subplots(1, len(regimes), figsize=(5.5 * len(regimes), 4.2), squeeze=False)
  for ax, g in zip(axes[0], regimes):
    styles = report._styles(g.configs)
    for c in g.configs:
      rs = g.runs[c["name"]]
      if not rs:
        continue
      report.plot_band(ax, rs, "generated_tokens", "eval/acc_sampled", styles[c["name"]],
                       f"{c['name'].removeprefix(g.name + '_')} ({len(rs)})", lw=1.4)
    if g.analysis is not None:
      ax.axhline(g.analysis.target, color="k", lw=0.8, ls=":")
    ax.set_title(g.name, fontsize=10)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out sampled accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def splice_map(text: str, block: Sequence[str]) -> str:
  """``text`` (a results page) with its map section replaced by ``block``, or ``block``
  inserted before the page's first ``## `` heading when it has none (at the end when it
  has no heading)."""
  lines = text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith(MAP_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == MAP_END), None)
  if start is not None and end is not None and end >= start:
    lines = lines[:start] + list(block) + lines[end + 1:]
  else:
    at = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), len(lines))
    lines = lines[:at] + list(block) + [""] + lines[at:]
  return "\n".join(lines).rstrip() + "\n"


def map_block(text: str) -> list[str]:
  """The map section of a results page, markers included ([] when it has none)."""
  lines = text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith(MAP_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == MAP_END), None)
  if start is None or end is None or end < start:
    return []
  return lines[start:end + 1]


def write_map(sweep: dict, workdir: str, md_path: str) -> list[str]:
  """Computes the map from the sweep's runs and splices it into ``md_path`` (created when
  absent); the figure goes to ``<md_path without .md>/where_replay_pays.png``. A README
  beside the page's ``docs/`` gets its headline block rewritten (``report.readme_beside``).

  Returns:
    [md_path, figure path].

  Raises:
    ValueError: a configuration without ``regime`` / ``role`` (``regimes_of``).
  """
  from jaxreplay import report
  runs, _ = report.load_runs(sweep, workdir)
  regimes = regimes_of(sweep, runs)
  fig_dir = os.path.splitext(md_path)[0]
  os.makedirs(fig_dir, exist_ok=True)
  fig = os.path.join(fig_dir, "where_replay_pays.png")
  plot_map(regimes, fig)
  block = render_map(sweep, regimes, os.path.relpath(fig, os.path.dirname(md_path)))
  try:
    with open(md_path) as f:
      old = f.read()
  except OSError:
    old = f"# {(sweep.get('report') or {}).get('title', 'Where replay pays')}\n"
  report._write(md_path, splice_map(old, block).splitlines())
  readme = report.readme_beside(md_path)
  if readme:
    report.write_readme_headline(readme, md_path)
  for g in regimes:
    x, y = g.design
    if x == x:
      print(f"{g.name}: mu={g.median['mu']:.3g} alpha={g.median['alpha']:.3g} "
            f"rho={g.median['rho']:.3g} -> theory (x*, y*) = ({x:.2f}, {y:.2f}), "
            f"rounded {round_design(x, y)}")
  return [md_path, fig]
