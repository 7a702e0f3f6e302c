"""A plain-numpy reference of the replay buffer, written for clarity, not speed.

It keeps an explicit insertion sequence number per slot and ranks freshness by sorting on
it, independently of the ring-order arithmetic of ``buffer`` and ``samplers``. Tests drive
it and the JAX buffer with the same operations and compare contents, pointers, sizes,
counters and sampling probabilities exactly (``tests/test_replay_property.py``).
"""

from __future__ import annotations

import numpy as np

from jaxreplay.replay.config import SamplerConfig


class NumpyBuffer:
  """Reference ring buffer of capacity C over a dict of numpy item arrays."""

  def __init__(self, example_items: dict, capacity: int):
    self.c = capacity
    self.items = {k: np.zeros((capacity,) + v.shape[1:], v.dtype)
                  for k, v in example_items.items()}
    self.policy_version = np.zeros(capacity, np.int32)
    self.insert_step = np.zeros(capacity, np.int32)
    self.times_sampled = np.zeros(capacity, np.int32)
    self.last_sampled_step = np.full(capacity, -1, np.int32)
    self.reward = np.zeros(capacity, np.float32)
    self.advantage = np.zeros(capacity, np.float32)
    self.valid = np.zeros(capacity, bool)
    self.seq = np.full(capacity, -1, np.int64)  # insertion number of the slot's item
    self.write_index = 0
    self.total_inserted = 0

  @property
  def size(self) -> int:
    return int(self.valid.sum())

  def add(self, items: dict, policy_version, step: int) -> None:
    """Writes items one at a time at the write pointer (oldest overwritten)."""
    n = len(policy_version)
    for j in range(n):
      s = self.write_index
      for k in self.items:
        self.items[k][s] = items[k][j]
      self.policy_version[s] = policy_version[j]
      self.insert_step[s] = step
      self.times_sampled[s] = 0
      self.last_sampled_step[s] = -1
      self.reward[s] = items.get("rewards", np.zeros(n, np.float32))[j]
      self.advantage[s] = items.get("advantages", np.zeros(n, np.float32))[j]
      self.valid[s] = True
      self.seq[s] = self.total_inserted
      self.total_inserted += 1
      self.write_index = (s + 1) % self.c

  def evict(self, current_version: int, max_staleness=None, max_times_sampled=None) -> None:
    for s in range(self.c):
      if not self.valid[s]:
        continue
      if max_staleness is not None and current_version - self.policy_version[s] > max_staleness:
        self.valid[s] = False
      if max_times_sampled is not None and self.times_sampled[s] >= max_times_sampled:
        self.valid[s] = False

  def freshest(self, mask: np.ndarray, k: int) -> set[int]:
    """Slots of the k most recently inserted items among ``mask``."""
    slots = [s for s in range(self.c) if mask[s]]
    slots.sort(key=lambda s: -self.seq[s])
    return set(slots[:k])

  def eligible(self, spec: SamplerConfig) -> np.ndarray:
    if spec.sampler == "positive_bias":
      fresh = self.freshest(self.valid, spec.num_fresh_any)
      correct = self.valid & (self.reward >= spec.correct_threshold)
      correct[list(fresh)] = False
      chosen = fresh | self.freshest(correct, spec.num_fresh_correct)
      return np.isin(np.arange(self.c), list(chosen))
    if spec.group_size > 1:
      g = spec.group_size
      return np.repeat(self.valid.reshape(-1, g).all(1), g)
    return self.valid.copy()

  def probabilities(self, current_version: int, batch_size: int, spec: SamplerConfig):
    """[C] float64 marginal probability that one batch position holds each slot."""
    if spec.max_staleness is not None:
      self.evict(current_version, max_staleness=spec.max_staleness)
    v = self.valid
    if spec.sampler == "recency" and spec.recency == "exponential":
      s = (current_version - self.policy_version).astype(np.float64)
      w = np.where(v, np.exp(-s / spec.recency_temperature), 0.0)
    elif spec.sampler == "recency":
      order = sorted(np.flatnonzero(v), key=lambda s: -self.seq[s])
      w = np.zeros(self.c)
      for age, s in enumerate(order):
        w[s] = (1 - spec.recency_p) ** age
    elif spec.sampler == "priority":
      w = np.where(v, (np.abs(self.advantage.astype(np.float64)) + spec.priority_eps)
                   ** spec.priority_alpha, 0.0)
    elif spec.sampler == "fresh_first":
      fresh = v & (self.times_sampled == 0)
      used = v & ~fresh
      nf, nu, b = fresh.sum(), used.sum(), batch_size
      p = np.zeros(self.c)
      p[fresh] = min(b, nf) / nf / b if nf else 0.0
      p[used] = max(b - nf, 0) / nu / b if nu else 0.0
      return p
    else:
      w = self.eligible(spec).astype(np.float64)
    return w / w.sum() if w.sum() > 0 else w

  def importance_weights(self, probs_all: np.ndarray, idx, beta: float) -> np.ndarray:
    """(N·P(i))^−β / max_j (N·P(j))^−β over the drawable items."""
    n = self.size
    drawable = probs_all[probs_all > 0]
    raw = (n * probs_all[idx]) ** (-beta)
    return raw / ((n * drawable) ** (-beta)).max()

  def apply_sample(self, idx, current_version: int, step: int, spec: SamplerConfig) -> dict:
    """Bookkeeping of a draw of slots ``idx``; returns the expected per-item statistics."""
    idx = np.asarray(idx)
    out = dict(staleness=current_version - self.policy_version[idx],
               times_sampled_before=self.times_sampled[idx].copy(),
               steps_since_last_use=np.where(self.last_sampled_step[idx] < 0, -1,
                                             step - self.last_sampled_step[idx]),
               items={k: v[idx].copy() for k, v in self.items.items()})
    for s in idx:
      self.times_sampled[s] += 1
      self.last_sampled_step[s] = step
    if spec.max_times_sampled is not None:
      self.evict(current_version, max_times_sampled=spec.max_times_sampled)
    return out
