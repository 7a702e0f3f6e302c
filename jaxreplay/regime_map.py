"""Where replay pays: the regime map of a sweep (NOTES.md §4, Thm 4.5, App. 9.3.2).

A regime-map sweep file (``report.kind = "regime_map"``, such as
``configs/sweep/where_replay_pays.py``) tags every configuration with its ``regime`` and a
``role``: ``onpolicy`` (N = R = B, the regime's reference), ``fixed`` (a FIFO buffer at a
fixed x = N/R, y = B/R) or ``auto`` (the self-tuning buffer, ``auto_replay``, whose runs
log the noise estimates ``noise/alpha`` and ``noise/rho``). All runs of a regime spend the
same generation budget. Per regime this module gathers, from the runs' files alone:

  * the constants of the theory, per seed from the regime's ``auto`` runs: μ (generating one
    rollout over training on one sample) from FLOPs (``RunData.mu_flops``: model shapes and
    the tokens generated and trained, the same on any machine; the theory uses it) and from
    steady-state phase times (``RunData.mu_time``, which moves with the machine's load), α
    and ρ (the median of the run's estimates, ``rl.noise``; NaN estimates left out); median
    [IQR] over seeds; the theory's (x*, y*) at the median constants within the sweep's
    bounds (``evidence.theory_design``: ρ clipped to [0, 1], α to >= 0);
  * the evidence (``jaxreplay.study.evidence``): every configuration against on-policy and
    against the best fixed configuration, paired by seed, with intervals; the decisions
    "replay pays" and "self-tuning falls short of the best fixed"; a saturating fit per
    configuration; the theory's y*(μ) beside the runs re-scored on compute at
    ``report.y_star_mus`` (default ``evidence.MUS``);
  * over all regimes (``Study``): the noise model fitted to the runs, every decision rule's
    false-positive rate and power simulated on it (``null``), and the smallest AUC
    difference the study's seeds could detect.

``write_map`` renders the "Where replay pays" section (between ``MAP_START`` and
``MAP_END``), splices it into the results page, leaving the rest of the page as it is, and
ends the page with the study's line ``regimes=N seeds_min=S null_fpr_max=F y_star_checks=K
y_star_agree=J`` (``FOOTER``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Sequence

import numpy as np

from jaxreplay.study import evidence, figures, null, stats, tables
from jaxreplay.study.evidence import round_design, theory_design  # noqa: F401  (public here)
from jaxreplay.study.runs import load_runs

MAP_START = "<!-- where-replay-pays:start"
MAP_END = "<!-- where-replay-pays:end -->"
MAP_NOTE = ("<!-- where-replay-pays:start (written by `python -m jaxreplay.sweep --config "
            "configs/sweep/where_replay_pays.py --report-only`; do not edit by hand) -->")
FOOTER = re.compile(r"^regimes=\d+ seeds_min=\d+ null_fpr_max=[\d.]+ y_star_checks=\d+ "
                    r"y_star_agree=\d+$")
ROLES = ("onpolicy", "fixed", "auto")
MAP_COLUMNS = ("regime", "μ (FLOPs)", "μ (time)", "α", "ρ", "theory's (x*, y*)", "buffer with the smallest p",
               "its AUC − on-policy's [95% t]", "p (one-sided t)", "replay pays",
               "self-tuning − best fixed, AUC [95% t]", "self-tuning falls short")
# the page's regime table: the README's columns (``MAP_COLUMNS``) and two more
REGIME_COLUMNS = MAP_COLUMNS[:3] + ("μ (time) on-policy",) + MAP_COLUMNS[3:6] + \
    ("y* per seed",) + MAP_COLUMNS[6:]


def run_constants(run) -> dict[str, float]:
  """μ, α, ρ of one run and how many noise estimates it logged.

  Args:
    run: a ``runs.RunData``.

  Returns:
    {"mu_flops": μ from the ledger's FLOP counts, "mu": μ from steady-state phase times
     (both unitless, cost per generated rollout over cost
     per trained sample), "alpha": median ``noise/alpha``, "rho": median ``noise/rho``,
     "estimates": int count of records with a ``noise/alpha``} — NaN where absent.
  """
  def med(key):  # the metric files keep NaN as a string
    v = [float(r[key]) for r in run.records if key in r]
    v = [x for x in v if math.isfinite(x)]
    return float(np.median(v)) if v else float("nan")
  n = sum(1 for r in run.records if "noise/alpha" in r)
  return {"mu_flops": run.mu_flops(), "mu": run.mu_time(), "alpha": med("noise/alpha"), "rho": med("noise/rho"),
          "estimates": n}


class Regime:
  """The runs and numbers of one regime.

  Attributes:
    name: the regime's name. configs: its configuration dicts, sweep order.
    reference: its on-policy configuration (None without one). runs: {configuration:
      [RunData]}. constants: [per-seed ``run_constants``] of its ``auto`` runs; median:
      their medians. design: the theory's (x*, y*) at the median constants (NaNs when
      unknown); seed_designs: at each self-tuning run's own constants.
    evidence: ``evidence.RegimeEvidence`` (None without on-policy runs).
    checks: [``evidence.YStarCheck``] per μ of ``mus``.
  """

  def __init__(self, name: str, configs: list[dict], runs: dict, x_bounds, y_bounds,
               mus: Sequence[float] = evidence.MUS, seed: int = 0,
               predicted: Sequence[float] | None = None):
    self.name, self.configs = name, configs
    self.by_role = {r: [c["name"] for c in configs if c.get("role") == r] for r in ROLES}
    self.reference = self.by_role["onpolicy"][0] if self.by_role["onpolicy"] else None
    # a configuration with fewer than 2 seeds has no paired statistic yet: left out of
    # the evidence (``pending``) until its runs are in, but counted in ``seeds_file``
    self.all_runs = {c["name"]: runs.get(c["name"], []) for c in configs}
    self.pending = {n: len(rs) for n, rs in self.all_runs.items() if len(rs) < 2}
    self.runs = {n: (rs if n not in self.pending else []) for n, rs in self.all_runs.items()}
    self.constants = [run_constants(r) for n in self.by_role["auto"] for r in self.runs[n]]
    self.median = {k: stats.quantiles([c[k] for c in self.constants])[1]
                   for k in ("mu_flops", "mu", "alpha", "rho")}
    self.design = theory_design(self.median["mu_flops"], self.median["alpha"], self.median["rho"],
                                x_bounds, y_bounds)
    self.seed_designs = [theory_design(c["mu_flops"], c["alpha"], c["rho"], x_bounds, y_bounds)
                         for c in self.constants]
    roles = {c["name"]: c.get("role") for c in configs}
    self.evidence, self.checks = None, []
    if self.reference and self.runs[self.reference]:
      self.evidence = evidence.regime_evidence(self.runs, roles, self.reference, seed)
      y_of = {n: self.xy(n)[1] for n in self.runs if self.runs[n]}
      self.checks = evidence.y_star_checks(self.runs, roles, self.reference, y_of,
                                           self.median["alpha"], self.median["rho"],
                                           x_bounds, y_bounds, mus, predicted)

  def xy(self, name: str) -> tuple[float, float]:
    """Nominal (x, y) of a configuration from its first run's config.json."""
    rs = self.runs.get(name) or []
    if not rs:
      return float("nan"), float("nan")
    v = rs[0].nominal()
    return v["x"], v["y"]

  def replay_pays(self) -> bool | None:
    """"Replay pays" (``evidence.RegimeEvidence.pays``); None without on-policy runs."""
    return None if self.evidence is None else self.evidence.pays

  def theory_says_replay(self) -> bool | None:
    x, y = self.design
    if not (x == x and y == y):
      return None
    return round_design(x, y)[1] > 1

  def seeds(self) -> int:
    """The fewest seeds of the configurations the evidence uses (those with 2 or more)."""
    v = [len(rs) for rs in self.runs.values() if rs]
    return min(v) if v else 0

  def seeds_file(self) -> int:
    """The fewest seeds of any configuration the sweep file lists (0: one has none)."""
    return min(len(v) for v in self.all_runs.values()) if self.all_runs else 0

  def controller(self) -> dict[str, Any]:
    """The self-tuning runs' last knobs, number of changes, seconds spent estimating and
    seconds of generation + training + evaluation + estimation (per seed lists)."""
    out = {"R": [], "max_staleness": [], "changes": [], "y": [], "x": [], "estimate_s": [],
           "wall_s": [], "mu_source": []}
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
        # runs from before the controller read FLOPs steered by wall time
        out["mu_source"].append(r.cfg("auto_replay.mu_source", "time"))
        out["estimate_s"].append(sum(e.get("auto/estimate_s", 0.0) for e in r.records))
        out["wall_s"].append(sum(last.get(k, 0.0) for k in ("generate_s", "train_s", "eval_s"))
                             + out["estimate_s"][-1])
    return out


def regimes_of(sweep: dict, runs: dict, seed: int = 0) -> list[Regime]:
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
  mus = tuple(float(m) for m in rep.get("y_star_mus", evidence.MUS))
  test = dict(rep.get("y_star_test", {}) or {})
  unknown = sorted(set(test) - set(order))
  if unknown:
    raise ValueError(f"report.y_star_test: regimes {unknown} are not in the sweep (its "
                     f"regimes: {sorted(order)})")
  return [Regime(k, v, runs, xb, yb, mus, seed,
                 tuple(test[k]["predicted"]) if k in test else None)
          for k, v in order.items()]


# --- over all regimes ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Study:
  """The regimes and what their seeds can resolve.

  Attributes:
    regimes: [Regime] with evidence. noise: ``null.NoiseModel`` fitted to all their runs.
    rates: [``evidence.RuleRates``] of every rule at each regime's design. n_seeds:
    {regime: the fewest seeds of its configurations with evidence}. n_buffers: {regime: its
    buffers with evidence, the Bonferroni k}. sd_d: SD of one seed's AUC difference under
    the noise model. detectable: {regime: the smallest AUC difference the "replay pays"
    rule detects there with ``null.POWER``}. detectable_saving: {regime: the token saving
    that difference is on its on-policy curve, NaN above 95%}.
    n_sims: simulated studies per rate. seeds_min: the fewest seeds of any configuration
    of any regime the sweep file lists, run or not (the study line's; -1: ``n_seeds``).
  """

  regimes: list
  noise: null.NoiseModel
  rates: list
  n_seeds: dict
  n_buffers: dict
  sd_d: float
  detectable: dict
  detectable_saving: dict
  n_sims: int
  seeds_min: int = -1

  def rule(self, name: str) -> evidence.RuleRates:
    return next(r for r in self.rates if r.rule.name == name)

  @property
  def fpr_max(self) -> float:
    """The largest false-positive rate of the rules the report decides with."""
    return max(r.fpr_max for r in self.rates if r.used)

  def line(self) -> str:
    """``regimes=N seeds_min=S null_fpr_max=F y_star_checks=K y_star_agree=J``: K, J count
    the checks registered before the runs (``report.y_star_test``) where the sweep
    registered any, else every check against the theory at the measured constants."""
    checks = [c for g in self.regimes for c in g.checks]
    reg = [c for c in checks if c.registered]
    agree = sum(c.agree_predicted for c in reg) if reg else sum(c.agree for c in checks)
    seeds = min(self.n_seeds.values()) if self.seeds_min < 0 else self.seeds_min
    return (f"regimes={len(self.regimes)} seeds_min={seeds} "
            f"null_fpr_max={self.fpr_max:.3f} y_star_checks={len(reg or checks)} "
            f"y_star_agree={agree}")


def noise_of(regimes: list[Regime]) -> null.NoiseModel:
  """``null.fit_noise`` of the runs of ``regimes`` (each with evidence: on-policy runs)."""
  return null.fit_noise([(float(np.median(list(g.evidence.budget_s.values()))),
                          {n: {r.seed: r.curve() for r in rs} for n, rs in g.runs.items() if rs})
                         for g in regimes])


def study_of(regimes: list[Regime], n_sims: int = 4000, seed: int = 0) -> Study:
  """``Study`` of the regimes that have on-policy runs.

  Raises:
    ValueError: no regime with on-policy runs, or fewer than 2 seeds.
  """
  done = [g for g in regimes if g.evidence is not None]
  if not done:
    raise ValueError("no regime has on-policy runs")
  n_seeds = {g.name: g.seeds() for g in done}
  if min(n_seeds.values()) < 2:
    raise ValueError(f"seeds per regime {n_seeds}: paired statistics need 2")
  noise = noise_of(done)
  curves = {g.name: evidence.mean_curve(g.runs[g.reference]) for g in done}
  n_buffers = {g.name: max(g.evidence.n_tests, 1) for g in done}
  rates = evidence.rule_table(noise, curves, n_buffers, n_seeds, n_sims, seed)
  sd_d = null.auc_difference_sd(noise)
  det = {g: null.detectable_difference(sd_d, n_seeds[g], n_buffers[g]) for g in curves}
  return Study(done, noise, rates, n_seeds, n_buffers, sd_d, det,
               {g: null.saving_for_gain(f, det[g]) for g, f in curves.items()}, n_sims,
               min(g.seeds_file() for g in regimes))


# --- the page -----------------------------------------------------------------------------

def _yes(v: bool | None, yes: str, no: str) -> str:
  return "–" if v is None else yes if v else no


def _lead_phrase(g: Regime) -> str:
  ev = g.evidence
  c = ev.vs_reference.get(ev.lead) if ev.lead else None
  return f"`{ev.lead}`, {tables.fmt_diff(c.auc)}" if c else "no buffer"


def _span(v) -> str:
  """"3" or "3–6": the range of some counts."""
  v = sorted(set(v))
  return f"{v[0]}" if len(v) == 1 else f"{v[0]}–{v[-1]}"


def summary_sentences(study: Study) -> str:
  """The map in three sentences (the README's headline states them)."""
  gs, s = study.regimes, study
  pays = [g for g in gs if g.evidence.pays]
  rule = s.rule("auc_bonferroni")
  first = (f"Paired by seed ({_span(s.n_seeds.values())} seeds, one warm start each), a "
           f"buffer's mean held-out accuracy over on-policy's log-token budget (AUC) beats "
           f"on-policy's by the rule below (one-sided t at 5%/k, k the regime's buffers, "
           f"false-positive rate "
           f"{tables.fmt(rule.fpr_max, 3)} under the runs' own noise) in {len(pays)} of "
           f"{len(gs)} regimes")
  if pays:
    first += ": " + "; ".join(f"{g.name} ({_lead_phrase(g)})" for g in pays)
  rest = [g for g in gs if g not in pays]
  if rest:
    first += ("; not shown in " + "; ".join(f"{g.name} ({_lead_phrase(g)})" for g in rest))
  need = sorted(n or math.inf for n in rule.seeds_needed.values())
  span = lambda n: "more than 64" if n == math.inf else str(n)  # noqa: E731
  need_txt = ("–" if not need else span(need[0]) if need[0] == need[-1] else
              f"{span(need[0])} to {span(need[-1])}")
  det = "; ".join(
      f"{tables.fmt(s.detectable[g], 3)} at {g} ({s.n_seeds[g]} seeds, k = {s.n_buffers[g]}), "
      + (f"a token saving of {tables.fmt(100 * v, 0)}%" if v == v else
         "a token saving of more than 95%")
      for g, v in sorted(s.detectable_saving.items(), key=lambda kv: (kv[1] != kv[1], kv[1])))
  small = all(v == v and v <= null.SAVING for v in s.detectable_saving.values())
  second = (("The study resolves" if small else "The study is underpowered") +
            f": the smallest AUC difference it detects 4 times in 5 on the regimes' on-policy "
            f"curves is {det}; a {null.SAVING:.0%} saving needs {need_txt} seeds")
  short = [g for g in gs if g.evidence.auto_short]
  with_auto = [g for g in gs if g.evidence.auto_short is not None]
  checks = [c for g in gs for c in g.checks]
  reg = [c for c in checks if c.registered]
  if reg:
    y_txt = (f"the theory's y*(μ) registered before the runs agrees with the runs re-scored on "
             f"compute in {sum(c.agree_predicted for c in reg)} of {len(reg)} checks "
             f"({sum(not c.informative for c in reg)} cannot tell)")
  else:
    y_txt = (f"the theory's y*(μ) agrees with the runs re-scored on compute in "
             f"{sum(c.agree for c in checks)} of {len(checks)} checks "
             f"({sum(not c.informative for c in checks)} cannot tell)")
  third = (f"self-tuning is shown short of the best fixed configuration in {len(short)} of "
           f"{len(with_auto)} regimes, and {y_txt}.")
  return f"{first}. {second}; {third}"


def _regime_row(g: Regime) -> list[str]:
  """One row of ``REGIME_COLUMNS``."""
  ev, fq, fmt = g.evidence, tables.fmt_q, tables.fmt
  x, y = g.design
  lead = ev.vs_reference.get(ev.lead) if ev.lead else None
  auto = ev.vs_best.get(ev.auto) if ev.auto else None
  mu_on = [r.mu_time() for n in g.by_role["onpolicy"] for r in g.runs[n]]
  return [g.name, fq([c["mu_flops"] for c in g.constants], 2),
          fq([c["mu"] for c in g.constants], 2), fq(mu_on, 2),
          fq([c["alpha"] for c in g.constants], 2), fq([c["rho"] for c in g.constants], 2),
          f"({fmt(x, 2)}, {fmt(y, 2)})", fq([d[1] for d in g.seed_designs], 2),
          f"`{ev.lead}`" if ev.lead else "–", tables.fmt_diff(lead.auc if lead else None),
          fmt(lead.auc.p_value, 3) if lead else "–", _yes(ev.pays, "**yes**", "not shown"),
          (f"{tables.fmt_diff(auto.auc)} (best fixed `{ev.best_fixed}`)" if auto else "–"),
          _yes(ev.auto_short, "**yes**", "not shown")]


def _intro(sweep: dict, study: Study) -> list[str]:
  span = _span
  ks = ", ".join(f"{g} {k}" for g, k in study.n_buffers.items())
  counts = {g.name: [len(rs) for rs in g.runs.values() if rs] for g in study.regimes}
  per = ", ".join(f"{k} {span(v)}" for k, v in counts.items())
  pending = [f"`{n}` ({k})" for g in study.regimes for n, k in g.pending.items()]
  left = (f" Not yet in the evidence (fewer than 2 of the file's {len(sweep['seeds'])} "
          f"seeds run): {', '.join(pending)}." if pending else "")
  return [
      f"Sweep `configs/sweep/where_replay_pays.py` ({len(study.regimes)} regimes × "
      f"{span([n for v in counts.values() for n in v])} seeds; seeds per configuration: "
      f"{per}; per regime on-policy, fixed FIFO buffers and the "
      f"self-tuning buffer at one generation budget).{left} Every comparison is paired by seed "
      "(a seed's runs share its warm start): per seed, configuration minus reference, then "
      "the mean over seeds with its 95% Student t interval (and the seed bootstrap's, "
      "`scipy.stats.bootstrap`, which covers well below its nominal rate with few seeds, "
      "tests/test_study_stats.py: never used alone). **AUC**: the mean held-out sampled "
      f"accuracy over the log-token axis from {stats.LO_FRAC:g} of on-policy's generated "
      "tokens to all of them, each run's evaluations interpolated linearly. **Accuracy at "
      "25/50/100%** of that budget: from each curve averaged over each evaluation and its "
      "neighbours. **Tokens to its smoothed final**: tokens at which "
      "a smoothed curve first reaches the reference's smoothed accuracy at the budget, over "
      "the reference's own; median over seeds [seed bootstrap]. P(improvement): the share of "
      "seeds on which the configuration is ahead.",
      "",
      f"Decisions (rules and their simulated false-positive rates below): **replay pays** "
      f"when one of the regime's k buffers ({ks}) has an AUC above on-policy's by a one-sided "
      f"paired t test at 5%/k; **self-tuning falls short** when its AUC is below the best "
      "fixed configuration's (highest mean AUC, on-policy included) by the same test at "
      "5%/k, k the fixed configurations it is chosen from. μ, α, ρ: median [IQR] over the "
      "self-tuning runs' seeds (μ (FLOPs) from the ledger's FLOP counts, a property of the "
      "run; μ (time) from steady-state phase times at the R the controller ran, which moves "
      "with the machine's load; \"μ (time) on-policy\": the same at R = B; α, ρ from "
      "`rl.noise`, ρ clipped to [0, 1] and α to ≥ 0 before the theory); theory: "
      "`theory.power_law_design_bounded` within the sweep's bounds at the median constants "
      "with μ (FLOPs), and its y* at each seed's own.",
      ""]


def _comparisons(g: Regime) -> list:
  """Every configuration against on-policy, then, when the best fixed configuration is a
  buffer, the others against it (on-policy against it is a row above, negated)."""
  ev = g.evidence
  out = [c for c in ev.vs_reference.values() if c is not None]
  if ev.best_fixed != g.reference:
    out += [c for n, c in ev.vs_best.items() if c is not None and n != g.reference]
  return out


def resolve_repo_path(path: str) -> str:
  """``path`` as given when it exists, else relative to the repository root."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return path if os.path.exists(path) or os.path.isabs(path) else os.path.join(root, path)


def eval_noise_sentence(path: str | None, jitter: float) -> str:
  """What ``bench/eval_noise.py`` measured at fixed parameters (its JSON at ``path``), beside
  the noise model's jitter; "" when the file is absent.

  Raises:
    ValueError: a file without the bench's fields.
  """
  if not path or not os.path.exists(path):
    return ""
  import json
  with open(path) as f:
    e = json.load(f)
  try:
    base, final = e["base"], e["final"]
    fmt = tables.fmt
    return (f"Measured at fixed parameters (`bench/eval_noise.py`, `{e['run']}` seed "
            f"{e['seed']}, {e['keys']} keys, {e['examples']} examples × "
            f"{e['samples_per_example']} samples, {e['provenance']['date']}): one evaluation's "
            f"sampled accuracy has SD {fmt(base['sd_acc_sampled'])} at the warm start and "
            f"{fmt(final['sd_acc_sampled'])} at step {final['step']} (greedy: "
            f"{fmt(final['sd_acc_greedy'])}, deterministic); of the jitter {fmt(jitter)} the "
            "rest is the policy moving between evaluations. The study averages each "
            "evaluation with its neighbours (the smoothed curves) rather than evaluating an "
            "exponential moving average of the weights: the average damps both parts and "
            "scores the policies the runs generated with, where an average of weights would "
            "score a policy no run sampled from.")
  except (KeyError, TypeError) as err:
    raise ValueError(f"report.eval_noise {path}: not a bench/eval_noise.py result "
                     f"(missing {err})") from None


def _noise_lines(study: Study, eval_noise: str | None = None) -> list[str]:
  m, fmt = study.noise, tables.fmt
  names = [g.name for g in study.regimes]
  measured = eval_noise_sentence(eval_noise, m.jitter)
  return [
      "### Decision rules under the runs' own noise", "",
      f"Noise model fitted to the runs (`study.null.fit_noise`): one evaluation jitters by "
      f"{fmt(m.jitter)} around its run's curve ({m.n_jitter} second differences), a seed's "
      f"offset shared by its configurations has SD {fmt(m.seed)} and a run's own offset "
      f"{fmt(m.run)} (analysis of variance of the runs' AUC, {m.df_seed} and {m.df_run} "
      f"degrees of freedom). One seed's AUC difference between two runs then has SD "
      f"{fmt(study.sd_d)}. Each rule is simulated {study.n_sims} times (a rate near 5% has "
      f"simulation SE {fmt(math.sqrt(0.05 * 0.95 / study.n_sims), 4)}) on curves drawn from "
      "this model with each regime's seeds and buffers ("
      + ", ".join(f"{g}: {study.n_seeds[g]} seeds, {study.n_buffers[g]} buffers"
                  for g in study.n_seeds) + "), "
      f"evaluations every 1/{len(null.EVAL_GRID) - 1} of the budget and each regime's "
      "on-policy mean curve (its saturating fit): "
      "all curves equal (false-positive rate; the best of the buffers is what each rule "
      f"reads), and one buffer reaching every accuracy with {1 - null.SAVING:.0%} of the "
      "tokens (power). A rule is kept only with a false-positive rate ≤ 5%.", ""] + \
      ([measured, ""] if measured else []) + \
      tables.table(tables.RULE_HEADER, tables.rule_rows(study.rates, names)) + [""]


def render_map(sweep: dict, study: Study, figure: str | None) -> list[str]:
  """The "Where replay pays" section, markers included (markdown lines)."""
  gs = study.regimes
  L = [MAP_NOTE, "", "## Where replay pays", ""] + _intro(sweep, study)
  L += [f"**{summary_sentences(study)}**", ""]
  L += tables.table(list(REGIME_COLUMNS), [_regime_row(g) for g in gs]) + [""]
  if any(g.evidence.auto_short for g in gs):  # the sweep file's ``why`` quotes the old rule
    L += ["Why the self-tuning buffer misses: [measurements]"
          "(replay-study.md#why-the-self-tuning-buffer-misses).", ""]
  L += ["### Every configuration against on-policy and against the best fixed", "",
        "Differences in held-out sampled accuracy (configuration − reference), mean over "
        "seeds [95% t interval]; the last column is a ratio of tokens (below 1: fewer).", ""]
  rows = [tables.comparison_row(g.name, c) for g in gs for c in _comparisons(g)]
  L += tables.table(tables.COMPARISON_HEADER, rows) + [""]
  en = (sweep.get("report") or {}).get("eval_noise")
  L += _noise_lines(study, resolve_repo_path(en) if en else None)
  L += ["### Saturating fits", "",
        "R(C) = R0 + (A − R0)/(1 + (C_mid/C)^B) (ScaleRL, Khatri et al. 2025) fitted by "
        "`scipy.optimize.curve_fit` to a configuration's pooled evaluations, C = generated "
        "tokens / on-policy's budget, R0 the mean warm-start accuracy; intervals: "
        f"{evidence.FIT_BOOT} seed bootstrap resamples. A is reported only where the fit "
        "identifies it (C_mid within the runs in ≥ 97.5% of the resamples and A, B off their "
        "bounds); elsewhere compare B and C_mid.", ""]
  L += tables.table(tables.FIT_HEADER, [tables.fit_row(g.name, n, f) for g in gs
                                        for n, f in g.evidence.fits.items()]) + [""]
  L += _y_star_lines(gs)
  L += _controller_lines(gs)
  if figure:
    L += [f"![Held-out sampled accuracy against generated tokens, per regime]({figure})", ""]
  return L + [MAP_END]


def _y_star_lines(gs: list[Regime]) -> list[str]:
  checks = [c for g in gs for c in g.checks]
  if not checks:
    return []
  mus = sorted({c.mu for c in checks})
  return [
      "### The theory's y*(μ) against the runs re-scored on compute", "",
      "The same runs on the theory's compute axis C = K_train + μ·K_inf (trained samples plus "
      "μ × generated rollouts, its (B + μR)·T) at μ ∈ {" + ", ".join(tables.fmt(m, 1)
                                                                        for m in mus) + "}: "
      "AUC over log C up to on-policy's C, among on-policy and the fixed buffers (self-tuning "
      "changes y as it runs). Best y: the highest mean AUC; y's not shown worse: those whose "
      "AUC is not below the best's by a one-sided paired t test at 5%/(n − 1). Agree: the "
      "theory's y*(μ), at the regime's α and ρ and rounded to the nearest y run, is among "
      "them while the runs exclude some y (when they exclude none, they cannot tell). "
      "Registered: the nearest y the sweep file predicted before the runs of its y grid "
      "(`report.y_star_test`, at the constants measured earlier); now: the theory at the "
      "constants this page's self-tuning runs measured, found after the runs.", ""] + \
      tables.table(tables.Y_STAR_HEADER, [tables.y_star_row(g.name, c) for g in gs
                                          for c in g.checks]) + [""] + _rises_lines(gs)


def _rises_lines(gs: list[Regime]) -> list[str]:
  """Per regime with a registered test: the best y per μ and whether it never falls."""
  out = []
  for g in gs:
    if not any(c.registered for c in g.checks):
      continue
    seq = ", ".join(f"{tables.fmt(c.best_y, 0)} at μ = {tables.fmt(c.mu, 1)}"
                    for c in sorted(g.checks, key=lambda c: c.mu))
    rises = evidence.best_y_rises(g.checks)
    out.append(f"- {g.name}: best y {seq}: "
               + ("never falls as μ grows, as the theory says" if rises else
                  "falls as μ grows somewhere, against the theory") + ".")
  return out + [""] if out else []


def _controller_lines(gs: list[Regime]) -> list[str]:
  fq = tables.fmt_q
  rows = []
  for g in gs:
    k = g.controller()
    if not k["R"]:
      continue
    share = [e / w if w else float("nan") for e, w in zip(k["estimate_s"], k["wall_s"])]
    src = ", ".join(f"{m} ({k['mu_source'].count(m)})" for m in sorted(set(k["mu_source"])))
    rows.append([g.name, fq(k["R"], 0), fq(k["y"], 2), fq(k["x"], 1), fq(k["changes"], 0),
                 fq(k["estimate_s"], 0), fq(share, 2), src])
  if not rows:
    return []
  return ["The self-tuning runs' last setting (median [IQR] over seeds) and how often the "
          "controller changed it:", ""] + tables.table(
              ["regime", "R (rollouts per step)", "y = B/R", "x (steps kept)", "changes",
               "estimating (s)", "estimating, share of the run's phases",
               "μ the controller steered by (seeds)"], rows) + [""]


def splice_map(text: str, block: Sequence[str], footer: str | None = None) -> str:
  """``text`` (a results page) with its map section replaced by ``block``, or ``block``
  inserted before the page's first ``## `` heading when it has none (at the end when it
  has no heading); the page then ends with ``footer`` (a ``FOOTER`` line), or with the
  footer ``text`` had."""
  lines = text.splitlines()
  old = [ln for ln in lines if FOOTER.match(ln)]
  lines = [ln for ln in lines if not FOOTER.match(ln)]
  start = next((i for i, ln in enumerate(lines) if ln.startswith(MAP_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == MAP_END), None)
  if start is not None and end is not None and end >= start:
    lines = lines[:start] + list(block) + lines[end + 1:]
  else:
    at = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), len(lines))
    lines = lines[:at] + list(block) + [""] + lines[at:]
  out = "\n".join(lines).rstrip() + "\n"
  foot = footer or (old[-1] if old else None)
  return out + f"\n{foot}\n" if foot else out


def map_block(text: str) -> list[str]:
  """The map section of a results page, markers included ([] when it has none)."""
  lines = text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith(MAP_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == MAP_END), None)
  if start is None or end is None or end < start:
    return []
  return lines[start:end + 1]


def map_footer(text: str) -> str | None:
  """The page's ``FOOTER`` line, or None."""
  return next((ln for ln in reversed(text.splitlines()) if FOOTER.match(ln)), None)


def write_map(sweep: dict, workdir: str, md_path: str) -> list[str]:
  """Computes the map from the sweep's runs and splices it into ``md_path`` (created when
  absent), the page ending with the study's line; the figure goes to
  ``<md_path without .md>/where_replay_pays.png``. ``report.null_sims`` (default 4000) sets
  the simulated studies per rule and rate.

  Returns:
    [md_path, figure path].

  Raises:
    ValueError: a configuration without ``regime`` / ``role`` (``regimes_of``), no regime
      with on-policy runs or fewer than 2 seeds (``study_of``).
  """
  runs, _ = load_runs(sweep, workdir)
  sims = int((sweep.get("report") or {}).get("null_sims", 4000))
  study = study_of(regimes_of(sweep, runs), n_sims=sims)
  fig_dir = os.path.splitext(md_path)[0]
  os.makedirs(fig_dir, exist_ok=True)
  fig = os.path.join(fig_dir, "where_replay_pays.png")
  figures.plot_regimes([(g.name, g.configs, g.runs, _final_mean(g)) for g in study.regimes],
                       fig)
  block = render_map(sweep, study, os.path.relpath(fig, os.path.dirname(md_path)))
  try:
    with open(md_path) as f:
      old = f.read()
  except OSError:
    old = f"# {(sweep.get('report') or {}).get('title', 'Where replay pays')}\n"
  tables.write_lines(md_path, splice_map(old, block, study.line()).splitlines())
  print(study.line())
  return [md_path, fig]


def _final_mean(g: Regime) -> float | None:
  """On-policy's smoothed accuracy at its budget, mean over seeds (the figure's line)."""
  rs = g.runs.get(g.reference) or []
  v = [float(stats.smooth(r.curve()[1])[-1]) for r in rs]
  return float(np.mean(v)) if v else None


def noise_sd(sweep: dict, runs: dict) -> float:
  """SD of the AUC difference of two runs of one seed under the noise model fitted to the
  sweep's runs (a regime-map sweep, ``report.kind == "regime_map"``), else NaN."""
  if (sweep.get("report") or {}).get("kind") != "regime_map":
    return float("nan")
  regimes = [g for g in regimes_of(sweep, runs) if g.evidence is not None]
  if not regimes:
    return float("nan")
  sd = null.auc_difference_sd(noise_of(regimes))
  return sd if math.isfinite(sd) else float("nan")

