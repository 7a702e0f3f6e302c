"""A sweep's runs as data: each run's evaluations and ledger (``RunData``), the runs of a
sweep (``load_runs``), and per-run metrics relative to a reference configuration
(``Analysis``), read from the files a run leaves (``metrics/``, ``config.json``).

Definitions (the single-regime report prints them):
  * Final accuracy of a run: the mean of its last K evaluations (``report.target_last``,
    default 1: the last one), so that one evaluation's noise does not set it.
  * Target accuracy: the median, over the reference (on-policy) configuration's seeds, of
    its final held-out sampled accuracy.
  * Plateau check of the reference: its final accuracy minus the mean of the K evaluations
    before its last K (near zero when the reference has stopped improving).
  * Tokens to reach the target: the generated tokens at the first evaluation (step 0
    included) whose sampled accuracy is >= the target, no interpolation; +inf when none
    does. A configuration's "% of on-policy" is each seed's tokens over the median of the
    reference seeds' tokens to reach, then the median over seeds with not-reached seeds
    counted as +inf. (A first crossing of raw evaluations is mostly a crossing of their
    noise: ``jaxreplay.study.null`` measures how often it favours a buffer by chance; the
    regime map decides with ``jaxreplay.study.evidence`` instead.)
  * Compute on the paper's axis: learner steps × per-update cost γ = (1 + W/T)/(1 + μ) with
    the emulated W/T = μ/ρ (``jaxreplay.train.accounting.gamma``; ρ the run's replay ratio so
    far), scaled by B / B_reference, so the on-policy reference costs 1 per update.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import numpy as np

from jaxreplay import storage
from jaxreplay.study.stats import INF, quantiles
from jaxreplay.train import accounting
from jaxreplay.train.metrics import read_metrics

PAPER_MU = 5.3


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

  def curve(self, y: str = "eval/acc_sampled") -> tuple[np.ndarray, np.ndarray]:
    """(generated tokens [E], ``y`` [E]) at the evaluations, float64 (``jaxreplay.study``'s
    curve)."""
    s = self.series("generated_tokens", y)
    return s[:, 0], s[:, 1]

  def cost_curve(self, mu: float, y: str = "eval/acc_sampled") -> tuple[np.ndarray, np.ndarray]:
    """(C [E], ``y`` [E]) with C = K_train + μ·K_inf, the samples trained plus μ times the
    rollouts generated so far, in trained samples: the theory's C = (B + μR)·T (Thm 4.5)
    summed over the steps, so a run that changed R is counted at what it ran."""
    s = self.series(lambda r: r.get("trained_samples", 0) + mu * r.get("generated_rollouts", 0),
                    y)
    return s[:, 0], s[:, 1]

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
