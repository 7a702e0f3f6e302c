"""The run's compute ledger and phase timers: small frozen dataclasses.

Generation returns its increments as a ``Ledger`` value and the learner step's are made
into one; the loop adds them (``ledger + increment``), as optax returns new state rather
than mutating the caller's. Both serialise to the plain dicts stored in checkpoint
metadata and metric records (``as_dict`` / ``from_dict``), so their keys are stable.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class _Flat:
  """``replace`` and the dict round trip of a flat dataclass of numbers."""

  def replace(self, **changes):
    """A copy with ``changes`` applied (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)

  def as_dict(self) -> dict:
    """Field name → value, in declaration order; fields left None are omitted."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None}

  @classmethod
  def from_dict(cls, d: dict):
    """The inverse of ``as_dict``; keys this class does not know are ignored (older or
    newer metadata), missing ones take their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Ledger(_Flat):
  """Running totals of what a run generated and trained on (Arnal et al. 2026, §4: the
  compute axis is generated tokens; ``accounting`` derives μ, W/T and γ from these).

  Attributes (ints unless noted; tokens are completion tokens):
    generated_tokens, generated_rollouts: produced by the sampler.
    trained_tokens, trained_samples: consumed by learner steps, with reuse.
    zero_adv_group_tokens: generated in groups whose rewards are all equal (no gradient).
    reward_failures: reward calls that raised, timed out or returned NaN (scored 0).
    prompts_skipped: prompts too long for ``task.prompt_width`` with ``on_too_long='skip'``.
    first_use_tokens: of items drawn for the first time ("trained on at least once").
    evicted_unused_rollouts, evicted_unused_tokens: overwritten before any use.
    truncated_tokens: of completions that hit ``sampler.max_new_tokens`` without EOS.
    lost_in_flight_rollouts: generated (or being generated) by the actor–learner split's
      generator but never inserted, because the run stopped first.
    generation_flops, training_flops: floats, estimated FLOPs (``accounting``).
  """

  generated_tokens: int = 0
  generated_rollouts: int = 0
  trained_tokens: int = 0
  trained_samples: int = 0
  zero_adv_group_tokens: int = 0
  reward_failures: int = 0
  prompts_skipped: int = 0
  first_use_tokens: int = 0
  evicted_unused_rollouts: int = 0
  evicted_unused_tokens: int = 0
  truncated_tokens: int = 0
  lost_in_flight_rollouts: int = 0
  generation_flops: float = 0.0
  training_flops: float = 0.0

  def __add__(self, other: "Ledger") -> "Ledger":
    """Field-wise sum."""
    if not isinstance(other, Ledger):
      return NotImplemented
    return Ledger(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                     for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class Timers(_Flat):
  """Seconds spent in each phase, continued across resumes.

  ``learner_wait_s`` (learner blocked waiting for a batch) and ``generator_wait_s``
  (generator blocked by the rate limiter) exist only in ``async`` mode: None elsewhere,
  and then left out of ``as_dict``; ``both_busy_s`` (generator and learner working at
  the same moment) only with the actor–learner split (``mesh.generator_devices`` > 0).
  """

  generate_s: float = 0.0
  train_s: float = 0.0
  eval_s: float = 0.0
  learner_wait_s: float | None = None
  generator_wait_s: float | None = None
  both_busy_s: float | None = None
