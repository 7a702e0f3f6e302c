"""Static configuration of the replay sampler and eviction rules.

``SamplerConfig`` is a frozen, hashable dataclass: it is closed over (or passed as a
static argument) by jitted code, so changing it recompiles and nothing in it is traced.
Every field is validated in plain Python at construction; a bad value raises
``ValueError`` naming the field, the value and the valid choices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SAMPLERS = ("uniform", "recency", "priority", "positive_bias", "fresh_first")
RECENCY_KINDS = ("exponential", "geometric")


def _fail(field: str, value: Any, allowed: str):
  raise ValueError(f"buffer.{field}={value!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """How ``sample`` chooses items and which items it evicts first.

  Attributes:
    sampler: one of ``SAMPLERS``.
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
    recency: ``exponential``: w_i = exp(−staleness_i / ``recency_temperature``), staleness in
      policy versions. ``geometric``: w_i = (1−ρ)^age_i with ρ = ``recency_p`` and age_i the
      item's rank by insertion among valid items (0 = newest); a geometric law truncated to
      the items present.
    recency_temperature: > 0, in policy versions.
    recency_p: in (0, 1).
    recency_beta: importance-weight exponent for ``recency`` in [0, 1]; 0 (default) keeps the
      bias toward fresh data uncorrected (weights 1).
    priority_alpha: >= 0 (0 = uniform). priority_beta: in [0, 1]. priority_eps: >= 0, added to
      |A| so zero-advantage items keep a small chance.
    positive_bias_delta: δ in [0, 1]. positive_bias_size: N >= 1, the eligible-set size; must be
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

  sampler: str = "uniform"
  replace: bool = False
  recency: str = "exponential"
  recency_temperature: float = 4.0
  recency_p: float = 0.05
  recency_beta: float = 0.0
  priority_alpha: float = 0.6
  priority_beta: float = 0.4
  priority_eps: float = 1e-6
  positive_bias_delta: float = 0.5
  positive_bias_size: int | None = None
  correct_threshold: float = 1.0
  group_size: int = 1
  max_staleness: int | None = None
  max_times_sampled: int | None = None

  def __post_init__(self):
    if self.sampler not in SAMPLERS:
      _fail("sampler", self.sampler, f"must be one of {SAMPLERS}")
    if self.recency not in RECENCY_KINDS:
      _fail("recency", self.recency, f"must be one of {RECENCY_KINDS}")
    if not isinstance(self.replace, bool):
      _fail("replace", self.replace, "must be a bool")
    if self.replace and self.sampler in ("positive_bias", "fresh_first"):
      _fail("replace", self.replace, f"sampler={self.sampler!r} draws without replacement")
    if not self.recency_temperature > 0:
      _fail("recency_temperature", self.recency_temperature, "must be > 0")
    if not 0 < self.recency_p < 1:
      _fail("recency_p", self.recency_p, "must be in (0, 1)")
    if not 0 <= self.recency_beta <= 1:
      _fail("recency_beta", self.recency_beta, "must be in [0, 1]")
    if not self.priority_alpha >= 0:
      _fail("priority_alpha", self.priority_alpha, "must be >= 0")
    if not 0 <= self.priority_beta <= 1:
      _fail("priority_beta", self.priority_beta, "must be in [0, 1]")
    if not self.priority_eps >= 0:
      _fail("priority_eps", self.priority_eps, "must be >= 0")
    if not 0 <= self.positive_bias_delta <= 1:
      _fail("positive_bias_delta", self.positive_bias_delta, "must be in [0, 1]")
    if self.sampler == "positive_bias" and (self.positive_bias_size is None
                                            or self.positive_bias_size < 1):
      _fail("positive_bias_size", self.positive_bias_size,
            "must be an int >= 1 when sampler='positive_bias'")
    if self.group_size < 1:
      _fail("group_size", self.group_size, "must be >= 1")
    if self.group_size > 1 and (self.sampler != "uniform" or self.replace):
      _fail("group_size", self.group_size,
            "group-preserving sampling (group_size > 1) needs sampler='uniform', replace=False")
    if self.max_staleness is not None and self.max_staleness < 0:
      _fail("max_staleness", self.max_staleness, "must be None or >= 0")
    if self.max_times_sampled is not None and self.max_times_sampled < 1:
      _fail("max_times_sampled", self.max_times_sampled, "must be None or >= 1")

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


def from_config(buffer_cfg: Mapping[str, Any]) -> SamplerConfig:
  """Builds a ``SamplerConfig`` from the ``buffer`` node of the config tree.

  Unknown keys other than ``capacity`` raise, so a typo cannot silently be ignored.

  Args:
    buffer_cfg: mapping (e.g. an ``ml_collections.ConfigDict``) with ``sampler`` and optional
      ``SamplerConfig`` field names.

  Raises:
    ValueError: unknown key or invalid value.
  """
  names = {f.name for f in dataclasses.fields(SamplerConfig)}
  kwargs = {}
  for k in buffer_cfg.keys():
    if k == "capacity":
      continue
    if k not in names:
      _fail(k, buffer_cfg[k], f"unknown field; valid fields are {sorted(names | {'capacity'})}")
    kwargs[k] = buffer_cfg[k]
  return SamplerConfig(**kwargs)
