"""The sweep's report: ``docs/results.md`` and its figures, from the runs' metrics alone.

Reads, for each run of a sweep (``jaxreplay.sweep``), its metrics (through
``jaxreplay.train.metrics.read_metrics``) and ``config.json`` (batch size B, rollouts per
step R, capacity N, mode). Every number in the report is computed here; the only text
written by hand is the fixed explanation below each heading.

Definitions (also printed in the report):
  * Statistics over seeds are the median and the interquartile range [q25, q75] (linear
    interpolation, ``numpy.percentile``'s default).
  * Final accuracy of a run: the mean of its last K evaluations (``report.target_last``,
    default 1: the last one), so that one evaluation's noise does not set it; with K > 1 it
    is the run's plateau level when the run has one.
  * Target accuracy: the median, over the reference (on-policy) configuration's seeds, of
    its final held-out sampled accuracy.
  * Plateau check of the reference: its final accuracy minus the mean of the K evaluations
    before its last K (median [IQR] over seeds); near zero when the reference has stopped
    improving, clearly positive when its budget cut it off while still rising.
  * Tokens to reach the target: the generated tokens at the first evaluation (step 0
    included) whose sampled accuracy is >= the target, no interpolation between evaluations;
    +inf when no evaluation reaches it. A configuration's "% of on-policy" is each seed's
    tokens over the median of the reference seeds' tokens to reach, then the median over
    seeds with not-reached seeds counted as +inf: the median is finite only when more than
    half of the seeds reached the target, and the table says how many did ("k/n").
  * Compute on the paper's axis: learner steps × per-update cost γ = (1 + W/T)/(1 + μ) with
    the emulated W/T = μ/ρ (``jaxreplay.train.accounting.gamma``; ρ the run's replay ratio so
    far), scaled by B / B_reference, so the on-policy reference costs 1 per update. Once with
    the μ measured in this sweep (median over runs of the steady-state time ratio) and once
    with the paper's μ.
  * Claim verdicts: a comparison of a per-run metric between configurations A and B is
    "supported" when A's interquartile range lies entirely on the side the claim predicts
    of B's (the two ranges do not overlap), "contradicted" when it lies entirely on the
    other side, and "cannot tell" when the ranges overlap (a difference within the seeds'
    spread) or runs are missing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from typing import Any, Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay import storage, theory  # noqa: E402
from jaxreplay.train import accounting  # noqa: E402
from jaxreplay.train.metrics import read_metrics  # noqa: E402

PAPER_MU = 5.3
INF = float("inf")


# --- statistics ---------------------------------------------------------------------------

def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
  """(q25, median, q75) of ``values`` with linear interpolation; +inf allowed.

  Interpolating towards +inf gives +inf (so the median of [1, inf, inf] is inf and of
  [1, 2, inf] is 2). NaNs are dropped. Empty input: three NaNs.
  """
  v = sorted(float(x) for x in values if not (isinstance(x, float) and math.isnan(x)))
  if not v:
    return (float("nan"),) * 3

  def q(p):
    pos = p * (len(v) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    if lo == hi or v[lo] == v[hi]:
      return v[lo]
    if math.isinf(v[hi]):
      return INF
    return v[lo] + (pos - lo) * (v[hi] - v[lo])

  return q(0.25), q(0.5), q(0.75)


def verdict(a: Sequence[float], b: Sequence[float], expect: str) -> str:
  """The claim rule: ``expect`` "higher" (A > B) or "lower" (A < B) judged on the IQRs.

  Returns:
    "supported" when A's [q25, q75] lies strictly on the expected side of B's,
    "contradicted" when strictly on the other side, else "cannot tell" (also when either
    side has no finite or infinite value).

  Raises:
    ValueError: ``expect`` not in ("higher", "lower").
  """
  if expect not in ("higher", "lower"):
    raise ValueError(f"expect={expect!r} must be 'higher' or 'lower'")
  qa, qb = quantiles(a), quantiles(b)
  if any(math.isnan(x) for x in qa + qb):
    return "cannot tell"
  above, below = qa[0] > qb[2], qa[2] < qb[0]
  if expect == "lower":
    above, below = below, above
  return "supported" if above else "contradicted" if below else "cannot tell"


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


# --- one run ------------------------------------------------------------------------------

class RunData:
  """A run's evaluation points and ledger, read from its directory.

  Attributes:
    name, family, seed: from the sweep. records: ``read_metrics`` output.
    config: ``config.json`` as a dict ({} when absent).
    evals: records with ``eval/acc_sampled``, in step order; the step-0 record gets
      ``generated_tokens``, ``trained_samples`` and ``generated_rollouts`` of 0.
    steps: the last learner step recorded.
  """

  def __init__(self, run_dir: str, name: str, family: str, seed: int):
    self.dir, self.name, self.family, self.seed = run_dir, name, family, seed
    self.records = read_metrics(run_dir)
    try:
      self.config = json.loads(storage.read_text(os.path.join(run_dir, "config.json")))
    except (OSError, ValueError):
      self.config = {}
    for r in self.records:
      if r.get("step") == 0:
        for k in ("generated_tokens", "trained_samples", "generated_rollouts"):
          r.setdefault(k, 0)
    self.evals = [r for r in self.records if "eval/acc_sampled" in r]
    step_recs = [r for r in self.records if "trained_samples" in r and r.get("step", 0) > 0]
    self.steps = step_recs[-1]["step"] if step_recs else 0
    self.last = step_recs[-1] if step_recs else {}
    self.first = step_recs[0] if step_recs else {}

  def cfg(self, path: str, default=None):
    node: Any = self.config
    for p in path.split("."):
      if not isinstance(node, dict) or p not in node:
        return default
      node = node[p]
    return node

  @property
  def batch_size(self) -> int:
    return int(self.cfg("train.batch_size", 0) or 0)

  def nominal(self) -> dict:
    """N, R, B, x = N/R, y = B/R, mode (from config.json; NaN where missing)."""
    n, r, b = (self.cfg("buffer.capacity"), self.cfg("rollout.per_step"),
               self.cfg("train.batch_size"))
    mode = self.cfg("train.mode", "?")
    if mode == "simulated_async":
      mode = f"simulated_async lag {self.cfg('train.lag')}"
    ok = all(isinstance(v, (int, float)) and v for v in (n, r, b))
    return {"N": n, "R": r, "B": b, "x": n / r if ok else float("nan"),
            "y": b / r if ok else float("nan"), "mode": mode}

  # --- ledger -----------------------------------------------------------------------------
  def replay_ratio(self, rec: dict | None = None) -> float:
    rec = self.last if rec is None else rec
    g = rec.get("generated_rollouts", 0)
    return rec.get("trained_samples", 0) / g if g else float("nan")

  def mu_time(self) -> float:
    """Steady-state μ from phase times: the first step (compilation) left out."""
    a, b = self.first, self.last
    if not a or not b or b is a or "generate_s" not in b:
      return float("nan")
    return accounting.mu(b["generate_s"] - a["generate_s"],
                         b["generated_rollouts"] - a["generated_rollouts"],
                         b["train_s"] - a["train_s"], b["trained_samples"] - a["trained_samples"])

  def mu_flops(self) -> float:
    b = self.last
    if "generation_flops" not in b or "training_flops" not in b:
      return float("nan")
    return accounting.mu(b["generation_flops"], b["generated_rollouts"], b["training_flops"],
                         b["trained_samples"])

  def staleness_mean(self) -> float:
    """Mean staleness of trained samples over the run: per-step batch means averaged
    (every step trains on B samples), else from the summed ``staleness_hist`` (its last
    bin is a tail and counts at its index)."""
    means = [r["staleness_mean"] for r in self.records if "staleness_mean" in r]
    if means:
      return float(np.mean(means))
    hist = [r["staleness_hist"] for r in self.records if "staleness_hist" in r]
    if not hist:
      return float("nan")
    h = np.sum(np.array(hist, dtype=float), 0)
    return float((h * np.arange(len(h))).sum() / max(h.sum(), 1))

  def compute(self, rec: dict, mu: float, ref_batch: int) -> float:
    """Compute spent by ``rec``'s step on the paper's axis, in on-policy updates of the
    reference batch size: step × γ(μ, ρ so far) × B / B_ref."""
    step = rec.get("step", 0)
    if step == 0:
      return 0.0
    g = accounting.gamma(mu, self.replay_ratio(rec))
    return step * g * (self.batch_size or ref_batch) / ref_batch

  # --- accuracy ---------------------------------------------------------------------------
  def series(self, x: str | Callable[[dict], float], y: str) -> np.ndarray:
    """[n, 2] (x, y) over evaluations; x a record key or a function of the record."""
    f = (lambda r: r.get(x)) if isinstance(x, str) else x
    pts = [(f(r), r.get(y)) for r in self.evals]
    return np.array([p for p in pts if p[0] is not None and p[1] is not None],
                    float).reshape(-1, 2)

  def first_reach(self, target: float, x: str | Callable[[dict], float]) -> float:
    """x at the first evaluation with sampled accuracy >= ``target``; +inf if none."""
    for xv, yv in self.series(x, "eval/acc_sampled"):
      if yv >= target:
        return float(xv)
    return INF

  def at_budget(self, budget: float, x: str | Callable[[dict], float],
                y: str = "eval/acc_sampled") -> float:
    """y at the last evaluation whose x <= ``budget`` (NaN when none)."""
    s = self.series(x, y)
    s = s[s[:, 0] <= budget + 1e-9]
    return float(s[-1, 1]) if len(s) else float("nan")

  def largest_k(self) -> int | None:
    ks = [int(k.split("@")[1]) for k in (self.evals[-1] if self.evals else {})
          if k.startswith("eval/pass@")]
    return max(ks) if ks else None


# --- the sweep's runs ---------------------------------------------------------------------

def load_runs(sweep: dict, workdir: str) -> tuple[dict[str, list[RunData]], list[str]]:
  """{configuration: [RunData per seed present]} and the list of missing runs."""
  runs, missing = {}, []
  for c in sweep["configurations"]:
    runs[c["name"]] = []
    for seed in sweep["seeds"]:
      d = os.path.join(workdir, c["name"], f"seed{seed}")
      try:
        rd = RunData(d, c["name"], c.get("family", c["name"]), seed)
      except FileNotFoundError:
        missing.append(f"{c['name']}/seed{seed}")
        continue
      if not rd.evals:
        missing.append(f"{c['name']}/seed{seed} (no evaluation yet)")
        continue
      runs[c["name"]].append(rd)
  return runs, missing


def sweep_mu(runs: dict[str, list[RunData]]) -> dict[str, float]:
  """The measured μ of the sweep: medians over all runs (time: steady state; FLOPs)."""
  allr = [r for rs in runs.values() for r in rs]
  mt = [r.mu_time() for r in allr if r.cfg("train.mode") != "async"]
  return {"time": quantiles([m for m in mt if m == m])[1],
          "flops": quantiles([r.mu_flops() for r in allr])[1]}


class Analysis:
  """Per-run metrics of a sweep relative to its reference configuration.

  Args:
    runs: ``load_runs`` output. reference: name of the on-policy configuration.
    mu_measured: μ for the measured compute axis. mu_paper: the paper's μ.
  """

  def __init__(self, runs: dict[str, list[RunData]], reference: str, mu_measured: float,
               mu_paper: float = PAPER_MU, target_last: int = 1):
    if reference not in runs:
      raise ValueError(f"report.reference={reference!r} is not a configuration "
                       f"({', '.join(runs)})")
    if not (isinstance(target_last, int) and target_last >= 1):
      raise ValueError(f"report.target_last={target_last!r} must be an integer >= 1 (the "
                       "number of last evaluations averaged into a run's final accuracy)")
    self.runs, self.reference, self.k_last = runs, reference, target_last
    self.mus = {"measured": mu_measured, "paper": mu_paper}
    ref = runs[reference]
    self.ref_batch = (ref[0].batch_size if ref else 0) or 1
    self.target = quantiles([self.metric(r, "final_sampled") for r in ref])[1]
    self.plateau = [self.metric(r, "final_minus_previous") for r in ref]
    self.ref_steps = quantiles([r.steps for r in ref])[1]
    self.ref_tokens = quantiles([r.evals[-1].get("generated_tokens", 0) for r in ref])[1]
    self.ref_reach = {"tokens": quantiles([r.first_reach(self.target, "generated_tokens")
                                           for r in ref])[1]}
    self.ref_compute = {}
    for tag in self.mus:
      f = self.compute_fn(tag)
      self.ref_reach[tag] = quantiles([r.first_reach(self.target, f(r)) for r in ref])[1]
      self.ref_compute[tag] = quantiles([f(r)(r.evals[-1]) for r in ref])[1]

  def compute_fn(self, tag: str):
    mu = self.mus[tag]
    return lambda run: (lambda rec: run.compute(rec, mu, self.ref_batch))

  def metric(self, run: RunData, name: str) -> float:
    """One named per-run metric (see ``METRICS``).

    Raises:
      KeyError: ``name`` is not in ``METRICS``.
    """
    if name not in _METRIC_FNS:
      raise KeyError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
    return _METRIC_FNS[name](self, run)

  # --- the metrics, each a function of (analysis, run) -----------------------------------

  def _sampled(self, run: RunData) -> list[float]:
    return [r["eval/acc_sampled"] for r in run.evals]

  def _greedy(self, run: RunData) -> list[float]:
    return [r.get("eval/acc_greedy", float("nan")) for r in run.evals]

  def _final_minus_previous(self, run: RunData) -> float:
    s, k = self._sampled(run), self.k_last
    if len(s) < 2 * k:
      return float("nan")
    return float(np.mean(s[-k:]) - np.mean(s[-2 * k:-k]))

  def _peak_greedy(self, run: RunData) -> float:
    measured = [x for x in self._greedy(run) if not np.isnan(x)]  # runs without greedy eval
    return float(max(measured)) if measured else float("nan")

  def _passk_final(self, run: RunData) -> float:
    k = run.largest_k()
    return run.evals[-1].get(f"eval/pass@{k}", float("nan")) if k else float("nan")

  def _gamma(self, run: RunData, mu: float) -> float:
    return accounting.gamma(mu, run.replay_ratio()) if mu == mu else float("nan")

  def _compute_to_target_pct(self, run: RunData, tag: str) -> float:
    return _pct(run.first_reach(self.target, self.compute_fn(tag)(run)), self.ref_reach[tag])

  def _sampled_at_ref_compute(self, run: RunData, tag: str) -> float:
    return run.at_budget(self.ref_compute[tag], self.compute_fn(tag)(run))

  def values(self, config: str, name: str) -> list[float]:
    return [self.metric(r, name) for r in self.runs.get(config, [])]


def _pct(x: float, ref: float) -> float:
  """100·x/ref; NaN when the reference reached the target at no cost (its final accuracy
  is no better than the start, so "% of on-policy" means nothing) or never."""
  if not ref > 0 or math.isinf(ref):
    return float("nan")
  return 100.0 * x / ref


METRICS = {
    "final_sampled": "final held-out sampled accuracy (mean of the last K evaluations)",
    "final_greedy": "final held-out greedy accuracy (mean of the last K evaluations)",
    "final_minus_previous": "final sampled accuracy − mean of the K evaluations before",
    "peak_sampled": "peak held-out sampled accuracy",
    "peak_greedy": "peak held-out greedy accuracy",
    "peak_step": "learner step of the sampled-accuracy peak",
    "drop_sampled": "peak − final sampled accuracy (late collapse)",
    "passk_final": "final pass@k at the largest k",
    "pass1_final": "final pass@1",
    "passk_minus_pass1": "final pass@k (largest k) − pass@1",
    "entropy_final": "final fresh-sample entropy (nats/token)",
    "replay_ratio": "replay ratio K_train/K_inf",
    "staleness_mean": "mean staleness of trained samples (versions)",
    "mu_time": "μ from phase times (steady state)",
    "mu_flops": "μ from FLOP estimates",
    "gamma_time": "γ at the run's μ_time",
    "gamma_flops": "γ at the run's μ_flops",
    "tokens_to_target_pct": "generated tokens to reach the target, % of on-policy",
    "compute_to_target_pct_measured": "compute (measured μ) to reach the target, % of on-policy",
    "compute_to_target_pct_paper": "compute (paper's μ) to reach the target, % of on-policy",
    "sampled_at_ref_steps": "sampled accuracy at on-policy's last learner step",
    "sampled_at_ref_tokens": "sampled accuracy at on-policy's generated tokens",
    "sampled_at_ref_compute_measured": "sampled accuracy at on-policy's compute (measured μ)",
    "sampled_at_ref_compute_paper": "sampled accuracy at on-policy's compute (paper's μ)",
    "sampled_at_half": "sampled accuracy at half the run's learner steps",
}

_METRIC_FNS: dict[str, Callable[[Analysis, RunData], float]] = {
    "final_sampled": lambda an, r: float(np.mean(an._sampled(r)[-an.k_last:])),
    "final_greedy": lambda an, r: float(np.mean(an._greedy(r)[-an.k_last:])),
    "final_minus_previous": Analysis._final_minus_previous,
    "peak_sampled": lambda an, r: max(an._sampled(r)),
    "peak_greedy": Analysis._peak_greedy,
    "peak_step": lambda an, r: float(r.evals[int(np.argmax(an._sampled(r)))]["step"]),
    "drop_sampled": lambda an, r: max(an._sampled(r)) - an.metric(r, "final_sampled"),
    "passk_final": Analysis._passk_final,
    "pass1_final": lambda an, r: r.evals[-1].get("eval/pass@1", an._sampled(r)[-1]),
    "passk_minus_pass1": lambda an, r: an.metric(r, "passk_final") - an.metric(r, "pass1_final"),
    "entropy_final": lambda an, r: r.evals[-1].get("eval/entropy_fresh", float("nan")),
    "replay_ratio": lambda an, r: r.replay_ratio(),
    "staleness_mean": lambda an, r: r.staleness_mean(),
    "mu_time": lambda an, r: r.mu_time(),
    "mu_flops": lambda an, r: r.mu_flops(),
    "gamma_time": lambda an, r: an._gamma(r, r.mu_time()),
    "gamma_flops": lambda an, r: an._gamma(r, r.mu_flops()),
    "tokens_to_target_pct": lambda an, r: _pct(r.first_reach(an.target, "generated_tokens"),
                                               an.ref_reach["tokens"]),
    "compute_to_target_pct_measured": lambda an, r: an._compute_to_target_pct(r, "measured"),
    "compute_to_target_pct_paper": lambda an, r: an._compute_to_target_pct(r, "paper"),
    "sampled_at_ref_steps": lambda an, r: r.at_budget(an.ref_steps, "step"),
    "sampled_at_ref_tokens": lambda an, r: r.at_budget(an.ref_tokens, "generated_tokens"),
    "sampled_at_ref_compute_measured": lambda an, r: an._sampled_at_ref_compute(r, "measured"),
    "sampled_at_ref_compute_paper": lambda an, r: an._sampled_at_ref_compute(r, "paper"),
    "sampled_at_half": lambda an, r: r.at_budget(r.steps / 2, "step"),
}
assert set(_METRIC_FNS) == set(METRICS)


# --- claims -------------------------------------------------------------------------------

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


# --- figures ------------------------------------------------------------------------------

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


def _styles(configs: list[dict]) -> dict[str, tuple]:
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
  styles = _styles(configs)
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
  drawn = 0
  for ax, (title, x, y, xlabel) in zip(axes[0], panels):
    for c in configs:
      rs = an.runs.get(c["name"], [])
      if not rs:
        continue
      drawn += plot_band(ax, rs, x, y, styles[c["name"]], f"{c['name']} ({len(rs)})")
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


# --- the report ---------------------------------------------------------------------------

def _git_commit(outputs: Sequence[str] = ()) -> str:
  """The repository's short HEAD, marked when tracked files other than ``outputs`` (the
  report's own files, rewritten by every regeneration) differ from it."""
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10)
    status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10).stdout.splitlines()
    own = {os.path.relpath(os.path.abspath(p), root) for p in outputs}
    own_dirs = tuple(d.rstrip(os.sep) + os.sep for d in own)
    dirty = [ln for ln in status
             if ln[3:] not in own and not ln[3:].startswith(own_dirs)]
    if out.returncode or not out.stdout.strip():
      return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _shown_path(path: str) -> str:
  """``path`` relative to the working directory when it lies inside it, else absolute (a
  URL as it is)."""
  if storage.is_remote(path):
    return path
  rel = os.path.relpath(os.path.abspath(path))
  return path if rel.startswith(os.pardir) else rel


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
      ["| " + " | ".join(r) + " |" for r in rows]


def _wall_seconds(runs: dict[str, list[RunData]]) -> float:
  total = 0.0
  for rs in runs.values():
    for r in rs:
      try:
        summary = json.loads(storage.read_text(os.path.join(r.dir, "summary.json")))
        total += float(summary.get("wall_seconds", 0.0))
      except (OSError, ValueError):
        pass
  return total


def write_report(sweep: dict, workdir: str, command: str) -> list[str]:
  """Writes the results page and its figures; returns [results.md, figure paths...].

  Output: ``sweep['report']['results_md']`` (default ``WORKDIR/results.md``), figures in
  the folder of the same name without ``.md``; relative paths are relative to the working
  directory; on cloud storage (``gs://...``) the files are written locally, then uploaded
  one object each. Settings read from ``sweep['report']``: ``reference`` (default the first
  configuration), ``paper_mu`` (5.3), ``theory`` (list of dicts ``rho``, ``alpha``),
  ``claims`` (list of claim specs, see ``evaluate_claim``), ``title``, ``target_last`` (K,
  default 1: a run's final accuracy is the mean of its last K evaluations). With
  ``kind = "regime_map"`` the sweep is a regime map instead (``jaxreplay.regime_map``): its
  "Where replay pays" section is spliced into the page and the rest left as it is (its
  ``why``, a markdown string, is printed under the table when a self-tuning verdict is no);
  the single-regime report keeps that section when it rewrites the page.
  """
  rep = sweep.get("report", {}) or {}
  target = rep.get("results_md") or os.path.join(workdir, "results.md")
  if storage.is_remote(target):  # written locally, then each file uploaded whole
    with tempfile.TemporaryDirectory() as tmp:
      local = _write_any(sweep, workdir, command, os.path.join(tmp, os.path.basename(target)))
      urls = [target.rsplit("/", 1)[0] + "/" + os.path.relpath(p, tmp) for p in local]
      for p, url in zip(local, urls):
        storage.upload(p, url)
      return urls
  return _write_any(sweep, workdir, command, os.path.abspath(target))


def _write_any(sweep: dict, workdir: str, command: str, md_path: str) -> list[str]:
  """The regime map (``report.kind = "regime_map"``, ``jaxreplay.regime_map``: one section
  spliced into the page) or the single-regime report (the whole page)."""
  if (sweep.get("report") or {}).get("kind") == "regime_map":
    from jaxreplay import regime_map
    return regime_map.write_map(sweep, workdir, md_path)
  return _write_report(sweep, workdir, command, md_path)


def _write_report(sweep: dict, workdir: str, command: str, md_path: str) -> list[str]:
  """``write_report`` into the local file ``md_path`` (figures beside it)."""
  rep = sweep.get("report", {}) or {}
  fig_dir = os.path.splitext(md_path)[0]
  os.makedirs(fig_dir, exist_ok=True)
  configs = sweep["configurations"]
  reference = rep.get("reference", configs[0]["name"])
  runs, missing = load_runs(sweep, workdir)
  present = {k: v for k, v in runs.items() if v}
  L = _provenance(sweep, workdir, command, md_path, runs, missing)
  if not present.get(reference):
    L += ["", f"No run of the reference configuration `{reference}` yet: nothing to compare."]
    _write(md_path, L)
    return [md_path]
  k_last = int(rep.get("target_last", 1))
  mu = sweep_mu(present)
  paper_mu = float(rep.get("paper_mu", PAPER_MU))
  an = Analysis(present, reference, mu["time"], paper_mu, target_last=k_last)
  names = [c["name"] for c in configs if present.get(c["name"])]
  L += _target_lines(an, mu, paper_mu)
  figure_lines, paths = _figures(an, configs, mu, paper_mu, md_path, fig_dir)
  L += figure_lines
  L += _headline_lines(an, configs, names, mu, paper_mu)
  L += _accuracy_lines(an, names)
  L += _accounting_lines(an, names, mu, paper_mu)
  L += _claims_lines(an, rep.get("claims", []))
  L += _theory_lines(an, names, mu, paper_mu,
                     rep.get("theory", [dict(rho=0.1, alpha=0.25), dict(rho=0.1, alpha=0.1)]))
  _write(md_path, _keep_map(md_path, L))
  readme = readme_beside(md_path)
  if readme:
    write_readme_headline(readme, md_path)
  return [md_path] + paths


def _final_is(an: Analysis) -> str:
  if an.k_last == 1:
    return "its last evaluation"
  return f"the mean of its last {an.k_last} evaluations"


def _provenance(sweep: dict, workdir: str, command: str, md_path: str,
                runs: dict[str, list[RunData]], missing: list[str]) -> list[str]:
  """The page's title, how to regenerate it, and which runs it read."""
  rep = sweep.get("report", {}) or {}
  configs = sweep["configurations"]
  L = [f"# {rep.get('title', 'Sweep results')}", "",
       f"Regenerate: `{command}`", "",
       "*Generated by jaxreplay.sweep; do not edit by hand.* Every number below is computed "
       "by `jaxreplay/report.py` from the runs' metrics (`metrics/`) and `config.json`.", "",
       f"- runs: {sum(len(v) for v in runs.values())} present of "
       f"{len(configs) * len(sweep['seeds'])} ({len(configs)} configurations × seeds "
       f"{', '.join(map(str, sweep['seeds']))}); report code at commit "
       f"{_git_commit([md_path, os.path.splitext(md_path)[0]])}",
       f"- base config: `{sweep['base_config']}`; sweep directory: `{_shown_path(workdir)}`",
       f"- sum of the runs' wall time (summary.json): {_wall_seconds(runs) / 60:.1f} min"]
  if missing:
    L.append(f"- missing: {', '.join(missing)}")
  return L


def _target_lines(an: Analysis, mu: dict, paper_mu: float) -> list[str]:
  """μ, the target accuracy and the reference's plateau check."""
  return [f"- measured μ (median over runs): {fmt(mu['time'])} from phase times (steady state, "
          f"first step left out), {fmt(mu['flops'])} from FLOP estimates; the paper's μ: "
          f"{paper_mu}",
          f"- target: the reference `{an.reference}`'s final held-out sampled accuracy "
          f"({_final_is(an)}), median over its seeds = **{fmt(an.target)}** (reached at "
          f"{fmt(an.ref_reach['tokens'], 0)} generated tokens, median over its seeds)",
          f"- plateau check: the reference's final accuracy minus the mean of the {an.k_last} "
          f"evaluation(s) before = {fmt_q(an.plateau)} (median [IQR] over seeds; near 0: it has "
          "stopped improving, clearly positive: still rising when its budget ended)", ""]


def _figures(an: Analysis, configs: list[dict], mu: dict, paper_mu: float, md_path: str,
             fig_dir: str) -> tuple[list[str], list[str]]:
  """Draws the three accuracy figures into ``fig_dir``; returns (page lines, figure paths)."""
  tok = "generated_tokens"
  figs = [
      ("acc_vs_tokens.png", "Held-out accuracy against generated tokens",
       [("sampled (T = sampler's)", tok, "eval/acc_sampled", "generated tokens"),
        ("greedy", tok, "eval/acc_greedy", "generated tokens")]),
      ("acc_vs_steps.png", "Held-out accuracy against learner steps",
       [("sampled", "step", "eval/acc_sampled", "learner step"),
        ("greedy", "step", "eval/acc_greedy", "learner step")]),
      ("acc_vs_compute.png", "Held-out sampled accuracy against compute on the paper's axis",
       [(f"measured μ = {fmt(mu['time'], 2)}", lambda r, e: r.compute(e, an.mus["measured"],
                                                                       an.ref_batch),
         "eval/acc_sampled", "compute (on-policy updates)"),
        (f"paper's μ = {paper_mu}", lambda r, e: r.compute(e, paper_mu, an.ref_batch),
         "eval/acc_sampled", "compute (on-policy updates)")]),
  ]
  L = ["## Figures", "",
       "Median over seeds (line) and interquartile range (band), one line per "
       "configuration, one colour per family; the dotted line is the target.", ""]
  paths = []
  for name, title, panels in figs:
    p = os.path.join(fig_dir, name)
    plot_panels(an, configs, panels, p, an.target)
    paths.append(p)
    L += [f"**{title}**", "", f"![{title}]({os.path.relpath(p, os.path.dirname(md_path))})", ""]
  return L, paths


def _headline_lines(an: Analysis, configs: list[dict], names: list[str], mu: dict,
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
  return L + _table(["configuration", "family", "mode", "x = N/R", "y = B/R",
                     "tokens to target, % of on-policy", "reached",
                     f"compute to target, % (μ = {fmt(mu['time'], 2)})",
                     f"compute to target, % (μ = {paper_mu})"], rows) + [""]


def _accuracy_lines(an: Analysis, names: list[str]) -> list[str]:
  """Peak, final and equal-budget held-out accuracy per configuration."""
  k = an.runs[an.reference][0].largest_k()
  L = ["## Accuracy", "", "Median [IQR] over seeds. Peak: the best evaluation of a run; "
       f"final: {_final_is(an)}. Entropy: the fresh-sample entropy of the last evaluation.", ""]
  rows = [[f"`{n}`"] + [fmt_q(an.values(n, m)) for m in
                        ("peak_sampled", "final_sampled", "peak_greedy", "final_greedy",
                         "passk_final", "entropy_final", "sampled_at_ref_tokens",
                         "sampled_at_ref_steps")] for n in names]
  return L + _table(["configuration", "peak sampled", "final sampled", "peak greedy",
                     "final greedy", f"pass@{k}", "entropy (nats/token)",
                     "sampled at on-policy's tokens", "sampled at on-policy's steps"],
                    rows) + [""]


def _accounting_lines(an: Analysis, names: list[str], mu: dict, paper_mu: float) -> list[str]:
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
  return L + _table(["configuration", "μ (time)", "μ (FLOPs)", "γ (time)", "γ (FLOPs)",
                     "replay ratio", "mean staleness", f"γ at μ = {fmt(mu['time'], 2)}",
                     f"γ at μ = {paper_mu}",
                     f"sampled at on-policy's compute (μ = {fmt(mu['time'], 2)})",
                     f"sampled at on-policy's compute (μ = {paper_mu})"], rows) + [""]


def _claims_lines(an: Analysis, claims: list[dict]) -> list[str]:
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
  return L + _table(["#", "claim", "comparison", "numbers", "verdict"], rows) + [""]


def _theory_lines(an: Analysis, names: list[str], mu: dict, paper_mu: float,
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
  L += _table(["ρ", "α", f"(x*, y*) at μ = {fmt(mu['time'], 2)} (time)",
               f"(x*, y*) at μ = {fmt(mu['flops'], 2)} (FLOPs)",
               f"(x*, y*) at μ = {paper_mu}"], rows) + [""]
  best = _best(an, names)
  if best:
    n, crit = best
    v = an.runs[n][0].nominal()
    L += [f"Best configuration found: `{n}` (x = {fmt(v['x'], 2)}, y = "
          f"{fmt(v['y'], 2)}, {v['mode']}) — {crit}.", ""]
  return L


def _keep_map(md_path: str, lines: list[str]) -> list[str]:
  """``lines`` with the regime map's section of the page now at ``md_path`` (if any)
  spliced in before the first ``## `` heading: a regime-map sweep wrote it."""
  from jaxreplay import regime_map
  try:
    with open(md_path) as f:
      block = regime_map.map_block(f.read())
  except OSError:
    return lines
  if not block:
    return lines
  return regime_map.splice_map("\n".join(lines), block).splitlines()


def _best(an: Analysis, names: list[str]) -> tuple[str, str] | None:
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


def _write(path: str, lines: list[str]) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write("\n".join(lines).rstrip() + "\n")
  os.replace(tmp, path)


# --- the README's headline block ----------------------------------------------------------
#
# README.md states the sweep's result between two markers. The block is rendered from the
# results page itself (``headline_from_results`` parses it, ``render_headline`` writes the
# block), so the README and docs/results.md cannot disagree: the report step rewrites the
# block whenever it rewrites the page, ``python -m jaxreplay.report`` redoes just that, and
# tests/test_readme_headline.py fails when they differ.

HEADLINE_START = "<!-- headline:start"
HEADLINE_END = "<!-- headline:end -->"
HEADLINE_NOTE = ("<!-- headline:start (written by `python -m jaxreplay.report` from "
                 "docs/results.md; do not edit by hand) -->")


def _md_sections(text: str) -> dict[str, list[str]]:
  """The lines of each ``## heading`` section of a markdown page ("" = before the first)."""
  out: dict[str, list[str]] = {"": []}
  cur = ""
  for line in text.splitlines():
    if line.startswith("## "):
      cur = line[3:].strip()
      out[cur] = []
    else:
      out[cur].append(line)
  return out


def md_table(lines: Sequence[str]) -> list[dict[str, str]]:
  """The first markdown table in ``lines`` as one dict per row (header → cell text)."""
  rows = [ln for ln in lines if ln.startswith("|")]
  if len(rows) < 2:
    return []
  split = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
  header = split(rows[0])
  return [dict(zip(header, split(r))) for r in rows[2:]]


def _section(sections: dict[str, list[str]], prefix: str) -> list[str]:
  for name, lines in sections.items():
    if name.startswith(prefix):
      return lines
  raise ValueError(f"results page has no section '## {prefix}...'")


def headline_from_results(text: str) -> dict[str, Any]:
  """The numbers the README's headline states, read from a results page (docs/results.md).

  Returns:
    A dict: ``title``, ``runs``, ``configurations``, ``seeds`` (counts), ``wall_min``,
    ``mu_time``, ``paper_mu``, ``target``, ``reference``, ``rows`` (one dict per
    configuration of the headline table, its final sampled accuracy added as ``final``),
    ``best`` (the configuration the page names best) and ``map`` (``map_from_results``:
    the regime map, or None).

  Raises:
    ValueError: a page without the expected lines or tables.
  """
  import re
  sections = _md_sections(text)
  head = sections[""]
  title = next((ln[2:].strip() for ln in head if ln.startswith("# ")), "")
  joined = "\n".join(head)

  def grab(pattern: str) -> re.Match:
    m = re.search(pattern, joined)
    if not m:
      raise ValueError(f"results page: no line matching {pattern!r}")
    return m

  runs = grab(r"- runs: (\d+) present of \d+ \((\d+) configurations × seeds ([^)]*)\)")
  wall = grab(r"wall time \(summary\.json\): ([\d.]+) min")
  mu = grab(r"measured μ \(median over runs\): ([\d.]+) from phase times.*the paper's μ: ([\d.]+)")
  target = grab(r"target: the reference `([^`]+)`.*= \*\*([\d.]+)\*\*")
  headline = md_table(_section(sections, "Headline"))
  accuracy = {r["configuration"]: r for r in md_table(_section(sections, "Accuracy"))}
  tokens_col = "tokens to target, % of on-policy"
  compute_cols = [k for k in (headline[0] if headline else {}) if k.startswith("compute to target")]
  rows = []
  for r in headline:
    rows.append({"configuration": r["configuration"].strip("`"), "x": r["x = N/R"],
                 "y": r["y = B/R"], "tokens_pct": r[tokens_col], "reached": r["reached"],
                 "compute_pct": [r[c] for c in compute_cols],
                 "final": accuracy[r["configuration"]]["final sampled"]})
  best = re.search(r"Best configuration found: `([^`]+)`", text)
  return {"title": title, "runs": int(runs.group(1)), "configurations": int(runs.group(2)),
          "seeds": len(runs.group(3).split(",")), "wall_min": wall.group(1),
          "mu_time": mu.group(1), "paper_mu": mu.group(2), "reference": target.group(1),
          "target": target.group(2), "compute_cols": compute_cols, "rows": rows,
          "best": best.group(1) if best else "", "map": map_from_results(text)}


MAP_COLUMNS = ("regime", "μ", "μ on-policy", "α", "ρ", "theory's (x*, y*)", "sweep's best (x, y)",
               "best fixed: tokens, % of on-policy", "self-tuning: tokens, % of on-policy",
               "replay pays")


def map_from_results(text: str) -> dict[str, Any] | None:
  """The regime map's summary sentences, sweep line and table rows (``MAP_COLUMNS``) of a
  results page, or None when the page has no map (``jaxreplay.regime_map``)."""
  from jaxreplay import regime_map
  block = regime_map.map_block(text)
  if not block:
    return None
  summary = next((ln.strip("*") for ln in block if ln.startswith("**")), "")
  sweep_line = next((ln for ln in block if ln.startswith("Sweep `")), "")
  head = sweep_line.split(";")[0].removeprefix("Sweep ") + ")"  # "`file` (n regimes × k seeds)"
  table = []
  for ln in block:
    if ln.startswith("|"):
      table.append(ln)
    elif table:
      break
  rows = [{k: r[k] for k in MAP_COLUMNS} for r in md_table(table)]
  return {"summary": summary, "sweep": head, "rows": rows}


def _median_cell(cell: str) -> float:
  """The median of a "median [q25, q75]" cell as a float (+inf for "not reached")."""
  m = cell.split("[")[0].strip()
  return INF if m.startswith("not reached") else float(m)


def render_headline(h: dict[str, Any]) -> list[str]:
  """The README's headline block (markers included) for ``headline_from_results``'s dict.

  Rows: the reference and every configuration that reached the target in more than half
  of its seeds (a finite median); the others are named with how many seeds reached it.
  "Replay" configurations are those with x = N/R > 1. When the page has a regime map
  (``map_from_results``), the block is the map — its two sentences and its table — and
  the single-regime sweep's result in one sentence.
  """
  ref = h["reference"]
  rows = [r for r in h["rows"] if r["configuration"] == ref or
          math.isfinite(_median_cell(r["tokens_pct"]))]
  others = [r for r in h["rows"] if r not in rows]
  replay = [r for r in rows if float(r["x"]) > 1]  # a buffer holding more than one round
  best_pct = min((_median_cell(r["tokens_pct"]) for r in replay), default=INF)
  if not math.isfinite(best_pct):
    verdict_line = "no replay configuration reached on-policy's final accuracy"
  elif best_pct < 100:
    verdict_line = (f"the best replay configuration reached on-policy's final accuracy with "
                    f"**{best_pct:.0f}%** of its generated tokens")
  else:
    verdict_line = (f"**replay did not save generation**: the best replay configurations "
                    f"reached on-policy's final accuracy with **{best_pct:.0f}%** of its "
                    "generated tokens")
  if h.get("map"):
    m = h["map"]
    L = [HEADLINE_NOTE, "", f"**Where replay pays**, {m['sweep']}: {m['summary']}", "",
         "| " + " | ".join(MAP_COLUMNS) + " |", "|" + "---|" * len(MAP_COLUMNS)]
    L += ["| " + " | ".join(r[k] for k in MAP_COLUMNS) + " |" for r in m["rows"]]
    L += ["", f"{h['title']}: {h['configurations']} configurations × {h['seeds']} seeds at "
          f"equal generation budgets ({h['runs']} runs, {h['wall_min']} min of run time in "
          f"all). On-policy (`{ref}`) ends at held-out sampled accuracy **{h['target']}**; "
          f"{verdict_line}; best configuration found: `{h['best']}` (measured μ = "
          f"{h['mu_time']}).", "", HEADLINE_END]
    return L
  L = [HEADLINE_NOTE, "",
       f"{h['title']}: {h['configurations']} configurations × {h['seeds']} seeds at equal "
       f"generation budgets ({h['runs']} runs, {h['wall_min']} min of run time in all). "
       f"On-policy (`{ref}`) ends at held-out sampled accuracy **{h['target']}** (median "
       f"over seeds); {verdict_line}.", "",
       "| configuration | x = N/R | y = B/R | final sampled accuracy, median [IQR] | "
       f"generated tokens to reach {h['target']}, % of on-policy | seeds that reach it | "
       + " | ".join(c.replace("compute to target, %", "compute to reach it, %")
                    for c in h["compute_cols"]) + " |",
       "|" + "---|" * (6 + len(h["compute_cols"]))]
  for r in rows:
    L.append(f"| `{r['configuration']}` | {r['x']} | {r['y']} | {r['final']} | "
             f"{r['tokens_pct']} | {r['reached']} | " + " | ".join(r["compute_pct"]) + " |")
  L += ["", "Reaching it in at most half of their seeds: "
        + ", ".join(f"`{r['configuration']}` ({r['reached']})" for r in others) + ". "
        f"Measured μ = {h['mu_time']} (the paper's: {h['paper_mu']}); best configuration "
        f"found: `{h['best']}`.", "", HEADLINE_END]
  return L


def readme_beside(md_path: str) -> str | None:
  """The README.md of the repository whose ``docs/`` holds ``md_path``, when it has the
  headline markers; else None (a sweep writing its page elsewhere leaves READMEs alone)."""
  docs = os.path.dirname(os.path.abspath(md_path))
  if os.path.basename(docs) != "docs":
    return None
  readme = os.path.join(os.path.dirname(docs), "README.md")
  try:
    with open(readme) as f:
      text = f.read()
  except OSError:
    return None
  return readme if HEADLINE_START in text and HEADLINE_END in text else None


def splice_headline(readme_text: str, block: Sequence[str]) -> str:
  """``readme_text`` with the lines from the start marker to the end marker replaced.

  Raises:
    ValueError: the markers are missing or out of order.
  """
  lines = readme_text.splitlines()
  start = next((i for i, ln in enumerate(lines) if ln.startswith(HEADLINE_START)), None)
  end = next((i for i, ln in enumerate(lines) if ln.strip() == HEADLINE_END), None)
  if start is None or end is None or end < start:
    raise ValueError(f"README has no '{HEADLINE_START} ... -->' line followed by "
                     f"'{HEADLINE_END}'")
  return "\n".join(lines[:start] + list(block) + lines[end + 1:]) + "\n"


def readme_headline_block(readme_text: str) -> list[str]:
  """The lines of the README's headline block, markers included."""
  lines = readme_text.splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith(HEADLINE_START))
  end = next(i for i, ln in enumerate(lines) if ln.strip() == HEADLINE_END)
  return lines[start:end + 1]


def write_readme_headline(readme: str, results_md: str) -> bool:
  """Rewrites the headline block of ``readme`` from ``results_md``; True if it changed."""
  with open(results_md) as f:
    block = render_headline(headline_from_results(f.read()))
  with open(readme) as f:
    old = f.read()
  new = splice_headline(old, block)
  if new != old:
    storage.write_atomic(readme, new)
  return new != old


def main(argv=None) -> int:
  """``python -m jaxreplay.report [--check]``: the README's headline block from
  docs/results.md (no run is read); ``--check`` only reports whether it is current."""
  import argparse
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = argparse.ArgumentParser(prog="python -m jaxreplay.report", description=main.__doc__)
  p.add_argument("--results", default=os.path.join(root, "docs", "results.md"))
  p.add_argument("--readme", default=os.path.join(root, "README.md"))
  p.add_argument("--check", action="store_true", help="exit 1 if the block is out of date")
  a = p.parse_args(argv)
  with open(a.results) as f:
    block = render_headline(headline_from_results(f.read()))
  with open(a.readme) as f:
    old = f.read()
  new = splice_headline(old, block)
  if a.check:
    print("README headline: " + ("current" if new == old else "out of date"))
    return int(new != old)
  if new != old:
    storage.write_atomic(a.readme, new)
  print(f"README headline: {'rewritten' if new != old else 'already current'} ({a.readme})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
