"""Self-tuning replay: the buffer sets its own replay ratio and staleness horizon.

Every ``auto_replay.every`` learner steps the trainer gives the theory's constants — μ
(generation over training cost per sample: the run's FLOP ratio, or a configured value;
never wall time, which moves with the machine's load; ``train.self_tuning``), α and ρ
(measured, ``rl.noise.make_buffer_noise_fn``) — and this controller, a set of pure
functions on a small host-side ``AutoReplayState``, turns them into the two knobs of
Arnal et al. 2026 §4 (Thm 4.5, App. 9.3.2; ``theory``):

* the replay ratio y = B/R. With the batch size B fixed, the knob is R, the rollouts
  generated per learner step: R = B / y*, rounded to the nearest multiple of the group size
  G (GRPO groups are generated whole), then clamped to the multiples of G inside
  [B / y_max, B / y_min] and to at most the buffer's capacity C;
* the staleness horizon x = N/R (ages 0..x−1 in the buffer, in learner steps). The buffer's
  capacity C stays FIXED (its arrays are allocated once); the horizon is applied as an age
  cut-off inside it: items older than the horizon are not sampled (``buffer.max_staleness``,
  which drops items with current version − generating version > max_staleness). A horizon of
  h whole steps keeps ages 0..h−1, i.e. max_staleness = lag + h − 1 (``lag`` the freshest
  staleness the mode produces: ``train.policy_lag``, 0 in ``sync``), and holds N = h·R
  items. h is the integer next to x* — ⌊x*⌋ or ⌈x*⌉, at least 1 — with the smaller
  J(h, B/R) (the bound's objective at the R actually used); then raised to ⌈min_items/R⌉
  when the sampler needs that many eligible items (``min_items`` = B for sampling without
  replacement: the theory allows N < B, draws with replacement, the trainer's default
  sampler does not; logged as ``batch``), and capped at ⌈C/R⌉, beyond which the FIFO
  capacity binds before the cut-off does (logged as ``capacity``).

(x*, y*) is ``theory.power_law_design_bounded`` with σ̄²(x) = x^{2α}/(2α+1): exactly the
closed form y* = (−α + √(α² + μρ(1−2α)))/ρ, x* = y*²/(μ − ρy*²) when it lies in the box
[x_min, x_max] × [y_min, y_max], the box's minimiser of J otherwise. Estimates are folded
into running values by an exponential moving average (``ema``); α is clamped at 0 and ρ to
[0, 1] before solving. R changes only when the new value differs from the current one by
more than ``tolerance`` (relative): a new R changes the generation round's shapes
(recompilation) and the samples-per-insert balance.

**The bias cap.** Thm 4.5 is the C → ∞ limit of Thm 4.4, where the bias term vanishes;
Thm 4.4 itself holds for a step size η ≤ R/(2√2·κN) = 1/(2√2·κx) only, κ the constant of
the bias assumption ‖E[ε_{t,i}]‖ ≤ κ‖θ_t − θ_{t_i}‖. At a fixed learning rate that
condition bounds the horizon: x ≤ 1/(2√2·κη). With the parameters moving about η‖ĝ_B‖
per step (ĝ_B the minibatch gradient, E‖ĝ_B‖² = ‖∇F‖² + σ²(0)/B), κη is the bias per
step of age relative to ‖ĝ_B‖, which the noise pass measures (``rl.noise.bias_profile``):
k = β_slope / √(‖∇F‖² + σ²(0)/B) (``relative_bias``) — an SGD reading: under Adam the step
does not scale with ‖ĝ_B‖, so k is κη only approximately. The controller folds k like the other
estimates and, with ``bias_limit`` = c > 0 (1/(2√2) = ``BIAS_LIMIT`` is Thm 4.4's constant;
0, the default, leaves the cap off), solves inside x ≤ x_cap = c/k and — when the sampler
needs ``min_items`` items within the horizon — y ≤ x_cap·B/``min_items``, so the horizon
the batch needs stays under the cap. Where the bias per step of age exceeds ~0.35 of the
minibatch gradient, the cap is x = 1: on-policy. The cap is off by default: on the embedded
task, with 4 groups of 8 completions per age, the estimate is noise-dominated (k read 0.26,
1.17 and 0.00 in three learning-rate regimes, in no order of their outcomes;
``bench/staleness_bias.py``, docs/replay-study.md).

The state is a frozen dataclass of Python scalars with an exact ``to_dict`` /
``from_dict`` round trip (JSON-safe: ``None`` for "no estimate yet", never NaN), so it is
checkpointed with the run's JSON metadata.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

from jaxreplay import theory
from jaxreplay.spec import Spec, field

MAX_LOG = 64  # change-log entries kept in the state (the oldest are dropped)
MU_SOURCES = ("flops", "configured")  # ``AutoReplaySpec.mu_source``
BIAS_LIMIT = 1.0 / (2.0 * math.sqrt(2.0))  # Thm 4.4: η <= R/(2√2·κN)


@dataclasses.dataclass(frozen=True)
class AutoReplaySpec(Spec):
  """The ``auto_replay`` section: the self-tuning replay controller (``replay.auto``).

  Attributes:
    enabled: let the controller set rollout.per_step (R) and the buffer's age cut-off.
    every: >= 1 learner steps between noise estimates and controller decisions.
    num_samples: >= 2 buffer items whose projected gradients are scored per estimate.
    num_projections: k >= 1 Gaussian directions of the gradient projection (64–256).
    center: the reference gradient the errors are measured against, 'mean' (of the scored
      items) or 'fresh' (of their staleness-0 items).
    min_samples: >= 1 items a staleness bucket needs to enter the α fit.
    warmup: >= 1 estimates folded in before the controller first acts.
    ema: in [0, 1), weight of the running value when a new estimate is folded in (0 = use
      the latest estimate alone).
    x_min, x_max: bounds on the staleness horizon x = N/R in learner steps, 1 <= x_min <=
      x_max.
    y_min, y_max: bounds on the replay ratio y = B/R, 0 < y_min <= y_max.
    tolerance: >= 0 relative change of R below which R is kept (a new R recompiles
      generation).
    bias_limit: >= 0, the constant c of the bias cap x <= c/k (k the measured bias per
      step of age relative to the minibatch gradient; module docstring): 0 (default) leaves
      the cap off; 1/(2√2) ≈ 0.354 is Thm 4.4's step-size condition.
    mu_source: where the controller's μ comes from, never wall time (``train.self_tuning``):
      'flops' (the run's ledger, generation FLOPs per rollout over training FLOPs per
      trained sample: deterministic, the compute-bound floor) or 'configured'
      (``auto_replay.mu``, e.g. a deployment's measured μ; the paper's is 5.3).
    mu: > 0, the μ the controller uses with mu_source='configured'; None otherwise.
  """

  SECTION: ClassVar[str] = "auto_replay"

  enabled: bool = field(False)
  every: int = field(50, ge=1)
  num_samples: int = field(256, ge=2)
  num_projections: int = field(128, ge=1)
  center: str = field("mean", choices=("mean", "fresh"))
  min_samples: int = field(4, ge=1)
  warmup: int = field(2, ge=1)
  ema: float = field(0.8, ge=0, lt=1)
  x_min: float = field(1.0, ge=1)
  x_max: float = field(64.0, ge=1)
  y_min: float = field(1.0, gt=0)
  y_max: float = field(16.0, gt=0)
  tolerance: float = field(0.2, ge=0)
  bias_limit: float = field(0.0, ge=0)
  mu_source: str = field("flops", choices=MU_SOURCES)
  mu: float | None = field(None, gt=0, allowed="(set exactly when mu_source='configured')")

  def check(self):
    """Raises ``ConfigError`` when a lower bound exceeds its upper bound, or ``mu`` is
    missing with mu_source='configured' or set with any other source (it would be
    ignored)."""
    if self.x_min > self.x_max:
      self.fail("x_min", self.x_min, f"must be <= auto_replay.x_max={self.x_max}")
    if self.y_min > self.y_max:
      self.fail("y_min", self.y_min, f"must be <= auto_replay.y_max={self.y_max}")
    if self.mu_source == "configured" and self.mu is None:
      self.fail("mu", self.mu, "must be a number > 0 with auto_replay.mu_source='configured'")
    if self.mu_source != "configured" and self.mu is not None:
      self.fail("mu", self.mu, f"is used only with auto_replay.mu_source='configured' (not "
                f"{self.mu_source!r}): set that, or leave auto_replay.mu None")


class Plan(NamedTuple):
  """One controller decision.

  Attributes:
    x: float, the solver's staleness horizon x* (learner steps).
    y: float, the solver's replay ratio y*.
    rollouts_per_step: int R (a multiple of G, B/y_max..B/y_min, <= C).
    horizon: int h >= 1 whole steps kept (N = h·R items).
    max_staleness: int, lag + h − 1 (the buffer's age cut-off, policy versions).
    objective: float J(h, B/R) of the bound at the chosen design (unitless, τ = 1).
    x_cap: float, the upper bound on x the solve used (``x_max``, or the bias cap).
  """

  x: float
  y: float
  rollouts_per_step: int
  horizon: int
  max_staleness: int
  objective: float
  x_cap: float = math.inf


@dataclasses.dataclass(frozen=True)
class Change:
  """One change-log entry: what the controller set at ``step`` and from which estimates.

  Attributes:
    step: learner step of the decision. rollouts_per_step: R set. max_staleness: cut-off set.
    x, y: the solver's x*, y*. mu, alpha, rho: the running estimates used.
    kappa: the running relative bias per step of age (None: not measured).
    reason: 'estimate' (a new optimum), 'bias' (the optimum sits at the bias cap),
      'batch' (the horizon was raised to hold ``min_items``) or 'capacity' (the horizon
      was capped at ⌈C/R⌉).
  """

  step: int
  rollouts_per_step: int
  max_staleness: int
  x: float
  y: float
  mu: float
  alpha: float
  rho: float
  reason: str = "estimate"
  kappa: float | None = None

  def to_dict(self) -> dict:
    """The fields as a JSON-safe dict."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AutoReplayState:
  """The controller's state (host-side; lives in the trainer's carry and checkpoint JSON).

  Attributes:
    rollouts_per_step: int R currently in force.
    max_staleness: int age cut-off currently in force, or None (FIFO capacity only).
    mu, alpha, rho: running estimates (float), None until the first finite one.
    kappa: running relative bias per step of age k (``relative_bias``), None until one.
    num_estimates: estimates folded in so far.
    last_step: learner step of the last estimate (−1 before any).
    log: tuple of ``Change``, the newest ``MAX_LOG`` decisions that changed something.
  """

  rollouts_per_step: int
  max_staleness: int | None = None
  mu: float | None = None
  alpha: float | None = None
  rho: float | None = None
  kappa: float | None = None
  num_estimates: int = 0
  last_step: int = -1
  log: tuple = ()

  def to_dict(self) -> dict:
    """A JSON-safe dict (``from_dict`` inverts it exactly)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["log"] = [c.to_dict() for c in self.log]
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "AutoReplayState":
    """The state of ``to_dict`` output (also after a JSON round trip).

    Raises:
      KeyError / TypeError: a dict not made by ``to_dict``.
    """
    opt = lambda v, t: None if v is None else t(v)
    return cls(rollouts_per_step=int(d["rollouts_per_step"]),
               max_staleness=opt(d["max_staleness"], int), mu=opt(d["mu"], float),
               alpha=opt(d["alpha"], float), rho=opt(d["rho"], float),
               kappa=opt(d.get("kappa"), float), num_estimates=int(d["num_estimates"]),
               last_step=int(d["last_step"]),
               log=tuple(Change(**c) for c in d["log"]))


def initial_state(rollouts_per_step: int, max_staleness: int | None = None) -> AutoReplayState:
  """The state before any estimate: the configured R (``rollout.per_step``) and cut-off
  (``buffer.max_staleness``). Raises ValueError for R < 1 or a negative cut-off."""
  if rollouts_per_step < 1 or (max_staleness is not None and max_staleness < 0):
    raise ValueError(f"rollouts_per_step={rollouts_per_step} must be >= 1 and "
                     f"max_staleness={max_staleness} None or >= 0")
  return AutoReplayState(rollouts_per_step=int(rollouts_per_step), max_staleness=max_staleness)


def _fold(old: float | None, new, ema: float) -> float | None:
  if new is None or not math.isfinite(float(new)):
    return old
  return float(new) if old is None else ema * old + (1.0 - ema) * float(new)


def relative_bias(bias_slope, grad2, fresh_var, batch_size: int) -> float:
  """k = β_slope / √(max(‖∇F‖², 0) + σ²(0)/B): the bias per step of age over the
  minibatch gradient's norm (module docstring; ``rl.noise.bias_profile`` gives the inputs).

  Args:
    bias_slope: gradient units per learner step. grad2: ‖∇F‖² estimate (may be < 0).
    fresh_var: per-item variance of the youngest items. batch_size: B >= 1.

  Returns:
    float k >= 0, or NaN when an input is not finite or the denominator is 0.
  """
  vals = [float(v) for v in (bias_slope, grad2, fresh_var)]
  if not all(math.isfinite(v) for v in vals):
    return math.nan
  den = max(vals[1], 0.0) + max(vals[2], 0.0) / batch_size
  return vals[0] / math.sqrt(den) if den > 0 else math.nan


def bias_cap(kappa: float | None, spec: AutoReplaySpec) -> float:
  """The horizon bound x_cap = clip(``bias_limit``/k, x_min, x_max); x_max when the cap is
  off (``bias_limit`` = 0) or k is unknown (None, NaN) or 0."""
  if not spec.bias_limit or kappa is None or not kappa > 0 or not math.isfinite(kappa):
    return spec.x_max
  return min(max(spec.bias_limit / kappa, spec.x_min), spec.x_max)


def observe(state: AutoReplayState, step: int, spec: AutoReplaySpec, *, mu=None, alpha=None,
            rho=None, kappa=None) -> AutoReplayState:
  """Folds one estimate into the running values (EMA with weight ``spec.ema`` on the old).

  Args:
    state: the controller state. step: the learner step of the estimate.
    spec: ``AutoReplaySpec``. mu, alpha, rho, kappa: floats (or 0-d arrays); None or
      non-finite values leave that running value unchanged (e.g. ρ not identifiable).

  Returns:
    The new state (``num_estimates`` + 1, ``last_step`` = step).
  """
  return dataclasses.replace(
      state, mu=_fold(state.mu, mu, spec.ema), alpha=_fold(state.alpha, alpha, spec.ema),
      rho=_fold(state.rho, rho, spec.ema), kappa=_fold(state.kappa, kappa, spec.ema),
      num_estimates=state.num_estimates + 1,
      last_step=int(step))


def _rollouts(y: float, spec: AutoReplaySpec, batch_size: int, group_size: int,
              capacity: int) -> int:
  """R = B/y rounded to a multiple of G, clamped to [B/y_max, B/y_min] and to C."""
  g = group_size
  r = max(g, int(round(batch_size / y / g)) * g)
  lo = g * math.ceil(batch_size / (spec.y_max * g) - 1e-9)
  hi = g * math.floor(batch_size / (spec.y_min * g) + 1e-9)
  if lo <= hi:
    r = min(max(r, lo), hi)
  return max(g, min(r, g * (capacity // g)))


def plan(mu: float, alpha: float, rho: float, spec: AutoReplaySpec, *, batch_size: int,
         group_size: int, capacity: int, lag: int = 0, min_items: int = 0,
         rollouts_per_step: int | None = None, kappa: float | None = None) -> Plan:
  """The design for given estimates (module docstring for the mapping).

  Args:
    mu: μ > 0, cost of generating one rollout over training on one sample.
    alpha: α (clamped at 0). rho: ρ (clamped to [0, 1]).
    spec: ``AutoReplaySpec`` (its x and y bounds).
    batch_size: B >= 1. group_size: G >= 1. capacity: the buffer's fixed C >= G.
    lag: >= 0, the staleness of the freshest items (``train.policy_lag``).
    min_items: >= 0 items the horizon must keep (B when the sampler draws without
      replacement, else 0).
    rollouts_per_step: None (choose R from y*), or an R to keep (the horizon is then chosen
      for it).
    kappa: k, the relative bias per step of age, or None: the solve stays inside
      x <= ``bias_cap(k)`` and, with ``min_items``, y <= x_cap·B/min_items; the horizon
      is at most ⌊x_cap⌋ unless the batch needs more.

  Returns:
    ``Plan``.

  Raises:
    ValueError: mu <= 0, B, G < 1, C < G or lag < 0 (and ``theory`` errors).
  """
  if mu <= 0 or batch_size < 1 or group_size < 1 or capacity < group_size or lag < 0:
    raise ValueError(f"need mu={mu} > 0, batch_size={batch_size} >= 1, group_size="
                     f"{group_size} >= 1, capacity={capacity} >= group_size, lag={lag} >= 0")
  a, r_ = max(float(alpha), 0.0), min(max(float(rho), 0.0), 1.0)
  x_cap = bias_cap(kappa, spec)
  y_hi = spec.y_max
  if min_items and x_cap < spec.x_max:
    y_hi = max(spec.y_min, min(y_hi, x_cap * batch_size / min_items))
  x, y = theory.power_law_design_bounded(mu, r_, a, (spec.x_min, x_cap), (spec.y_min, y_hi))
  r = rollouts_per_step or _rollouts(y, spec, batch_size, group_size, capacity)
  if min_items and x_cap < spec.x_max and not rollouts_per_step:
    # R large enough that the batch's horizon ⌈min_items/R⌉ stays within ⌊x_cap⌋ steps
    need = group_size * math.ceil(min_items / max(1, math.floor(x_cap)) / group_size - 1e-9)
    r = min(max(r, need), max(group_size, group_size * (capacity // group_size)))
  y_r = batch_size / r
  s2 = theory.power_law_sigma2_bar(a)
  cands = sorted({max(1, math.floor(x)), max(1, math.ceil(x))})
  if x_cap < spec.x_max:  # whole steps under the cap: ⌈x⌉ may pass it, ⌊x⌋ never does
    cands = [c for c in cands if c <= max(1, math.floor(x_cap))]
  h = min(cands, key=lambda c: theory.objective(c, y_r, mu, r_, s2))
  h = max(1, min(max(h, math.ceil(min_items / r)), math.ceil(capacity / r)))
  return Plan(x=x, y=y, rollouts_per_step=int(r), horizon=int(h),
              max_staleness=int(lag + h - 1), objective=theory.objective(h, y_r, mu, r_, s2),
              x_cap=float(x_cap))


def update(state: AutoReplayState, step: int, spec: AutoReplaySpec, *, mu, alpha, rho,
           batch_size: int, group_size: int, capacity: int, lag: int = 0,
           min_items: int = 0, kappa=None) -> tuple[AutoReplayState, Plan | None]:
  """``observe`` then, after ``spec.warmup`` estimates, ``plan`` with hysteresis.

  A new R is adopted only when |R_new − R|/R > ``spec.tolerance``; otherwise R is kept and
  only the horizon is re-chosen for it. A decision that changes R or the cut-off is
  appended to the log.

  Args:
    state, step, spec, mu, alpha, rho, kappa: as ``observe`` (the running k goes to
      ``plan``).
    batch_size, group_size, capacity, lag, min_items: as ``plan``.

  Returns:
    (new state, the ``Plan`` in force), or (new state, None) during warm-up or while an
    estimate (μ, α or ρ) is still missing.

  Raises:
    ValueError: as ``plan``.
  """
  state = observe(state, step, spec, mu=mu, alpha=alpha, rho=rho, kappa=kappa)
  if (state.num_estimates < spec.warmup or state.mu is None or state.alpha is None
      or state.rho is None):
    return state, None
  kw = dict(batch_size=batch_size, group_size=group_size, capacity=capacity, lag=lag,
            min_items=min_items, kappa=state.kappa)
  p = plan(state.mu, state.alpha, state.rho, spec, **kw)
  r_old = state.rollouts_per_step
  if abs(p.rollouts_per_step - r_old) <= spec.tolerance * r_old:
    p = plan(state.mu, state.alpha, state.rho, spec, rollouts_per_step=r_old, **kw)
  if p.rollouts_per_step == r_old and p.max_staleness == state.max_staleness:
    return state, p
  reason = ("capacity" if p.horizon < max(1, math.floor(p.x)) else
            "batch" if p.horizon > max(1, math.ceil(p.x)) else
            "bias" if p.x_cap < spec.x_max and p.x >= p.x_cap * (1 - 1e-6) else "estimate")
  entry = Change(step=int(step), rollouts_per_step=p.rollouts_per_step,
                 max_staleness=p.max_staleness, x=p.x, y=p.y, mu=state.mu,
                 alpha=state.alpha, rho=state.rho, reason=reason, kappa=state.kappa)
  state = dataclasses.replace(state, rollouts_per_step=p.rollouts_per_step,
                              max_staleness=p.max_staleness,
                              log=(state.log + (entry,))[-MAX_LOG:])
  return state, p
