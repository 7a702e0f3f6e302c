"""Static configuration of the replay sampler and eviction rules.

``SamplerConfig`` is a frozen, hashable dataclass: it is closed over (or passed as a
static argument) by jitted code, so changing it recompiles and nothing in it is traced.
Every field is validated in plain Python at construction; a bad value raises
``ValueError`` naming the field, the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from jaxreplay.spec import Spec, fail, field

SAMPLERS = ("uniform", "recency", "priority", "positive_bias", "fresh_first")
RECENCY_KINDS = ("exponential", "geometric")


def _fail(name: str, value: Any, allowed: str):
  fail("buffer", name, value, allowed)


@dataclasses.dataclass(frozen=True)
class SamplerConfig(Spec):
  """The ``buffer`` section: the buffer's capacity, how ``sample`` chooses items and which
  items it evicts first.

  Attributes:
    capacity: N >= 1, items the buffer holds (the oldest is overwritten first).
    sampler: how items are drawn, one of ``SAMPLERS``.
      ``uniform``: every valid item equally likely (Arnal et al. 2026, §3.1; the default).
      ``recency``: weights decaying with age (see ``recency``).
      ``priority``: P(i) ∝ (|A_i| + ``priority_eps``)^``priority_alpha`` (Schaul et al. 2016,
        prioritised replay, eq. 1), with importance weights of exponent ``priority_beta``.
      ``positive_bias``: uniform over the freshest (1−δ)N items of any kind plus the freshest
        δN correct items not among them (Arnal et al. 2026, App. 10.4; N =
        ``positive_bias_size``, δ = ``positive_bias_delta``).
      ``fresh_first``: never-used items first (uniformly), the rest of the batch uniformly
        from the used ones, no duplicates (Arnal et al. 2026, App. 8.5, Fig. 18).
    replace: draw with replacement (i.i.d. draws). Only ``uniform`` supports both; ``recency``
      and ``priority`` always draw with replacement (their ``probs`` are per-draw
      probabilities), ``positive_bias`` and ``fresh_first`` never do.
    recency: the recency weighting. ``exponential``: w_i = exp(−staleness_i / ``recency_temperature``), staleness in
      policy versions. ``geometric``: w_i = (1−ρ)^age_i with ρ = ``recency_p`` and age_i the
      item's rank by insertion among valid items (0 = newest); a geometric law truncated to
      the items present.
    recency_temperature: > 0, the exponential recency scale, in policy versions.
    recency_p: in (0, 1), the geometric recency parameter.
    recency_beta: importance-weight exponent for ``recency`` in [0, 1]; 0 (default) keeps the
      bias toward fresh data uncorrected (weights 1).
    priority_alpha: >= 0, the priority exponent (0 = uniform).
    priority_beta: in [0, 1], the importance-weight exponent of ``priority``.
    priority_eps: >= 0, added to |A| so zero-advantage items keep a small chance.
    positive_bias_delta: δ in [0, 1], the share of correct items in the eligible set.
    positive_bias_size: N >= 1, the eligible-set size of ``positive_bias``; must be
      <= capacity (checked by ``validate_for``). None is only allowed for other samplers.
    correct_threshold: an item is correct when its stored reward >= this value.
    group_size: G >= 1. G > 1 samples whole aligned groups of G consecutive slots (GRPO
      groups, inserted contiguously); needs ``uniform`` without replacement, G | capacity,
      G | batch size and G | every add.
    max_staleness: None, or drop items with current version − generation version above this
      value (policy versions) before every sample.
    max_times_sampled: None, or drop an item once it has been drawn this many times (Reverb's
      ``max_times_sampled``).
  """

  SECTION: ClassVar[str] = "buffer"

  capacity: int = field(512, ge=1)
  sampler: str = field("uniform", choices=SAMPLERS)
  replace: bool = field(False)
  recency: str = field("exponential", choices=RECENCY_KINDS)
  recency_temperature: float = field(4.0, gt=0)
  recency_p: float = field(0.05, gt=0, lt=1)
  recency_beta: float = field(0.0, ge=0, le=1)
  priority_alpha: float = field(0.6, ge=0)
  priority_beta: float = field(0.4, ge=0, le=1)
  priority_eps: float = field(1e-6, ge=0)
  positive_bias_delta: float = field(0.5, ge=0, le=1)
  positive_bias_size: int | None = field(None, ge=1, allowed="(needed by positive_bias)")
  correct_threshold: float = field(1.0)
  group_size: int = field(1, ge=1)
  max_staleness: int | None = field(None, ge=0)
  max_times_sampled: int | None = field(None, ge=1)

  def check(self):
    """Rules between the section's fields.

    Raises:
      ConfigError: naming ``buffer.<field>``.
    """
    if self.replace and self.sampler in ("positive_bias", "fresh_first"):
      _fail("replace", self.replace, f"sampler={self.sampler!r} draws without replacement")
    if self.sampler == "positive_bias" and self.positive_bias_size is None:
      _fail("positive_bias_size", self.positive_bias_size,
            "must be an int >= 1 when sampler='positive_bias'")
    if self.group_size > 1 and (self.sampler != "uniform" or self.replace):
      _fail("group_size", self.group_size,
            "group-preserving sampling (group_size > 1) needs sampler='uniform', replace=False")

  @property
  def with_replacement(self) -> bool:
    """Whether draws are i.i.d. (may repeat an item): ``replace``, recency and priority."""
    return self.replace or self.sampler in ("recency", "priority")

  @property
  def evicts(self) -> bool:
    """Whether any eviction rule beyond FIFO overwrite is on."""
    return self.max_staleness is not None or self.max_times_sampled is not None

  @property
  def num_fresh_any(self) -> int:
    """positive_bias: round((1−δ)N), the freshest items kept whatever their reward."""
    return int(round((1.0 - self.positive_bias_delta) * (self.positive_bias_size or 0)))

  @property
  def num_fresh_correct(self) -> int:
    """positive_bias: N − round((1−δ)N), the freshest correct items added to them."""
    return (self.positive_bias_size or 0) - self.num_fresh_any

  def validate_for(self, capacity: int, batch_size: int) -> None:
    """Checks the fields that depend on the buffer's capacity C and the batch size B.

    Raises:
      ValueError: ``positive_bias_size`` > C, B > N for positive_bias without replacement,
        G not dividing C or B, or B > C without replacement.
    """
    if batch_size < 1:
      _fail("batch_size", batch_size, "must be >= 1")
    if not self.replace and batch_size > capacity:
      _fail("batch_size", batch_size, f"must be <= capacity={capacity} without replacement")
    if self.sampler == "positive_bias":
      if self.positive_bias_size > capacity:
        _fail("positive_bias_size", self.positive_bias_size, f"must be <= capacity={capacity}")
      if batch_size > self.positive_bias_size:
        _fail("positive_bias_size", self.positive_bias_size,
              f"must be >= batch_size={batch_size} (sampling without replacement)")
    if capacity % self.group_size or batch_size % self.group_size:
      _fail("group_size", self.group_size,
            f"must divide capacity={capacity} and batch_size={batch_size}")


BufferSpec = SamplerConfig


def from_config(buffer_cfg: Mapping[str, Any] | SamplerConfig) -> SamplerConfig:
  """The ``SamplerConfig`` of the ``buffer`` section (``SamplerConfig.from_config``).

  Args:
    buffer_cfg: mapping (e.g. an ``ml_collections.ConfigDict``) of ``SamplerConfig`` fields,
      or a ``SamplerConfig`` (returned as is).

  Raises:
    ConfigError: unknown key or invalid value.
  """
  return SamplerConfig.from_config(buffer_cfg)


@dataclasses.dataclass(frozen=True)
class RateLimiterSpec(Spec):
  """The ``rate_limiter`` section: Reverb-style samples-per-insert limiter of ``async`` mode.

  Attributes:
    samples_per_insert: ρ > 0, the replay ratio the limiter holds (None: B/R).
    min_fill: items the buffer must hold before the first sample (None: B).
    error_buffer: e >= 0, tolerance of ρ·inserted − sampled, in sequences (None: ρR + B,
      twice the deadlock-free minimum).
  """

  SECTION: ClassVar[str] = "rate_limiter"

  samples_per_insert: float | None = field(None, gt=0)
  min_fill: int | None = field(None, ge=1)
  error_buffer: float | None = field(None, ge=0)

  def settings(self, batch_size: int, per_step: int) -> dict:
    """The limiter's resolved settings, unset fields derived from B and R.

    Args:
      batch_size: B, items per learner step. per_step: R, rollouts per generation round.

    Returns:
      {"samples_per_insert": ρ (default B/R), "min_size_to_sample": max(min_fill, B)
       (default B: a batch of B distinct items needs B items), "error_buffer": e (default
       ρR + B, twice the smallest deadlock-free tolerance of ``RateLimiter.check_sizes``)}.
    """
    rho = self.samples_per_insert or batch_size / per_step
    min_fill = self.min_fill or batch_size
    err = self.error_buffer
    return {"samples_per_insert": float(rho),
            "min_size_to_sample": int(max(min_fill, batch_size)),
            "error_buffer": float(rho * per_step + batch_size if err is None else err)}
