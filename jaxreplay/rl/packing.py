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

The learner's batch is planned whole (``plan_batch``): each minibatch's sequences are
packed together, first-fit-decreasing, and the packed rows are split into S accumulation
steps of R rows each, with R at most the rows a micro-batch holds unpacked. A step holds
whole sequences, so its padding is the one-micro-batch plan's up to the rounding of R.
Its rows may be narrower than T (``pack_width``): when R must be a multiple of the batch
devices, a few sequences more than fill whole rows would add a device's worth of empty
rows, and rows of width W < T (a multiple of ``WIDTH_QUANTUM``, at least the longest
sequence) that hold them in fewer slots are taken instead. The gradient-free scoring
passes, which take fixed rows at a time, pack each pass's rows at width T
(``plan_groups``).

Given the completion masks, a learner plan also lists the completion slots
(``add_score_slots``), the only ones whose log-probs a loss reads, so the output head runs on
those alone; with ``share_prompts`` the rows of a minibatch that share a prompt are packed as
one unit, the prompt once and then each completion (``shared_units``, ``place_units``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

SCORE_FRACTIONS = 8
"""The scored slots of a block of packed rows (``PackPlan.score_slot``) are kept in a
multiple of 1/8 of the block's slots: at most 8 counts per plan shape, at most 1/8 padded."""

WIDTH_QUANTUM = 64
"""Packed learner rows are T wide or a multiple of this many tokens (``pack_width``): a
block of GPU flash attention and half a TPU lane tile, and few enough widths that a run
compiles a handful of shapes (four over 20 lognormal batches of bench/compiled_invariants.py
at T = 1,408)."""


@flax.struct.dataclass
class PackPlan:
  """Where each real token of a [Bg, T] group goes in its packed [R, W] rows (W ≤ T).

  A plan may pack only some of the group's sequences (one accumulation step of
  ``plan_batch``): ``dst`` and ``keep`` then cover those alone. Leaves may carry leading
  axes (``plan_batch``: [n_mb, S, ...]; ``plan_groups``: [n_mb, n_acc, ...]).

  Attributes:
    src: [R, W] int32, the flat index (row · T + column) in the group of the token each
      packed slot holds; 0 on empty slots.
    segment_ids: [R, W] int32, 1 + the sequence's rank within its packed row; 0 on empty
      slots.
    positions: [R, W] int32, the token's position within its sequence (0 on empty slots).
    dst: [Bg, T] int32, the flat index (packed row · W + slot) of each real token the plan
      packs; 0 elsewhere.
    keep: [Bg, T] bool, real tokens the plan packs that have a predecessor in their
      sequence: the columns whose next-token outputs ``unpack`` returns (the others get its
      ``fill``).
    prefix_ids: [R, W] int32 or None: with shared prompts (``plan_batch(share_prompts=
      True)``), the segment each token may attend to besides its own: a completion's
      prompt (its own segment for a prompt token); 0 on empty slots. None: segments alone.
    score_slot: [G, N] int32 or None: the slots of the tokens whose log-probs the loss
      reads (``plan_batch(completion_bt=...)``: completion tokens), in order, for each of
      G blocks of R / G consecutive rows: flat indices r · W + s within the block (r the
      row in the block); 0 past a block's count (``add_score_slots``).
    score_pred: [G, N] int32 or None: the slot (flat, as ``score_slot``) of the hidden
      state that predicts each ``score_slot`` token: the slot before it, or for a
      completion's first token under a shared prompt, the prompt's last slot.
    score_valid: [G, N] bool or None: True on a block's first count entries.
  """

  src: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  dst: jax.Array
  keep: jax.Array
  prefix_ids: jax.Array | None = None
  score_slot: jax.Array | None = None
  score_pred: jax.Array | None = None
  score_valid: jax.Array | None = None

  @property
  def mask(self) -> jax.Array:
    """[R, W] bool, True on slots that hold a real token."""
    return self.segment_ids > 0


class PlanShape(NamedTuple):
  """The static shape of a learner plan (``plan_batch``): what its jitted update compiles.

  Attributes:
    steps: S, accumulation steps. rows: R, packed rows per step. width: W, the row width
      in tokens. scored: N, scored slots per block (0: the plan lists none). groups: G,
      the blocks of R / G rows (the batch devices).
  """
  steps: int
  rows: int
  width: int
  scored: int = 0
  groups: int = 1

  @property
  def cost(self) -> int:
    """S · (R · W + G · N): the slots the trunk runs plus the slots the output head runs
    on, over the S steps (a proxy of the update's work, in token slots)."""
    return self.steps * (self.rows * self.width + self.groups * self.scored)


def plan_shape(plan: PackPlan) -> PlanShape:
  """The ``PlanShape`` of a ``plan_batch`` plan: the static shape its update compiles for.

  Args:
    plan: PackPlan with ``src`` [n_mb, S, R, W] and, where it lists scored slots,
      ``score_slot`` [n_mb, S, G, N] (numpy or jax arrays; only shapes are read).

  Returns:
    PlanShape(S, R, W, N, G); N = 0 and G = 1 without scored slots.
  """
  *_, steps, rows, width = np.shape(plan.src)
  if plan.score_slot is None:
    return PlanShape(steps, rows, width)
  *_, groups, scored = np.shape(plan.score_slot)
  return PlanShape(steps, rows, width, scored, groups)


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


def place_bins(mask_bt: np.ndarray, bins: np.ndarray, steps: int, rows: int,
               width: int | None = None) -> PackPlan:
  """The plans of ``steps`` packing steps of ``rows`` rows: bin j is row j mod R of step j // R.

  Each sequence's real tokens are placed, in order, into its bin; a bin's sequences follow
  one another in row order (deterministic given the mask and the bins).

  Args:
    mask_bt: [Bg, T] bool, True on real tokens. bins: [Bg] int, each row's bin
      (``first_fit_decreasing`` of its length; -1 for a row without real tokens), every
      bin's lengths summing to at most W. steps: S ≥ 1. rows: R ≥ 1. width: W, the packed
      row width (None: T).

  Returns:
    PackPlan of numpy arrays with a leading [S] axis: src, segment_ids, positions
    [S, R, W]; dst, keep [S, Bg, T], ``keep`` True only on the tokens of that step's rows.

  Raises:
    ValueError: a bin ≥ S · R; a bin's sequences longer than W.
  """
  b, t = mask_bt.shape
  w = t if width is None else int(width)
  bins = np.asarray(bins, np.int64)
  if b and bins.max() >= steps * rows:
    raise ValueError(f"bin {bins.max()} does not fit {steps} steps of {rows} rows")
  lengths = mask_bt.sum(1)
  load = np.bincount(bins[bins >= 0], lengths[bins >= 0], minlength=1)
  if load.max() > w:
    raise ValueError(f"bin {int(load.argmax())} holds {int(load.max())} tokens, more than "
                     f"the row width {w}")
  src = np.zeros((steps, rows, w), np.int32)
  seg = np.zeros((steps, rows, w), np.int32)
  pos = np.zeros((steps, rows, w), np.int32)
  dst = np.zeros((steps, b, t), np.int32)
  keep = np.zeros((steps, b, t), bool)
  predicted = mask_bt & (np.cumsum(mask_bt, 1) > 1)
  fill = np.zeros((steps, rows), np.int64)
  count = np.zeros((steps, rows), np.int32)
  for i in range(b):
    if bins[i] < 0:
      continue
    s, r = divmod(int(bins[i]), rows)
    n, o = lengths[i], fill[s, r]
    cols = np.flatnonzero(mask_bt[i])
    count[s, r] += 1
    src[s, r, o:o + n] = i * t + cols
    seg[s, r, o:o + n] = count[s, r]
    pos[s, r, o:o + n] = np.arange(n)
    dst[s, i, cols] = r * w + o + np.arange(n)
    keep[s, i] = predicted[i]
    fill[s, r] += n
  return PackPlan(src=src, segment_ids=seg, positions=pos, dst=dst, keep=keep)


def plan_packing(mask_bt: np.ndarray, rows: int | None = None,
                 width: int | None = None) -> PackPlan:
  """The packing plan of one group (host numpy): its real tokens in ``rows`` rows of width W.

  Args:
    mask_bt: [Bg, T] bool, True on real tokens (any pattern: a row's real tokens are
      packed in order, so positions equal ``positions_from_mask``).
    rows: R, the packed rows (static shape); None: ``bucket_rows`` of the bins
      first-fit-decreasing needs, capped at Bg.
    width: W, at least the longest sequence (None: T).

  Returns:
    PackPlan of numpy arrays (src, segment_ids, positions [R, W]; dst, keep [Bg, T]).

  Raises:
    ValueError: ``mask_bt`` not 2-D; ``rows`` fewer than the bins needed; a sequence
      longer than ``width``.
  """
  mask_bt = np.asarray(mask_bt, bool)
  if mask_bt.ndim != 2:
    raise ValueError(f"mask must be [B, T]; got shape {mask_bt.shape}")
  b, t = mask_bt.shape
  width = t if width is None else int(width)
  bins = first_fit_decreasing(mask_bt.sum(1), width)
  needed = int(bins.max()) + 1 if b else 0
  if rows is None:
    rows = bucket_rows(needed, max(b, 1))
  if rows < needed:
    raise ValueError(f"rows={rows} is fewer than the {needed} packed rows the batch needs")
  return jax.tree.map(lambda x: x[0], place_bins(mask_bt, bins, 1, rows, width))


def prompt_split(mask_bt: np.ndarray, completion_bt: np.ndarray) -> np.ndarray:
  """[Bg] int: each row's first completion column (T where the row has none): its real
  tokens before it are the prompt."""
  completion_bt = np.asarray(completion_bt, bool)
  return np.where(completion_bt.any(1), completion_bt.argmax(1), mask_bt.shape[1])


def shared_units(mask_bt: np.ndarray, completion_bt: np.ndarray, tokens_bt: np.ndarray,
                 width: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
  """The rows grouped into units that share one copy of their prompt (host numpy).

  Rows whose prompt tokens are equal (a GRPO group's G samples) form one unit, laid out
  as the prompt once, then each row's completion (``place_units``); a unit longer than
  ``width`` is split, in row order, into units that fit. A row without completion
  tokens is a unit alone; a row without real tokens is in none.

  Args:
    mask_bt: [Bg, T] bool real tokens. completion_bt: [Bg, T] bool completion tokens (a
      row's real tokens before its first one are its prompt). tokens_bt: [Bg, T] int.
    width: > 0, the most tokens a unit may hold (every sequence fits alone).

  Returns:
    (units: tuples of row indices, the first one's prompt tokens laid out for all, in
     order of each unit's first row; lengths [U] int64, prompt + completions per unit).
  """
  mask_bt = np.asarray(mask_bt, bool)
  split = prompt_split(mask_bt, completion_bt)
  cols = np.arange(mask_bt.shape[1])
  groups: dict = {}
  for i in np.flatnonzero(mask_bt.any(1)):
    prompt = mask_bt[i] & (cols < split[i])
    key = (tokens_bt[i][prompt].tobytes() if split[i] < mask_bt.shape[1] else ("alone", i))
    groups.setdefault(key, []).append(int(i))
  units, lengths = [], []
  for rows in groups.values():
    p = int((mask_bt[rows[0]] & (cols < split[rows[0]])).sum())
    unit, n = [], p
    for i in rows:
      c = int((mask_bt[i] & (cols >= split[i])).sum())
      if unit and n + c > width:
        units.append(tuple(unit))
        lengths.append(n)
        unit, n = [], p
      unit.append(i)
      n += c
    units.append(tuple(unit))
    lengths.append(n)
  order = np.argsort([u[0] for u in units], kind="stable")
  return [units[k] for k in order], np.asarray(lengths, np.int64)[order]


def place_units(mask_bt: np.ndarray, completion_bt: np.ndarray, units, bins: np.ndarray,
                steps: int, rows: int, width: int) -> tuple[PackPlan, np.ndarray]:
  """``place_bins`` for ``shared_units``: each unit's prompt once, then its completions.

  In a unit's run of slots the prompt (the first row's prompt tokens) is one segment and
  each completion another whose ``prefix_ids`` name the prompt's segment, so a
  completion token attends to the prompt and to its own earlier tokens, never to a
  sibling's; its positions continue from the prompt's length, as in its unpacked row.
  Every row of the unit maps its prompt columns to the shared prompt's slots (``dst``).
  The attention each completion sees is its unpacked row's, so its log-probs equal the
  unpacked ones up to float rounding.

  Args:
    mask_bt, completion_bt: [Bg, T] bool. units: ``shared_units``'s. bins: [U] int, each
      unit's bin (-1: none). steps: S ≥ 1. rows: R ≥ 1. width: W.

  Returns:
    (PackPlan of numpy arrays with a leading [S] axis and ``prefix_ids``;
     pred [S, R, W] int32: the slot (within the row) of the hidden state that predicts
     each slot's token, -1 for none).

  Raises:
    ValueError: a bin ≥ S · R or holding more than W tokens.
  """
  mask_bt = np.asarray(mask_bt, bool)
  b, t = mask_bt.shape
  w = int(width)
  bins = np.asarray(bins, np.int64)
  if bins.size and bins.max() >= steps * rows:
    raise ValueError(f"bin {bins.max()} does not fit {steps} steps of {rows} rows")
  split = prompt_split(mask_bt, completion_bt)
  src = np.zeros((steps, rows, w), np.int32)
  seg = np.zeros((steps, rows, w), np.int32)
  pre = np.zeros((steps, rows, w), np.int32)
  pos = np.zeros((steps, rows, w), np.int32)
  pred = np.full((steps, rows, w), -1, np.int32)
  dst = np.zeros((steps, b, t), np.int32)
  keep = np.zeros((steps, b, t), bool)
  predicted = mask_bt & (np.cumsum(mask_bt, 1) > 1)
  fill = np.zeros((steps, rows), np.int64)
  count = np.zeros((steps, rows), np.int32)
  for unit, bin_ in zip(units, bins):
    if bin_ < 0:
      continue
    s, r = divmod(int(bin_), rows)
    real = np.flatnonzero(mask_bt[unit[0]])
    pcols = real[real < split[unit[0]]]
    p, o = len(pcols), int(fill[s, r])
    lengths = [p] + [int((np.flatnonzero(mask_bt[i]) >= split[i]).sum()) for i in unit]
    if o + sum(lengths) > w:
      raise ValueError(f"bin {int(bin_)} holds {o + sum(lengths)} tokens, more than the row "
                       f"width {w}")
    count[s, r] += 1
    prompt_seg = count[s, r]
    sl = slice(o, o + p)
    src[s, r, sl], seg[s, r, sl], pre[s, r, sl] = unit[0] * t + pcols, prompt_seg, prompt_seg
    pos[s, r, sl] = np.arange(p)
    pred[s, r, sl] = np.where(np.arange(p) > 0, np.arange(o - 1, o + p - 1), -1)
    prompt_slots, start = r * w + o + np.arange(p), o
    o += p
    for i in unit:
      real = np.flatnonzero(mask_bt[i])
      dst[s, i, real[real < split[i]]] = prompt_slots
      keep[s, i] = predicted[i]
      ccols = real[real >= split[i]]
      n = len(ccols)
      if not n:
        continue
      count[s, r] += 1
      sl = slice(o, o + n)
      src[s, r, sl], seg[s, r, sl], pre[s, r, sl] = i * t + ccols, count[s, r], prompt_seg
      pos[s, r, sl] = p + np.arange(n)
      pred[s, r, sl] = np.arange(o - 1, o + n - 1)
      pred[s, r, o] = start + p - 1 if p else -1  # the shared prompt's last token
      dst[s, i, ccols] = r * w + o + np.arange(n)
      o += n
    fill[s, r] = o
  plan = PackPlan(src=src, segment_ids=seg, positions=pos, dst=dst, keep=keep, prefix_ids=pre)
  return plan, pred


def add_score_slots(plan: PackPlan, completion: np.ndarray, pred: np.ndarray | None = None,
                    groups: int = 1, fractions: int = SCORE_FRACTIONS,
                    slots: int | None = None) -> PackPlan:
  """``plan`` with ``score_slot``/``score_pred``/``score_valid``: the completion tokens of
  its packed rows, the only ones whose log-probs the loss reads.

  The learner then runs the output head and the log-softmax on those slots alone
  (``scoring.packed_scores``), not on every slot: a prompt token's next-token
  distribution feeds no loss term. The R rows are taken in ``groups`` blocks of R / G
  consecutive rows (the blocks the batch devices hold, ``sharding.place_rows``) and each
  block's scored slots are listed flat, so only the last entries of a block are padding.

  Args:
    plan: PackPlan of numpy arrays with leaves [..., R, W] / [..., Bg, T] (any leading
      axes).
    completion: [..., Bg, T] bool, the completion tokens of the plan's rows (leading axes
      broadcast against the plan's: [n_mb, 1, Bg, T] for ``plan_batch``'s [n_mb, S]).
    pred: [..., R, W] int, the predicting slot (within its row) of each slot (-1: none);
      None: the slot before it within the same sequence (``positions`` > 0).
    groups: G ≥ 1, dividing R.
    fractions: > 0; N, the entries per block, is the most scored slots of any block
      rounded up to a multiple of (R / G) · W / ``fractions``: at most that many values of
      N per plan shape (a run compiles few shapes), at most that fraction padded.
    slots: N itself (a compiled shape's, ``plan_batch(shape=...)``), or None as above.

  Returns:
    The plan with the three fields, [..., G, N]: flat slot indices r · W + s within the
    block (r its row in the block), 0 and False past a block's count.

  Raises:
    ValueError: ``groups`` does not divide R; a block has more than ``slots`` scored
      slots, or ``slots`` exceeds the block's slots.
  """
  src = np.asarray(plan.src)
  *lead, r, w = src.shape
  if r % groups:
    raise ValueError(f"groups={groups} must divide the {r} packed rows")
  comp = np.asarray(completion, bool)
  flat = np.broadcast_to(comp.reshape(*comp.shape[:-2], -1),
                         (*lead, comp.shape[-2] * comp.shape[-1]))
  scored = np.take_along_axis(flat, src.reshape(*lead, -1), -1).reshape(src.shape)
  if pred is None:
    pred = np.where(np.asarray(plan.positions) > 0, np.arange(w) - 1, -1)
  scored &= (np.asarray(plan.segment_ids) > 0) & (pred >= 0)
  block = (r // groups) * w
  row0 = (np.arange(r) % (r // groups) * w)[:, None]  # each row's first slot in its block
  pred = np.where(pred >= 0, pred + row0, -1).reshape(*lead, groups, block)
  scored = scored.reshape(*lead, groups, block)
  most = int(scored.sum(-1).max()) if scored.size else 0
  n = min(block, round_up(max(most, 1), max(1, -(-block // fractions))))
  if slots is not None:
    if not most <= slots <= block:
      raise ValueError(f"scored={slots} must hold the {most} scored slots of a block and "
                       f"be at most its {block} slots")
    n = int(slots)
  order = np.argsort(~scored, axis=-1, kind="stable")[..., :n]  # scored slots first, in order
  valid = np.take_along_axis(scored, order, -1)
  return plan.replace(score_slot=np.where(valid, order, 0).astype(np.int32),
                      score_pred=np.where(valid, np.take_along_axis(pred, order, -1),
                                          0).astype(np.int32),
                      score_valid=valid)


def round_up(n: int, multiple: int) -> int:
  """The least multiple of ``multiple`` (≥ 1) that is ≥ ``n``."""
  return -(-n // multiple) * multiple


def step_shape(needed: int, budget: int, multiple: int = 1) -> tuple[int, int]:
  """(S, R): the accumulation steps and packed rows per step for ``needed`` packed rows.

  S = ⌈needed / budget⌉ (at least 1) is the fewest steps of at most ``budget`` rows; R is
  ``bucket_rows`` of ⌈needed / S⌉ (capped at ``budget``), rounded up to a multiple of
  ``multiple``. So S · R ≥ needed, R ≤ budget, and S · R < needed + S · (⌈needed / S⌉ / 8
  + multiple) (``bucket_rows`` adds at most an eighth; the rounding under ``multiple``).
  With S = 1 R is at most the one-micro-batch plan's row count, and equal to it when
  ``budget`` is at least the minibatch's rows.

  Args:
    needed: ≥ 0 rows (first-fit-decreasing bins). budget: ≥ 1 rows a step may hold, a
      multiple of ``multiple``. multiple: ≥ 1 (the devices a step's rows split over).

  Returns:
    (S, R) ints ≥ 1.

  Raises:
    ValueError: ``budget`` < 1 or not a multiple of ``multiple``.
  """
  needed, budget, multiple = int(needed), int(budget), int(multiple)
  if budget < 1 or budget % multiple:
    raise ValueError(f"budget={budget} must be a positive multiple of {multiple}")
  steps = max(1, -(-needed // budget))
  return steps, round_up(bucket_rows(-(-needed // steps), budget), multiple)


def pack_width(lengths: np.ndarray, width: int, budget: int, multiple: int = 1,
               quantum: int = WIDTH_QUANTUM) -> tuple[int, list[np.ndarray], int, int]:
  """The packed row width W, bins and step shape that hold the minibatches in fewest slots.

  W is T or a multiple of ``quantum`` below it, at least the longest sequence. For each
  such W the minibatches are packed first-fit-decreasing into bins of width W and
  ``step_shape`` gives (S, R) for the most bins any minibatch needs; the W with the fewest
  slots S · R · W wins, ties going to the wider (T first). A narrower row only wins where
  its extra rows are cheaper than the empty rows rounding to ``multiple`` adds at width T,
  so the padding is at most the width-T plan's. Widths that cannot beat the best so far
  (⌈tokens / W⌉ rows rounded up to ``multiple``) are not packed.

  Args:
    lengths: [n_mb, Bm] int, each sequence's real tokens, in [0, width]. width: T > 0.
    budget, multiple: as ``step_shape``. quantum: > 0 tokens.

  Returns:
    (W, bins, S, R): ints and the [Bm] int64 bins (``first_fit_decreasing``) of each
    minibatch at width W.

  Raises:
    ValueError: ``quantum`` ≤ 0; as ``step_shape`` and ``first_fit_decreasing``.
  """
  if quantum <= 0:
    raise ValueError(f"quantum={quantum} must be > 0")
  lengths = np.asarray(lengths, np.int64).reshape(-1, np.shape(lengths)[-1])
  longest = int(lengths.max()) if lengths.size else 0
  most_tokens = int(lengths.sum(1).max()) if lengths.size else 0
  best = None
  for w in [width] + list(range(round_up(max(longest, 1), quantum), width, quantum))[::-1]:
    if best is not None:
      floor = round_up(-(-most_tokens // w), multiple) * w
      if floor >= best[0]:
        continue
    bins = [first_fit_decreasing(m, w) for m in lengths]
    needed = max(int(x.max()) + 1 if x.size else 0 for x in bins)
    steps, rows = step_shape(needed, budget, multiple)
    if best is None or steps * rows * w < best[0]:
      best = (steps * rows * w, w, bins, steps, rows)
  return best[1:]


def fixed_width(lengths: np.ndarray, shape: PlanShape,
                multiple: int = 1) -> tuple[int, list[np.ndarray], int, int]:
  """``pack_width``'s result at a given shape's W, S and R (a compiled shape reused).

  Args:
    lengths: [n_mb, Bm] int, each sequence's (or unit's) real tokens. shape: the S, R
      and W to pack into. multiple: ≥ 1, must divide R.

  Returns:
    (W, bins, S, R), as ``pack_width``.

  Raises:
    ValueError: R not a multiple of ``multiple``; a sequence longer than W; a minibatch
      needing more than S · R rows of width W.
  """
  if shape.rows % multiple:
    raise ValueError(f"shape rows={shape.rows} must be a multiple of {multiple}")
  lengths = np.asarray(lengths, np.int64).reshape(-1, np.shape(lengths)[-1])
  bins = [first_fit_decreasing(m, shape.width) for m in lengths]
  needed = max(int(x.max()) + 1 if x.size else 0 for x in bins)
  if needed > shape.steps * shape.rows:
    raise ValueError(f"the batch needs {needed} packed rows of width {shape.width}; the "
                     f"shape holds {shape.steps} steps of {shape.rows}")
  return shape.width, bins, shape.steps, shape.rows


def plan_batch(mask_bt: np.ndarray, num_minibatches: int = 1, grad_accum_steps: int = 1,
               multiple: int = 1, quantum: int = WIDTH_QUANTUM,
               completion_bt: np.ndarray | None = None, tokens_bt: np.ndarray | None = None,
               share_prompts: bool = False, shape: PlanShape | None = None) -> PackPlan:
  """The learner batch's packing plan: each minibatch packed whole, split into S steps.

  Minibatch m is rows [m·B/n_mb, (m+1)·B/n_mb), as the train step takes them. Its
  sequences are packed first-fit-decreasing into bins of width W and the bins split into
  S accumulation steps of R rows (``pack_width``: W ≤ T, S and R common to the
  minibatches, from the largest bin count): bin j is row j mod R of step j // R. A step's
  budget is the rows a micro-batch holds unpacked, B / (n_mb · n_acc) rounded up to
  ``multiple``, so a step never holds more tokens than an unpacked micro-batch, and
  S ≤ n_acc.

  What the plan guarantees:
    * every real token of the batch is packed once, in exactly one step of its minibatch,
      and a sequence's tokens are all in one step and one packed row: a step holds whole
      sequences. This is what the per-sequence terms need: the sequence-mean aggregations
      (``losses.aggregate``'s ``seq_mean_token_mean``, GRPO, Shao et al. 2024, arXiv
      2402.03300 eq. 3) and GSPO's sequence ratio s_i = exp((1/|y_i|) Σ_t log π/μ)
      (Zheng et al. 2025, arXiv 2507.18071 §4.1) read all of a sequence's tokens at once.
      The normaliser stays a statistic of the whole minibatch (``losses.
      aggregate_normaliser``), passed to each step; the steps' losses then sum to the
      minibatch's in every aggregation mode.
    * with n_acc = 1 (S = 1) the plan is the one-micro-batch plan at its width
      (``plan_groups(mask, n_mb, 1, multiple=multiple, width=W)``, the same bins, rows and
      slots); with n_acc > 1, S = 1 whenever the minibatch fits one step's budget, and its
      R is then at most that plan's.
    * padding: S · R rows hold what the one-micro-batch plan's R₁ rows hold at width W,
      with S · R < needed + S · (⌈needed / S⌉ / 8 + multiple) and R₁ ≥ needed
      (``step_shape``); and S · R · W is at most the width-T plan's slots.
    * static shapes: S ≤ n_acc, R takes ``bucket_rows`` values and W is T or a multiple of
      ``quantum``, so a run compiles a bounded number of (S, R, W) shapes; R is a multiple
      of ``multiple``, so every step's rows split evenly over the batch devices
      (``sharding.place_rows``).

  With ``completion_bt`` the plan also lists each row's completion slots
  (``add_score_slots``): the learner scores those alone. With ``share_prompts`` (and
  ``tokens_bt``) the rows of a minibatch whose prompts are equal are packed as one unit,
  the prompt once and then each completion (``shared_units``, ``place_units``): a group
  of G samples of a P-token prompt runs P + Σ completions tokens, not G·P + Σ
  completions, with the same attention per completion (``PackPlan.prefix_ids``). The
  units take the place of sequences above: whole units per step and row.

  With ``shape`` (a shape the update has compiled, ``PlanShape``) the batch is packed at
  its W into its S steps of R rows and N scored slots instead of the fewest slots: whole
  sequences per step and row as above and the same per-token outputs, with more empty
  slots (a later step may hold none).

  Args:
    mask_bt: [B, T] bool attention mask of the whole batch. num_minibatches: n_mb ≥ 1.
    grad_accum_steps: n_acc ≥ 1; n_mb · n_acc divides B. multiple: ≥ 1. quantum: the
      width step of ``pack_width`` (a quantum ≥ T keeps W = T).
    completion_bt: optional [B, T] bool completion tokens (``Rollout.completion_mask``).
    tokens_bt: [B, T] int tokens, needed with ``share_prompts``.
    share_prompts: pack equal prompts once per unit (needs ``completion_bt``).
    shape: optional ``PlanShape`` to pack into (its ``groups`` must be ``multiple``, its
      ``scored`` 0 exactly when ``completion_bt`` is None).

  Returns:
    PackPlan of numpy arrays with leading axes [n_mb, S]: src, segment_ids, positions
    [n_mb, S, R, W]; dst, keep [n_mb, S, B/n_mb, T] (a step's ``dst`` and ``keep`` cover
    its own sequences; ``merge_steps`` joins the steps' outputs); with ``completion_bt``
    score_slot, score_pred, score_valid [n_mb, S, G, N] (G = ``multiple``); shared, prefix_ids [n_mb, S, R, W].

  Raises:
    ValueError: ``mask_bt`` not 2-D; n_mb · n_acc does not divide B; ``share_prompts``
      without ``completion_bt`` and ``tokens_bt``; the batch does not fit ``shape``
      (``fixed_width``, ``add_score_slots``).
  """
  mask_bt = np.asarray(mask_bt, bool)
  if mask_bt.ndim != 2:
    raise ValueError(f"mask must be [B, T]; got shape {mask_bt.shape}")
  b, t = mask_bt.shape
  if b % (num_minibatches * grad_accum_steps):
    raise ValueError(f"batch of {b} rows does not split into {num_minibatches} "
                     f"minibatches of {grad_accum_steps} micro-batches")
  split = lambda x: np.asarray(x).reshape(num_minibatches, b // num_minibatches, t)  # noqa: E731
  minibatches = split(mask_bt)
  budget = round_up(max(b // (num_minibatches * grad_accum_steps), 1), multiple)
  if shape is not None and (shape.groups != multiple
                            or (shape.scored > 0) != (completion_bt is not None)):
    raise ValueError(f"shape {shape} does not match multiple={multiple} and "
                     f"{'a' if completion_bt is not None else 'no'} completion mask")
  layout = (functools.partial(pack_width, width=t, budget=budget, multiple=multiple,
                              quantum=quantum) if shape is None
            else functools.partial(fixed_width, shape=shape, multiple=multiple))
  scored = None if shape is None else shape.scored
  if share_prompts:
    if completion_bt is None or tokens_bt is None:
      raise ValueError("share_prompts needs completion_bt and tokens_bt")
    comp, toks = split(completion_bt), split(tokens_bt)
    units = [shared_units(m, c, k, t) for m, c, k in zip(minibatches, comp, toks)]
    lengths = np.zeros((num_minibatches, max(len(u[0]) for u in units)), np.int64)
    for j, (_, n) in enumerate(units):
      lengths[j, :len(n)] = n
    width, bins, steps, rows = layout(lengths)
    placed = [place_units(m, c, u, x[:len(u)], steps, rows, width)
              for m, c, (u, _), x in zip(minibatches, comp, units, bins)]
    plan = jax.tree.map(lambda *xs: np.stack(xs), *[p for p, _ in placed])
    return add_score_slots(plan, comp[:, None], np.stack([r for _, r in placed]),
                           groups=multiple, slots=scored)
  width, bins, steps, rows = layout(minibatches.sum(2))
  plans = [place_bins(m, x, steps, rows, width) for m, x in zip(minibatches, bins)]
  plan = jax.tree.map(lambda *xs: np.stack(xs), *plans)
  if completion_bt is None:
    return plan
  return add_score_slots(plan, split(completion_bt)[:, None], groups=multiple, slots=scored)


def step_rows(plan: PackPlan) -> jax.Array:
  """[..., Bg] bool: the rows whose sequences a step's plan packs (any leading axes).

  A row counts when it has a token with a predecessor in the step (``keep``): a sequence
  of one real token has no next-token output to train on, in any step.
  """
  return plan.keep.any(-1)


def merge_steps(tree, plan: PackPlan):
  """The steps' unpacked outputs joined: each token's value from the step that packs it.

  Traceable; None leaves pass through.

  Args:
    tree: pytree of [S, Bg, T, ...] arrays, step s's outputs (``unpack`` with ``plan``'s
      step s). plan: PackPlan with leaves [S, ...] (``plan_batch``'s plans of one
      minibatch).

  Returns:
    The pytree with leaves [Bg, T, ...]: at each ``keep`` column the value of the one step
    that packs it, 0 elsewhere (where ``unpack``'s default fill puts 0).
  """
  def merge(x):
    keep = plan.keep.reshape(plan.keep.shape + (1,) * (x.ndim - 3))
    return jnp.where(keep, x, jnp.zeros((), x.dtype)).sum(0)
  return jax.tree.map(merge, tree)


def group_rows(batch_size: int, num_minibatches: int, grad_accum_steps: int) -> np.ndarray:
  """Row indices of each packing group of ``plan_groups``: minibatch m's rows split as
  ``scoring.micro_batches`` splits them.

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
                rows: int | None = None, multiple: int = 1,
                width: int | None = None) -> PackPlan:
  """Packing plans of every group of the batch (``group_rows``), at one common R.

  Each group is packed on its own: for passes that take fixed rows at a time (the
  gradient-free scoring of ``scoring.plan_rows``). The learner plans with ``plan_batch``.

  Args:
    mask_bt: [B, T] bool attention mask of the whole batch. num_minibatches,
      grad_accum_steps: as ``group_rows``. rows: R, or None for ``bucket_rows`` of the
      largest group's bins (capped at the group size), rounded up to a multiple of
      ``multiple`` (the devices the packed rows split over, so each holds as many).
    width: W, the packed row width, at least the longest sequence (None: T).

  Returns:
    PackPlan of numpy arrays with leading axes [n_mb, n_acc]: src, segment_ids,
    positions [n_mb, n_acc, R, W]; dst, keep [n_mb, n_acc, B/(n_mb·n_acc), T].

  Raises:
    ValueError: as ``group_rows`` and ``plan_packing``.
  """
  mask_bt = np.asarray(mask_bt, bool)
  idx = group_rows(mask_bt.shape[0], num_minibatches, grad_accum_steps)
  groups = [mask_bt[g] for g in idx.reshape(-1, idx.shape[-1])]
  width = mask_bt.shape[1] if width is None else int(width)
  if rows is None:
    needed = max(int(first_fit_decreasing(g.sum(1), width).max()) + 1 for g in groups)
    rows = round_up(bucket_rows(needed, idx.shape[-1]), multiple)
  plans = [plan_packing(g, rows, width) for g in groups]
  return jax.tree.map(lambda *xs: np.stack(xs).reshape(*idx.shape[:2], *xs[0].shape), *plans)


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
