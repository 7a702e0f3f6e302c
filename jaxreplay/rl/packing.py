"""Sequence packing: the real tokens of a [B, T] batch placed end to end in [R, W] rows.

Rollouts are stored at the full padded width T = P + M (prompt left-padded, completion
right-padded); with ragged completion lengths most of those columns are padding. Packing
places each row's real tokens (``attention_mask`` True, in order) contiguously into one of
R ≤ B rows of width W = T, first-fit-decreasing on their lengths, so the forward pass runs
on R·W tokens instead of B·T. Packed rows carry ``segment_ids`` (attention stays within a
sequence, ``Transformer.hidden``) and ``positions`` restarting at 0 per sequence, which
are exactly ``positions_from_mask`` of the unpacked row: a sequence's log-probs are those
of its unpacked row up to float rounding.

The plan is computed on the host (numpy): R is a static shape, rounded up to a bucket
(``bucket_rows``) so a run compiles a few shapes, not one per batch. ``pack`` and
``unpack`` are traceable gathers; gradients flow through ``unpack`` (a scatter-add).

A learner batch is packed in groups: the train step's minibatch m is rows
[m·B/n_mb, (m+1)·B/n_mb) and its micro-batch k the rows k, k + n_acc, ... of that
minibatch (``scoring.micro_batches``); ``plan_groups`` packs each of the n_mb · n_acc
groups separately, at one common R, so each forward pass packs exactly its own rows.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PackPlan:
  """Where each real token of a [Bg, T] group goes in its packed [R, W] rows.

  Leaves may carry leading group axes (``plan_groups``: [n_mb, n_acc, ...]).

  Attributes:
    src: [R, W] int32, the flat index (row · T + column) in the group of the token each
      packed slot holds; 0 on empty slots.
    segment_ids: [R, W] int32, 1 + the sequence's rank within its packed row; 0 on empty
      slots.
    positions: [R, W] int32, the token's position within its sequence (0 on empty slots).
    dst: [Bg, T] int32, the flat index (packed row · W + slot) of each real token; 0 on
      padding.
    keep: [Bg, T] bool, real tokens that have a predecessor in their sequence: the columns
      whose next-token outputs ``unpack`` returns (the others get its ``fill``).
  """

  src: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  dst: jax.Array
  keep: jax.Array

  @property
  def mask(self) -> jax.Array:
    """[R, W] bool, True on slots that hold a real token."""
    return self.segment_ids > 0


def bucket_rows(n: int, cap: int) -> int:
  """``n`` rounded up to a bucket, at most ``cap``: 1–16 exactly, then 8 sizes per octave.

  Buckets are m · 2^j with 8 ≤ m < 16 (16, 18, ..., 30, 32, 36, ...): at most 12.5% of
  rows are added, and a run whose batches need 20–40 rows compiles at most 9 shapes.

  Args:
    n: ≥ 0 rows needed. cap: ≥ n, the most rows allowed (the unpacked row count).

  Returns:
    int in [n, cap] (at least 1).

  Raises:
    ValueError: n > cap.
  """
  if n > cap:
    raise ValueError(f"{n} packed rows exceed the cap {cap}")
  n = max(n, 1)
  step = 1 << max(0, n.bit_length() - 4)
  return min(-(-n // step) * step, cap)


def first_fit_decreasing(lengths: np.ndarray, width: int) -> np.ndarray:
  """Bin index of each item, first-fit-decreasing (Johnson 1973; ≤ 11/9·OPT + 6/9 bins).

  Items are taken longest first (ties in index order) and each goes into the first bin
  with room; zero-length items get bin -1.

  Args:
    lengths: [N] int, each in [0, width]. width: > 0, the bin capacity.

  Returns:
    [N] int64 bin per item; bins are numbered 0.. in order of opening.

  Raises:
    ValueError: an item longer than ``width`` or negative.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and (lengths.max() > width or lengths.min() < 0):
    raise ValueError(f"lengths must be in [0, {width}]; got [{lengths.min()}, {lengths.max()}]")
  fill = np.zeros(len(lengths), np.int64)
  n_bins = 0
  out = np.full(len(lengths), -1, np.int64)
  for i in np.argsort(-lengths, kind="stable"):
    if lengths[i] == 0:
      continue
    fits = np.flatnonzero(fill[:n_bins] + lengths[i] <= width)
    b = fits[0] if fits.size else n_bins
    n_bins += b == n_bins
    fill[b] += lengths[i]
    out[i] = b
  return out


def plan_packing(mask_bt: np.ndarray, rows: int | None = None) -> PackPlan:
  """The packing plan of one group (host numpy): its real tokens in ``rows`` rows of width T.

  Args:
    mask_bt: [Bg, T] bool, True on real tokens (any pattern: a row's real tokens are
      packed in order, so positions equal ``positions_from_mask``).
    rows: R, the packed rows (static shape); None: ``bucket_rows`` of the bins
      first-fit-decreasing needs, capped at Bg.

  Returns:
    PackPlan of numpy arrays (src, segment_ids, positions [R, T]; dst, keep [Bg, T]).

  Raises:
    ValueError: ``mask_bt`` not 2-D; ``rows`` fewer than the bins needed.
  """
  mask_bt = np.asarray(mask_bt, bool)
  if mask_bt.ndim != 2:
    raise ValueError(f"mask must be [B, T]; got shape {mask_bt.shape}")
  b, t = mask_bt.shape
  lengths = mask_bt.sum(1)
  bins = first_fit_decreasing(lengths, t)
  needed = int(bins.max()) + 1 if b else 0
  if rows is None:
    rows = bucket_rows(needed, max(b, 1))
  if rows < needed:
    raise ValueError(f"rows={rows} is fewer than the {needed} packed rows the batch needs")
  src = np.zeros((rows, t), np.int32)
  seg = np.zeros((rows, t), np.int32)
  pos = np.zeros((rows, t), np.int32)
  dst = np.zeros((b, t), np.int32)
  fill = np.zeros(rows, np.int64)
  count = np.zeros(rows, np.int32)
  for i in range(b):  # in row order within a bin: deterministic given the mask
    r, n = bins[i], lengths[i]
    if r < 0:
      continue
    cols = np.flatnonzero(mask_bt[i])
    o = fill[r]
    count[r] += 1
    src[r, o:o + n] = i * t + cols
    seg[r, o:o + n] = count[r]
    pos[r, o:o + n] = np.arange(n)
    dst[i, cols] = r * t + o + np.arange(n)
    fill[r] += n
  keep = mask_bt & (np.cumsum(mask_bt, 1) > 1)
  return PackPlan(src=src, segment_ids=seg, positions=pos, dst=dst, keep=keep)


def group_rows(batch_size: int, num_minibatches: int, grad_accum_steps: int) -> np.ndarray:
  """Row indices of each packing group, as the train step forms its micro-batches.

  Args:
    batch_size: B. num_minibatches: n_mb ≥ 1. grad_accum_steps: n_acc ≥ 1; n_mb · n_acc
      divides B.

  Returns:
    [n_mb, n_acc, B / (n_mb · n_acc)] int64: group (m, k) holds rows m·B/n_mb + k + j·n_acc.

  Raises:
    ValueError: n_mb · n_acc does not divide B.
  """
  if batch_size % (num_minibatches * grad_accum_steps):
    raise ValueError(f"batch of {batch_size} rows does not split into {num_minibatches} "
                     f"minibatches of {grad_accum_steps} micro-batches")
  rows = np.arange(batch_size).reshape(num_minibatches, -1, grad_accum_steps)
  return rows.swapaxes(1, 2)


def plan_groups(mask_bt: np.ndarray, num_minibatches: int = 1, grad_accum_steps: int = 1,
                rows: int | None = None, multiple: int = 1) -> PackPlan:
  """Packing plans of every group of the batch (``group_rows``), at one common R.

  Args:
    mask_bt: [B, T] bool attention mask of the whole batch. num_minibatches,
      grad_accum_steps: as ``group_rows``. rows: R, or None for ``bucket_rows`` of the
      largest group's bins (capped at the group size), rounded up to a multiple of
      ``multiple`` (the devices the packed rows split over, so each holds as many).

  Returns:
    PackPlan of numpy arrays with leading axes [n_mb, n_acc]: src, segment_ids,
    positions [n_mb, n_acc, R, T]; dst, keep [n_mb, n_acc, B/(n_mb·n_acc), T].

  Raises:
    ValueError: as ``group_rows`` and ``plan_packing``.
  """
  mask_bt = np.asarray(mask_bt, bool)
  idx = group_rows(mask_bt.shape[0], num_minibatches, grad_accum_steps)
  groups = [mask_bt[g] for g in idx.reshape(-1, idx.shape[-1])]
  if rows is None:
    t = mask_bt.shape[1]
    needed = max(int(first_fit_decreasing(g.sum(1), t).max()) + 1 for g in groups)
    rows = bucket_rows(needed, idx.shape[-1])
    rows = -(-rows // multiple) * multiple
  plans = [plan_packing(g, rows) for g in groups]
  return jax.tree.map(lambda *xs: np.stack(xs).reshape(*idx.shape[:2], *xs[0].shape), *plans)


def to_groups(tree, num_minibatches: int, grad_accum_steps: int):
  """Leaves [B, ...] -> [n_mb · n_acc, B/(n_mb·n_acc), ...], the groups of ``group_rows``.

  Traceable; None leaves pass through. ``from_groups`` inverts.
  """
  def split(x):
    b = x.shape[0]
    x = x.reshape(num_minibatches, b // (num_minibatches * grad_accum_steps),
                  grad_accum_steps, *x.shape[1:]).swapaxes(1, 2)
    return x.reshape(num_minibatches * grad_accum_steps, -1, *x.shape[3:])
  return jax.tree.map(split, tree)


def from_groups(tree, num_minibatches: int, grad_accum_steps: int):
  """Inverse of ``to_groups``: leaves [n_mb · n_acc, Bg, ...] -> [B, ...] in row order."""
  def merge(x):
    x = x.reshape(num_minibatches, grad_accum_steps, *x.shape[1:]).swapaxes(1, 2)
    return x.reshape(-1, *x.shape[3:])
  return jax.tree.map(merge, tree)


def pack(x_bt: jax.Array, plan: PackPlan) -> jax.Array:
  """The group's per-token array in packed layout (a gather; traceable).

  Args:
    x_bt: [Bg, T, ...] any dtype. plan: one group's plan (no leading group axes).

  Returns:
    [R, W, ...] same dtype; empty slots hold ``x_bt[0, 0]``.
  """
  flat = x_bt.reshape(-1, *x_bt.shape[2:])
  return flat[plan.src]


def unpack(y_rw: jax.Array, plan: PackPlan, fill=0) -> jax.Array:
  """Packed next-token outputs back in the group's [Bg, T] layout (a gather; traceable).

  Column t of a row gets the packed output at its token's slot where ``plan.keep``
  (a real token with a predecessor: the output that predicted it), else ``fill``.
  The gradient with respect to ``y_rw`` is the scatter-add of the cotangent.

  Args:
    y_rw: [R, W, ...] any dtype. plan: one group's plan. fill: scalar for the other columns.

  Returns:
    [Bg, T, ...] same dtype.
  """
  flat = y_rw.reshape(-1, *y_rw.shape[2:])
  out = flat[plan.dst]
  keep = plan.keep.reshape(plan.keep.shape + (1,) * (out.ndim - 2))
  return jnp.where(keep, out, jnp.asarray(fill, out.dtype))


def padding_fraction(plan: PackPlan) -> float:
  """Empty slots ÷ all slots of the packed arrays (host float; any leading group axes)."""
  seg = np.asarray(plan.segment_ids)
  return float((seg == 0).mean())
