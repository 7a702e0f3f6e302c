"""The report's markdown: number formats, tables, and the sections the pages print.

``fmt`` / ``fmt_q`` / ``fmt_diff`` format numbers and intervals; ``table`` a markdown table;
the single-regime page's sections (``target_lines`` … ``theory_lines``, from
``runs.Analysis``) and the regime map's evidence tables (``comparison_table`` …
``y_star_table``, from ``evidence``) are lists of lines. Nothing here computes a statistic:
it formats what ``stats``, ``fit``, ``null``, ``runs`` and ``evidence`` return.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from jaxreplay import theory
from jaxreplay.study import evidence, null, stats
from jaxreplay.study.runs import METRICS, PAPER_MU, Analysis
from jaxreplay.study.stats import INF, quantiles, verdict
from jaxreplay.train import accounting


# --- formats ------------------------------------------------------------------------------

def fmt(x: float, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if math.isinf(x):
    return "not reached" if x > 0 else "-inf"
  if abs(x) >= 1e5:
    return f"{x:.3g}"
  return f"{x:.{digits}f}"


def fmt_q(values: Sequence[float], digits: int = 3) -> str:
  """"median [q25, q75]" of ``values`` (one value: just it)."""
  q25, q50, q75 = quantiles(values)
  if len(values) <= 1:
    return fmt(q50, digits)
  return f"{fmt(q50, digits)} [{fmt(q25, digits)}, {fmt(q75, digits)}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
  """A markdown table: the header, the rule, one line per row."""
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
      ["| " + " | ".join(r) + " |" for r in rows]


def write_lines(path: str, lines: list[str]) -> None:
  """Writes ``lines`` to ``path`` (its folder created), atomically."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write("\n".join(lines).rstrip() + "\n")
  os.replace(tmp, path)


# --- the paper's claims (single-regime page) -----------------------------------------------

def evaluate_claim(an: Analysis, claim: dict) -> tuple[str, str, str]:
  """(comparison, numbers, verdict) of one claim spec of ``report.claims``.

  Kinds:
    compare: ``metric`` of configuration ``a`` vs ``b``, ``expect`` "higher" / "lower".
    replay_ratio: every run's replay ratio K_train/K_inf within ``tolerance`` (relative,
      default 0.05) of its configured B/R (sync and simulated_async runs).
    theory_monotone: ``jaxreplay.theory.power_law_design``'s x*, y* rise with μ and fall
      with ρ and α around (``mu``, ``rho``, ``alpha``).
  """
  kind = claim.get("kind", "compare")
  if kind == "compare":
    m, a, b, expect = claim["metric"], claim["a"], claim["b"], claim["expect"]
    va, vb = an.values(a, m), an.values(b, m)
    d = quantiles(va)[1] - quantiles(vb)[1]
    comp = f"{METRICS.get(m, m)}: {a} vs {b} (expect {expect})"
    nums = (f"{fmt_q(va)} vs {fmt_q(vb)} (n={len(va)}, {len(vb)}); "
            f"difference of medians {fmt(d)}")
    return comp, nums, verdict(va, vb, expect)
  if kind == "replay_ratio":
    tol = claim.get("tolerance", 0.05)
    errs = []
    for rs in an.runs.values():
      for r in rs:
        y = r.nominal()["y"]
        if r.cfg("train.mode") in ("sync", "simulated_async") and y == y:
          errs.append(r.replay_ratio() / y - 1.0)
    if not errs:
      return "replay ratio vs B/R", "no runs", "cannot tell"
    worst = max(errs, key=abs)
    mus = [r.mu_time() for rs in an.runs.values() for r in rs]
    nums = (f"largest |K_train/K_inf ÷ (B/R) − 1| = {abs(worst):.3f} over {len(errs)} runs; "
            f"μ (time) estimated per run: {fmt_q(mus)}")
    return (f"measured replay ratio vs configured B/R (tolerance {tol:.0%})", nums,
            "supported" if abs(worst) <= tol else "contradicted")
  if kind == "theory_monotone":
    mu, rho, alpha = claim.get("mu", PAPER_MU), claim.get("rho", 0.1), claim.get("alpha", 0.25)
    base = theory.power_law_design(mu, rho, alpha)
    checks = {"μ ×2": (theory.power_law_design(2 * mu, rho, alpha), +1),
              "ρ ×2": (theory.power_law_design(mu, min(2 * rho, 1.0), alpha), -1),
              "α ×1.5": (theory.power_law_design(mu, rho, min(1.5 * alpha, 0.49)), -1)}
    ok = all(np.sign(new[0] - base[0]) == s and np.sign(new[1] - base[1]) == s
             for new, s in checks.values())
    nums = f"at μ={mu}, ρ={rho}, α={alpha}: (x*, y*) = ({base[0]:.2f}, {base[1]:.2f}); " + \
        "; ".join(f"{k}: ({v[0][0]:.2f}, {v[0][1]:.2f})" for k, v in checks.items())
    return "closed form (App. 9.3.2), not the sweep", nums, "supported" if ok else "contradicted"
  raise ValueError(f"unknown claim kind {kind!r}")


# --- the single-regime page's sections ----------------------------------------------------

def final_is(an: Analysis) -> str:
  if an.k_last == 1:
    return "its last evaluation"
  return f"the mean of its last {an.k_last} evaluations"


def target_lines(an: Analysis, mu: dict, paper_mu: float) -> list[str]:
  """μ, the target accuracy and the reference's plateau check."""
  return [f"- measured μ (median over runs): {fmt(mu['time'])} from phase times (steady state, "
          f"first step left out), {fmt(mu['flops'])} from FLOP estimates; the paper's μ: "
          f"{paper_mu}",
          f"- target: the reference `{an.reference}`'s final held-out sampled accuracy "
          f"({final_is(an)}), median over its seeds = **{fmt(an.target)}** (reached at "
          f"{fmt(an.ref_reach['tokens'], 0)} generated tokens, median over its seeds)",
          f"- plateau check: the reference's final accuracy minus the mean of the {an.k_last} "
          f"evaluation(s) before = {fmt_q(an.plateau)} (median [IQR] over seeds; near 0: it has "
          "stopped improving, clearly positive: still rising when its budget ended)", ""]


def headline_lines(an: Analysis, configs: list[dict], names: list[str], mu: dict,
                   paper_mu: float) -> list[str]:
  """Generation (tokens, compute) each configuration needs to reach on-policy's accuracy."""
  fam = {c["name"]: c.get("family", c["name"]) for c in configs}
  L = ["## Headline: generation needed to reach on-policy's final accuracy", "",
       f"Generated tokens at the first evaluation with held-out sampled accuracy ≥ "
       f"{fmt(an.target)}, as % of on-policy's (median [IQR] over seeds; a seed that never "
       "reaches it counts as +∞, so the median is \"not reached\" unless more than half of "
       "the seeds reached it; \"reached\" gives k/n seeds). Resolution: one evaluation "
       "interval. Compute columns: the same on the paper's compute axis.", ""]
  if not 0 < an.ref_reach["tokens"] < INF:
    L += [f"**On-policy's median tokens to reach its own final accuracy is "
          f"{fmt(an.ref_reach['tokens'], 0)}: its final accuracy is no better than at the "
          "start (or never reached), so the percentages below are undefined (–).**", ""]
  rows = []
  for n in names:
    v = an.runs[n][0].nominal()
    pct = an.values(n, "tokens_to_target_pct")
    rows.append([f"`{n}`", fam[n], v["mode"], fmt(v["x"], 2), fmt(v["y"], 2), fmt_q(pct, 0),
                 f"{sum(math.isfinite(x) for x in pct)}/{len(pct)}",
                 fmt_q(an.values(n, "compute_to_target_pct_measured"), 0),
                 fmt_q(an.values(n, "compute_to_target_pct_paper"), 0)])
  return L + table(["configuration", "family", "mode", "x = N/R", "y = B/R",
                    "tokens to target, % of on-policy", "reached",
                    f"compute to target, % (μ = {fmt(mu['time'], 2)})",
                    f"compute to target, % (μ = {paper_mu})"], rows) + [""]


def accuracy_lines(an: Analysis, names: list[str]) -> list[str]:
  """Peak, final and equal-budget held-out accuracy per configuration."""
  k = an.runs[an.reference][0].largest_k()
  L = ["## Accuracy", "", "Median [IQR] over seeds. Peak: the best evaluation of a run; "
       f"final: {final_is(an)}. Entropy: the fresh-sample entropy of the last evaluation.", ""]
  rows = [[f"`{n}`"] + [fmt_q(an.values(n, m)) for m in
                        ("peak_sampled", "final_sampled", "peak_greedy", "final_greedy",
                         "passk_final", "entropy_final", "sampled_at_ref_tokens",
                         "sampled_at_ref_steps")] for n in names]
  return L + table(["configuration", "peak sampled", "final sampled", "peak greedy",
                    "final greedy", f"pass@{k}", "entropy (nats/token)",
                    "sampled at on-policy's tokens", "sampled at on-policy's steps"],
                   rows) + [""]


def accounting_lines(an: Analysis, names: list[str], mu: dict, paper_mu: float) -> list[str]:
  """μ, γ, replay ratio and staleness per configuration, and accuracy at equal compute."""
  L = ["## Compute accounting", "",
       "μ = cost per generated rollout ÷ cost per trained sample (`accounting.mu`), from "
       "phase times (first step left out) and from FLOP estimates; γ = (1 + W/T)/(1 + μ) at "
       "the emulated W/T = μ/ρ (`accounting.gamma`), the per-update cost relative to "
       "on-policy; replay ratio ρ = trained ÷ generated rollouts; staleness in policy "
       "versions. Compute columns: γ at the sweep's measured μ and at the paper's μ, and the "
       "sampled accuracy at on-policy's total compute on each axis.", ""]
  rows = []
  for n in names:
    rho = an.values(n, "replay_ratio")
    rows.append([f"`{n}`", fmt_q(an.values(n, "mu_time"), 2), fmt_q(an.values(n, "mu_flops"), 2),
                 fmt_q(an.values(n, "gamma_time"), 2), fmt_q(an.values(n, "gamma_flops"), 2),
                 fmt_q(rho, 2), fmt_q(an.values(n, "staleness_mean"), 2),
                 fmt_q([accounting.gamma(mu["time"], x) for x in rho], 2),
                 fmt_q([accounting.gamma(paper_mu, x) for x in rho], 2),
                 fmt_q(an.values(n, "sampled_at_ref_compute_measured")),
                 fmt_q(an.values(n, "sampled_at_ref_compute_paper"))])
  return L + table(["configuration", "μ (time)", "μ (FLOPs)", "γ (time)", "γ (FLOPs)",
                    "replay ratio", "mean staleness", f"γ at μ = {fmt(mu['time'], 2)}",
                    f"γ at μ = {paper_mu}",
                    f"sampled at on-policy's compute (μ = {fmt(mu['time'], 2)})",
                    f"sampled at on-policy's compute (μ = {paper_mu})"], rows) + [""]


def claims_lines(an: Analysis, claims: list[dict]) -> list[str]:
  """The verdict on each of ``report.claims`` (none: no section)."""
  if not claims:
    return []
  L = ["## The paper's claims (NOTES.md §7)", "",
       "Rule: a comparison of configuration A with B is *supported* when A's interquartile "
       "range over seeds lies entirely on the predicted side of B's, *contradicted* when "
       "entirely on the other side, and *cannot tell* when the two ranges overlap or runs "
       "are missing. Numbers: median [IQR] (n seeds).", ""]
  rows = []
  for c in claims:
    try:
      comp, nums, v = evaluate_claim(an, c)
    except (KeyError, ValueError) as e:
      comp, nums, v = "–", f"not evaluated: {e}", "cannot tell"
    rows.append([str(c.get("id", "")), c.get("text", ""), comp, nums, f"**{v}**"])
  return L + table(["#", "claim", "comparison", "numbers", "verdict"], rows) + [""]


def theory_lines(an: Analysis, names: list[str], mu: dict, paper_mu: float,
                 constants: list[dict]) -> list[str]:
  """The closed form's (x*, y*) at each (ρ, α) of ``constants``, and the sweep's best."""
  L = ["## The theory's optimum next to the sweep's best", "",
       "`jaxreplay.theory.power_law_design` (σ(s) ∝ s^α, paper App. 9.3.2) at the measured "
       "μ and at the paper's μ, for the (ρ, α) below (the paper never estimates them). "
       "x* = N/R ≤ 1 means: stay on-policy.", ""]
  rows = []
  for t in constants:
    row = [str(t["rho"]), str(t["alpha"])]
    for m in (mu["time"], mu["flops"], paper_mu):
      try:
        x, y = theory.power_law_design(m, t["rho"], t["alpha"])
        row.append(f"({x:.2f}, {y:.2f})")
      except ValueError:
        row.append("–")
    rows.append(row)
  L += table(["ρ", "α", f"(x*, y*) at μ = {fmt(mu['time'], 2)} (time)",
              f"(x*, y*) at μ = {fmt(mu['flops'], 2)} (FLOPs)",
              f"(x*, y*) at μ = {paper_mu}"], rows) + [""]
  best = best_configuration(an, names)
  if best:
    n, crit = best
    v = an.runs[n][0].nominal()
    L += [f"Best configuration found: `{n}` (x = {fmt(v['x'], 2)}, y = "
          f"{fmt(v['y'], 2)}, {v['mode']}) — {crit}.", ""]
  return L


def best_configuration(an: Analysis, names: list[str]) -> tuple[str, str] | None:
  """The configuration with the least median compute to the target (measured μ); if no
  configuration reaches it, the highest median sampled accuracy at on-policy's compute."""
  vals = {n: quantiles(an.values(n, "compute_to_target_pct_measured"))[1] for n in names}
  fin = {n: v for n, v in vals.items() if math.isfinite(v)}
  if fin:
    n = min(fin, key=fin.get)
    return n, (f"least median compute to reach the target at the measured μ: {fin[n]:.0f}% "
               "of on-policy's")
  acc = {n: quantiles(an.values(n, "sampled_at_ref_compute_measured"))[1] for n in names}
  acc = {n: v for n, v in acc.items() if v == v}
  if not acc:
    return None
  n = max(acc, key=acc.get)
  return n, (f"no configuration reaches the target; highest median sampled accuracy at "
             f"on-policy's compute (measured μ): {acc[n]:.3f}")


# --- the regime map's evidence ------------------------------------------------------------

def fmt_ci(ci: Sequence[float], digits: int = 3) -> str:
  """"[lo, hi]" of an interval ("–" when unknown)."""
  lo, hi = ci
  if lo != lo or hi != hi:
    return "–"
  return f"[{fmt(lo, digits)}, {fmt(hi, digits)}]".replace("not reached", "∞")


def fmt_signed(x: float, digits: int = 3) -> str:
  return "–" if x != x else f"{x:+.{digits}f}"


def fmt_diff(c: stats.Comparison | None, digits: int = 3) -> str:
  """"+0.032 [-0.010, 0.074]": the mean per-seed difference and its t interval."""
  if c is None:
    return "–"
  return f"{fmt_signed(c.mean, digits)} {fmt_ci(c.t, digits)}"


def fmt_ratio(r: stats.Ratio | None) -> str:
  """"0.41 [0.37, 1.07] (3/3)": the median ratio over seeds, the seed bootstrap's interval
  of it and the seeds that reach the target."""
  if r is None:
    return "–"
  return f"{fmt(r.median, 2)} {fmt_ci(r.boot, 2)} ({r.reached}/{len(r.ratio_s)})"


COMPARISON_HEADER = ["regime", "configuration", "against", "AUC difference [95% t]",
                     "[95% seed bootstrap]", "P(improvement)", "p (one-sided t)",
                     "at 25% of the budget [95% t]", "at 50% [95% t]", "at 100% [95% t]",
                     "tokens to its smoothed final, ratio [95% bootstrap] (reached)"]


def comparison_row(regime: str, c: evidence.ConfigComparison) -> list[str]:
  """One row of ``COMPARISON_HEADER``."""
  return [regime, f"`{c.name}`", f"`{c.against}`", fmt_diff(c.auc),
          fmt_ci(c.auc.boot), fmt(c.auc.p_improve, 2), fmt(c.auc.p_value, 3)] + \
      [fmt_diff(c.at[f]) for f in evidence.FRACTIONS] + [fmt_ratio(c.tokens)]


FIT_HEADER = ["regime", "configuration", "R0", "A [95%]", "B [95%]",
              "C_mid, share of the budget [95%]", "C_mid within the runs (share of resamples)",
              "RMSE"]


def fit_row(regime: str, name: str, f) -> list[str]:
  """One row of ``FIT_HEADER`` for a ``fit.SaturatingFit`` (or None: the fit failed)."""
  if f is None:
    return [regime, f"`{name}`"] + ["–"] * (len(FIT_HEADER) - 2)
  a = (f"{fmt(f.a)} {fmt_ci(f.a_ci)}" if f.identified else
       f"not identified ({fmt(f.a)} {fmt_ci(f.a_ci)})")
  return [regime, f"`{name}`", fmt(f.r0), a, f"{fmt(f.b, 2)} {fmt_ci(f.b_ci, 2)}",
          f"{fmt(f.c_mid, 2)} {fmt_ci(f.c_mid_ci, 2)}", fmt(f.past_mid, 2), fmt(f.rmse)]


def rule_rows(rates: Sequence[evidence.RuleRates], regimes: Sequence[str]) -> list[list[str]]:
  """Per rule: its text, what it decides, its false-positive rate (largest over regimes),
  its power at ``null.SAVING`` and the seeds that power needs, per regime, and kept or not."""
  rows = []
  for r in rates:
    kept = r.fpr_max <= null.ALPHA
    need = ", ".join(f"{g}: {r.seeds_needed[g] if r.seeds_needed[g] else '> 64'}"
                     for g in regimes if g in r.seeds_needed) or "–"
    rows.append([f"`{r.rule.name}`", r.rule.text, r.used or "–", fmt(r.fpr_max, 3),
                 ", ".join(f"{g}: {fmt(r.power[g], 2)}" for g in regimes), need,
                 ("yes" if r.used else "not used: less power") if kept else
                 "**no** (false-positive rate above 5%)"])
  return rows


RULE_HEADER = ["rule", "fires when", "decides", "false-positive rate (largest over regimes)",
               f"power at a {null.SAVING:.0%} token saving", "seeds for 80% power", "kept"]


Y_STAR_HEADER = ["regime", "μ", "registered y*", "theory's y*(μ) now", "nearest y run",
                 "best y (configuration)", "y's not shown worse", "agree (registered)",
                 "agree (now)"]


def y_star_row(regime: str, c: evidence.YStarCheck) -> list[str]:
  """One row of ``Y_STAR_HEADER``: "registered" is the prediction in the sweep file before
  the runs, "now" the theory at the constants the regime's self-tuning runs measured."""
  ys = "{" + ", ".join(fmt(y, 0) for y in c.ys) + "}"
  tell = "cannot tell (every y)"
  now = ("yes" if c.agree else "no") if c.informative else tell
  reg = ("–" if not c.registered else
         ("yes" if c.agree_predicted else "no") if c.informative else tell)
  return [regime, fmt(c.mu, 1), fmt(c.predicted, 0) if c.registered else "–",
          fmt(c.theory_y, 2), fmt(c.theory_grid, 0), f"{fmt(c.best_y, 0)} (`{c.best}`)", ys,
          reg, now]
