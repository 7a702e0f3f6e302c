"""Replay-ratio control in the manner of Reverb's ``SampleToInsertRatio`` limiter.

The replay ratio ρ is sequences trained on per sequence generated (samples per insert).
With I sequences inserted and S sampled so far, the limiter keeps the difference
diff = ρ·I − S inside [offset − e, offset + e], where offset = ρ·min_size_to_sample and e is
``error_buffer`` (in sampled sequences), and allows no sampling before the buffer holds
``min_size_to_sample`` items. Over a long run S / I → ρ, the error bounded by
(offset + e) / I. The trainer asks ``next_action`` whether to generate or to train.

Counters live in a ``flax.struct`` pytree (checkpoint it with the buffer); the decisions are
host-side Python on those scalars (the loop is host-driven between jitted calls).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp


@flax.struct.dataclass
class RateLimiterState:
  """Counters. inserted, sampled: int32 scalars, sequences added / drawn so far."""

  inserted: jnp.ndarray
  sampled: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class RateLimiter:
  """Static limiter settings.

  Attributes:
    samples_per_insert: ρ > 0, target sequences trained on per sequence generated.
    min_size_to_sample: items the buffer must hold before the first sample (>= 1).
    error_buffer: e >= 0, tolerance of ρ·I − S around its offset, in sequences.
  """

  samples_per_insert: float
  min_size_to_sample: int
  error_buffer: float

  def __post_init__(self):
    if not self.samples_per_insert > 0:
      raise ValueError(f"rate_limiter.samples_per_insert={self.samples_per_insert!r} is "
                       "invalid: must be > 0")
    if self.min_size_to_sample < 1:
      raise ValueError(f"rate_limiter.min_size_to_sample={self.min_size_to_sample!r} is "
                       "invalid: must be >= 1")
    if not self.error_buffer >= 0:
      raise ValueError(f"rate_limiter.error_buffer={self.error_buffer!r} is invalid: "
                       "must be >= 0")

  @property
  def offset(self) -> float:
    return self.samples_per_insert * self.min_size_to_sample

  def check_sizes(self, insert_size: int, sample_size: int) -> None:
    """Raises ValueError when a step of these sizes could deadlock (neither allowed).

    Both actions are always possible in turn iff e >= (ρ·insert_size + sample_size) / 2;
    a smaller tolerance can block both generation and training.
    """
    need = (self.samples_per_insert * insert_size + sample_size) / 2
    if self.error_buffer < need:
      raise ValueError(f"rate_limiter.error_buffer={self.error_buffer!r} is invalid: must be "
                       f">= (samples_per_insert*insert_size + sample_size)/2 = {need} for "
                       f"inserts of {insert_size} and samples of {sample_size}")


def init() -> RateLimiterState:
  """Zero counters."""
  return RateLimiterState(inserted=jnp.int32(0), sampled=jnp.int32(0))


def record_insert(state: RateLimiterState, n: int) -> RateLimiterState:
  """Counts ``n`` inserted sequences."""
  return state.replace(inserted=jnp.int32(state.inserted + n))


def record_sample(state: RateLimiterState, n: int) -> RateLimiterState:
  """Counts ``n`` sampled (trained-on) sequences."""
  return state.replace(sampled=jnp.int32(state.sampled + n))


def _diff(lim: RateLimiter, state: RateLimiterState, inserts: int = 0, samples: int = 0):
  return (lim.samples_per_insert * (int(state.inserted) + inserts)
          - (int(state.sampled) + samples))


def can_insert(lim: RateLimiter, state: RateLimiterState, n: int, buffer_size: int) -> bool:
  """Whether inserting ``n`` sequences keeps ρ·I − S <= offset + e (always, below min size)."""
  if buffer_size + n <= lim.min_size_to_sample:
    return True
  return _diff(lim, state, inserts=n) <= lim.offset + lim.error_buffer


def can_sample(lim: RateLimiter, state: RateLimiterState, n: int, buffer_size: int) -> bool:
  """Whether drawing ``n`` sequences is allowed: min fill reached and ρ·I − S − n >= offset − e."""
  if buffer_size < lim.min_size_to_sample:
    return False
  return _diff(lim, state, samples=n) >= lim.offset - lim.error_buffer


def next_action(lim: RateLimiter, state: RateLimiterState, insert_size: int, sample_size: int,
                buffer_size: int) -> str:
  """``"train"`` or ``"generate"``: what the trainer should do next to hold ρ.

  Trains when allowed and the ratio is at or above its target (or generating is blocked);
  otherwise generates.

  Raises:
    RuntimeError: neither is allowed (tolerance too small; see ``check_sizes``).
  """
  ok_s = can_sample(lim, state, sample_size, buffer_size)
  ok_i = can_insert(lim, state, insert_size, buffer_size)
  if ok_s and (not ok_i or _diff(lim, state) >= lim.offset):
    return "train"
  if ok_i:
    return "generate"
  raise RuntimeError(f"rate limiter blocks both actions at inserted={int(state.inserted)}, "
                     f"sampled={int(state.sampled)}, buffer_size={buffer_size}")
