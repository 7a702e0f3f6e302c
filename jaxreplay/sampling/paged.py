"""Paged KV cache: a host-side page pool and decode attention over pages (xla or Pallas).

Layout (per layer; what both JAX Pallas paged-attention kernels take, see their
``paged_attention`` signatures in ``jax.experimental.pallas.ops.{gpu,tpu}``):

- ``k_pages``, ``v_pages``: [K, N, page_size, E] in the activation dtype, K KV heads, N
  pages in the pool, E the head size. A layer stack is [L, K, N, page_size, E], the paged
  counterpart of the engine's contiguous [L, S, K, C, E] cache.
- ``page_indices``: [S, pages_per_slot] int32, row s lists the pool pages of slot s in
  position order (position t of slot s lives at page ``page_indices[s, t // page_size]``,
  row ``t % page_size``). Entries past the slot's mapped pages hold 0: the kernels load
  whole compute blocks of pages and mask positions >= length, so every entry must be a
  valid page index. Masked positions still enter the PV product with weight 0, so every
  page must hold finite values (0 · NaN = NaN): k_pages / v_pages created as zeros and
  written only with keys and values do.
- ``lengths``: [S] int32 positions to attend to (0 .. length - 1), i.e. the engine's
  ``length + 1`` after it wrote the new token's key and value at position ``length``.

The page pool (``PagePool``, ``init_pool``, ``reserve``, ``fill_group``, ``release``) is
host-side numpy bookkeeping, pure functions returning a new frozen state: the engine
schedules slots from the host between decode chunks (``engine.run``), so allocation
happens there anyway; numpy keeps the free-list search and the refcounts exact and simple
(no fixed-size device free list, no scatter of refcounts), and only ``page_indices`` goes
to the device, once per chunk. A group's G samples share the pages their prompt fills
completely (read-only: decoding writes at positions >= the prompt length, which lie past
them); the partially filled last prompt page is private to each sample because each
sample writes its own completion into the rest of it. Each page carries a refcount and
returns to the free pool only when its last user releases it.

Use from the engine's host loop: ``fill_group`` when a group's prompt is inserted (the
prefill writes the shared pages once and each tail page), ``reserve(pool, s, length_s +
k)`` for every live slot before a decode chunk of k steps (on failure: run fewer steps or
preempt a slot), ``release`` when a request finishes; ``write_decode_kv`` writes each
step's keys and values on device and drops the writes of free slots (whose rows point at
page 0, which another slot may own).

Attention (``paged_decode_attention``): one query token per slot, grouped-query (H = K·G,
query head h reads KV head h // G, the engine's ``q.reshape(S, K, G, E)``). ``impl``:

- ``"xla"`` gathers the pages listed in ``page_indices`` (a [K, S, pages_per_slot,
  page_size, E] read, bounded by the slot's page table, never by the pool), logits and
  softmax in float32, positions >= length masked, a length-0 slot gives zeros.
- ``"pallas_gpu"``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (Triton). Its
  internal dots take the cache dtype with float32 accumulation; it agrees with a float64
  reference to ~1e-6 in float32. In bfloat16 it also rounds the probabilities to bfloat16
  before the PV dot and stores each of its ``k_splits`` partial outputs in bfloat16
  before combining them.
- ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` (Mosaic). Why it
  differs from a dense float32 reference by up to a few 1e-2 at head size 128: its
  ``MultiPageAsyncCopyDescriptor.wait_and_get_loaded`` loads each K/V block with
  ``.astype(float32)`` and then ``_maybe_dequantize(x, None)``, whose default
  ``dtype=jnp.bfloat16`` casts the block to **bfloat16** — float32 pages are silently
  rounded to bfloat16 (relative error up to 2^-9) before the float32 dots. The masking
  (additive ``mask_value``, positions >= length), the layout and the k/v scales (unused
  without quantized pages) are not the cause. Measured on the test scenario (head size
  128, standard-normal q, k, v, up to 32 positions, float32 pages): against an exact
  float64 reference the TPU kernel is off by 6.8e-3 with q scaled by 1/sqrt(E) (what
  this wrapper passes) and by 2.4e-2 with unscaled q (a direct kernel call: larger logits
  magnify the rounding of K), while against a float64 reference computed from
  bfloat16-rounded K and V it agrees to 2.3e-7 / 1.6e-6 — as close as the GPU kernel is
  to the exact reference (3.1e-7 / 1.7e-6). ``tests/test_paged_attention.py`` checks
  both sides. Hence ``kernel_supports`` refuses float32 pages for ``pallas_tpu`` (falls
  back to xla); for bfloat16 pages the cast is exact. jax's own test of this kernel is
  skipped upstream ("This kernel has data races that need to be fixed"); TPU interpret
  mode with ``InterpretParams(detect_races=True)`` found none on the test shapes (empty
  slots first, between and last included), which says nothing about the hardware.

Neither kernel applies the 1/sqrt(E) softmax scale: the wrapper multiplies q by ``scale``
in float32 and passes that to the TPU kernel (which computes in float32) and its cast to
the cache dtype to the GPU one (Triton's dot wants one operand dtype); the xla path scales
the float32 logits, as ``engine.decode_step`` does. Both kernels return zeros for a
length-0 slot (checked in the tests), as the xla path does.

Kernel constraints (``kernel_supports``), read from the kernel sources:

- pallas_gpu: the Triton lowering needs every load/store to have a power-of-two size, so
  E, page_size and the pages per compute block are powers of two; tl.dot needs E >= 16
  and a key block (pages per compute block × page_size) >= 16; pages_per_slot must split
  into ``k_splits`` partitions of a power-of-two page count each divisible by the pages
  per compute block. Query heads per KV head are padded to ``block_h`` = 16.
- pallas_tpu: pages_per_slot divisible by ``pages_per_compute_block`` (the kernel's own
  check); bfloat16 pages only (above); E a multiple of 128 and page_size a multiple of 16.
  The last two are conservative: Mosaic tiles the last two dims of the
  [pages_per_compute_block, page_size, E] VMEM buffers (128 lanes, 16 bfloat16
  sublanes), but it checks that only when a TPU compiles the kernel, which a CPU host
  cannot; jax's own kernel test covers page sizes 16/32/64 and head sizes 128/256.

A shape a kernel cannot take falls back to ``"xla"`` with one warning per shape.
``resolve_impl`` maps the ``sampler.attention`` setting ('auto' | 'xla' | 'pallas') and a
platform to an impl.

Export: both kernels lower from a CPU host (``jax.export.export(..., platforms=["cuda"])``
or ``["tpu"]``). The TPU program holds a ``tpu_custom_call``, which export accepts. The
GPU program holds ``__gpu$xla.gpu.triton``, which export refuses by default ("custom calls
whose targets have no compatibility guarantees") — pass
``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]``
(``EXPORT_GPU_CHECKS``); the serialized Triton IR is then only valid for the jax/XLA
version that produced it.
"""

from __future__ import annotations

import functools
import logging
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")
CHOICES = ("auto", "xla", "pallas")
GPU_BLOCK_H = 16  # query heads per Triton program; the kernel requires a multiple of 16
GPU_MAX_K_SPLITS = 16  # the GPU kernel's default partition count of a slot's pages
GPU_PAGES_PER_BLOCK = 8  # the GPU kernel's default pages per compute block
TPU_BLOCK_TOKENS = 512  # positions per TPU compute block (jax's kernel test uses 512)
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
EXPORT_GPU_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL),)


# --------------------------------------------------------------------------- page pool


@flax.struct.dataclass
class PagePool:
  """Page bookkeeping for S slots over a pool of N pages (host numpy, never mutated).

  Attributes:
    page_size: positions per page (static).
    refcount: [N] int32 users of each page (0 = free).
    page_indices: [S, M] int32 the pages of each slot in position order; entries at or
      past ``mapped[s]`` hold 0 (a valid index the kernels read and mask).
    mapped: [S] int32 pages mapped to each slot (its capacity is mapped · page_size).
    shared: [S] int32 leading pages of each slot that are shared read-only prompt pages.
  """

  refcount: np.ndarray
  page_indices: np.ndarray
  mapped: np.ndarray
  shared: np.ndarray
  page_size: int = flax.struct.field(pytree_node=False)

  @property
  def num_free(self) -> int:
    """Pages with refcount 0 (int)."""
    return int(np.count_nonzero(self.refcount == 0))

  def free_pages(self) -> np.ndarray:
    """[F] int64 indices of the free pages, ascending (the order ``reserve`` takes them)."""
    return np.flatnonzero(self.refcount == 0)


def init_pool(num_pages: int, page_size: int, max_pages_per_slot: int, slots: int) -> PagePool:
  """An empty pool: every page free, every slot unmapped.

  Args:
    num_pages: N pages in the pool (>= 1). page_size: positions per page (>= 1).
    max_pages_per_slot: M, the width of ``page_indices`` (>= 1). slots: S (>= 1).

  Returns:
    ``PagePool`` with refcount [N] zeros, page_indices [S, M] zeros, mapped and shared [S]
    zeros (all int32).

  Raises:
    ValueError: a size below 1.
  """
  for name, n in (("num_pages", num_pages), ("page_size", page_size),
                  ("max_pages_per_slot", max_pages_per_slot), ("slots", slots)):
    if int(n) < 1:
      raise ValueError(f"init_pool: {name} must be >= 1, got {n}")
  return PagePool(refcount=np.zeros(num_pages, np.int32),
                  page_indices=np.zeros((slots, max_pages_per_slot), np.int32),
                  mapped=np.zeros(slots, np.int32), shared=np.zeros(slots, np.int32),
                  page_size=int(page_size))


def pages_for(length: int, page_size: int) -> int:
  """Pages that hold ``length`` positions: ceil(length / page_size) (int >= 0)."""
  return -(-int(length) // int(page_size))


def _check_slot(pool: PagePool, slot: int):
  if not 0 <= int(slot) < pool.mapped.shape[0]:
    raise ValueError(f"slot {slot} out of range [0, {pool.mapped.shape[0]})")


def reserve(pool: PagePool, slot: int, length: int) -> tuple[PagePool, bool]:
  """Maps pages to ``slot`` until it holds ``length`` positions (fill an empty slot or grow).

  New pages are the lowest-numbered free ones, appended after the slot's mapped pages with
  refcount 1; a slot that already holds ``length`` positions is left as it is.

  Args:
    pool: the current ``PagePool``. slot: int in [0, S). length: positions needed (>= 0).

  Returns:
    (pool, ok): ok False when the pool has too few free pages; the returned pool is then
    ``pool`` itself, unchanged.

  Raises:
    ValueError: slot out of range, or ``length`` beyond the slot's page table
      (M · page_size) — a caller error, not an exhausted pool.
  """
  _check_slot(pool, slot)
  need = pages_for(length, pool.page_size)
  width = pool.page_indices.shape[1]
  if need > width:
    raise ValueError(f"reserve: length {length} needs {need} pages, the page table holds "
                     f"{width} (pages_per_slot) of {pool.page_size} positions")
  have = int(pool.mapped[slot])
  if need <= have:
    return pool, True
  new = pool.free_pages()[:need - have]
  if new.size < need - have:
    return pool, False
  refcount = pool.refcount.copy()
  refcount[new] += 1
  page_indices = pool.page_indices.copy()
  page_indices[slot, have:need] = new
  mapped = pool.mapped.copy()
  mapped[slot] = need
  return pool.replace(refcount=refcount, page_indices=page_indices, mapped=mapped), True


def fill_group(pool: PagePool, slots, prompt_len: int) -> tuple[PagePool, bool]:
  """Maps one prompt to the empty slots of its G samples, sharing its full pages.

  The prompt's floor(prompt_len / page_size) completely filled pages are allocated once
  and mapped read-only into every slot (refcount G each); a partially filled last page is
  allocated per slot, since each sample writes its completion into its remainder. Pages
  come from the lowest free indices: the shared ones first, then each slot's tail page in
  the order of ``slots``. The caller writes the prompt's keys and values once into the
  shared pages and into every tail page.

  Args:
    pool: the current ``PagePool``. slots: sequence of G distinct int slots, each empty
      (``mapped == 0``). prompt_len: prompt positions (>= 1).

  Returns:
    (pool, ok): ok False when the pool has too few free pages; the pool is then returned
    unchanged.

  Raises:
    ValueError: no slots, repeated or out-of-range slots, a slot that still holds pages,
      prompt_len < 1, or a prompt longer than the page table.
  """
  slots = [int(s) for s in slots]
  if not slots or len(set(slots)) != len(slots):
    raise ValueError(f"fill_group: slots must be distinct and non-empty, got {slots}")
  for s in slots:
    _check_slot(pool, s)
    if pool.mapped[s]:
      raise ValueError(f"fill_group: slot {s} still holds {pool.mapped[s]} pages; release it")
  if prompt_len < 1:
    raise ValueError(f"fill_group: prompt_len must be >= 1, got {prompt_len}")
  full, tail = divmod(int(prompt_len), pool.page_size)
  if full + (tail > 0) > pool.page_indices.shape[1]:
    raise ValueError(f"fill_group: prompt of {prompt_len} positions exceeds the page table "
                     f"({pool.page_indices.shape[1]} pages of {pool.page_size})")
  g = len(slots)
  free = pool.free_pages()
  if free.size < full + g * (tail > 0):
    return pool, False
  shared_pages, rest = free[:full], free[full:]
  refcount = pool.refcount.copy()
  refcount[shared_pages] += g
  page_indices = pool.page_indices.copy()
  mapped = pool.mapped.copy()
  shared = pool.shared.copy()
  for i, s in enumerate(slots):
    page_indices[s, :full] = shared_pages
    if tail:
      page_indices[s, full] = rest[i]
      refcount[rest[i]] += 1
    mapped[s] = full + (tail > 0)
    shared[s] = full
  return pool.replace(refcount=refcount, page_indices=page_indices, mapped=mapped,
                      shared=shared), True


def release(pool: PagePool, slot: int) -> PagePool:
  """Unmaps every page of ``slot`` (its request finished); a page whose refcount drops to
  0 is free again. Releasing an empty slot is a no-op.

  Args:
    pool: the current ``PagePool``. slot: int in [0, S).

  Returns:
    the new ``PagePool``.

  Raises:
    ValueError: slot out of range.
  """
  _check_slot(pool, slot)
  n = int(pool.mapped[slot])
  if n == 0:
    return pool
  refcount = pool.refcount.copy()
  np.subtract.at(refcount, pool.page_indices[slot, :n], 1)
  page_indices = pool.page_indices.copy()
  page_indices[slot] = 0
  mapped = pool.mapped.copy()
  mapped[slot] = 0
  shared = pool.shared.copy()
  shared[slot] = 0
  return pool.replace(refcount=refcount, page_indices=page_indices, mapped=mapped,
                      shared=shared)


def check_pool(pool: PagePool) -> None:
  """Verifies the pool's invariants: each page's refcount equals the number of slots that
  map it, unmapped table entries are 0, shared <= mapped.

  Args:
    pool: a ``PagePool``.

  Raises:
    AssertionError: an invariant does not hold (names the first offending page or slot).
  """
  # raised, not asserted: the check must also run under python -O
  used = np.arange(pool.page_indices.shape[1])[None, :] < pool.mapped[:, None]
  counts = np.bincount(pool.page_indices[used], minlength=pool.refcount.shape[0])
  bad = np.flatnonzero(counts != pool.refcount)
  if bad.size:
    p = bad[0]
    raise AssertionError(f"page {p}: refcount {pool.refcount[p]}, mapped by {counts[p]} slots")
  if pool.page_indices[~used].any():
    s = np.flatnonzero((pool.page_indices * ~used).any(axis=1))[0]
    raise AssertionError(f"slot {s}: page_indices entries past its mapped pages must be 0")
  if (pool.shared > pool.mapped).any():
    s = np.flatnonzero(pool.shared > pool.mapped)[0]
    raise AssertionError(f"slot {s}: {pool.shared[s]} shared pages of {pool.mapped[s]} mapped")


def write_decode_kv(pages: jax.Array, page_indices: jax.Array, positions: jax.Array,
                    new: jax.Array, valid: jax.Array) -> jax.Array:
  """Writes one decode step's key (or value) of each slot into its page (jittable).

  Slot s writes ``new[s]`` at position ``positions[s]``: page ``page_indices[s,
  positions[s] // page_size]``, row ``positions[s] % page_size``. Writes of slots with
  ``valid`` False or a position outside the page table are dropped, so a free slot never
  touches page 0. The caller keeps positions inside pages the slot owns privately
  (``reserve``); shared prompt pages are never written.

  Args:
    pages: [K, N, page_size, E]. page_indices: [S, M] int32. positions: [S] int32.
    new: [S, K, E] (cast to the pages' dtype). valid: [S] bool.

  Returns:
    [K, N, page_size, E] the updated pages.
  """
  n, page_size = pages.shape[1], pages.shape[2]
  m = page_indices.shape[1]
  j = positions // page_size
  ok = valid & (positions >= 0) & (j < m)
  page = jnp.take_along_axis(page_indices, jnp.clip(j, 0, m - 1)[:, None], axis=1)[:, 0]
  page = jnp.where(ok, page, n)  # out of range: dropped
  return pages.at[:, page, positions % page_size].set(
      jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")


# --------------------------------------------------------------------------- attention


def resolve_impl(choice: str, platform: str) -> str:
  """The attention impl for the ``sampler.attention`` setting on ``platform``.

  'auto' and 'pallas' pick ``pallas_gpu`` on gpu/cuda/rocm and ``pallas_tpu`` on tpu;
  'auto' picks ``xla`` elsewhere (cpu), 'pallas' too, with one warning (the kernels only
  run interpreted there). 'xla' is ``xla`` everywhere.

  Args:
    choice: 'auto' | 'xla' | 'pallas'. platform: a jax platform name ('cpu', 'gpu',
      'cuda', 'rocm', 'tpu'), e.g. ``jax.default_backend()``.

  Returns:
    one of ``IMPLS`` (str).

  Raises:
    ValueError: ``choice`` not one of ``CHOICES`` (the message names sampler.attention).
  """
  if choice not in CHOICES:
    raise ValueError(f"sampler.attention must be one of {', '.join(map(repr, CHOICES))}; "
                     f"got {choice!r}")
  if choice == "xla":
    return "xla"
  kernel = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu",
            "tpu": "pallas_tpu"}.get(platform.lower())
  if kernel is None and choice == "pallas":
    _warn_once(("resolve", platform), f"sampler.attention='pallas' has no kernel for platform "
               f"{platform!r}; using the xla paged attention")
  return kernel or "xla"


def _pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def _gpu_params(e: int, page_size: int, pages_per_slot: int):
  if not _pow2(e) or e < 16:
    return None, f"head size {e} is not a power of two >= 16 (Triton load sizes, tl.dot)"
  if not _pow2(page_size):
    return None, f"page_size {page_size} is not a power of two (Triton load sizes)"
  k_splits = math.gcd(pages_per_slot, GPU_MAX_K_SPLITS)  # a power of two dividing it
  per_split = pages_per_slot // k_splits
  if not _pow2(per_split):
    return None, (f"pages_per_slot {pages_per_slot} does not split into power-of-two "
                  f"partitions (k_splits {k_splits} leaves {per_split} pages)")
  per_block = min(GPU_PAGES_PER_BLOCK, per_split)
  if per_block * page_size < 16:
    return None, f"a key block of {per_block} pages × {page_size} positions is below 16 (tl.dot)"
  return dict(block_h=GPU_BLOCK_H, pages_per_compute_block=per_block, k_splits=k_splits), None


def _tpu_params(e: int, page_size: int, pages_per_slot: int, dtype):
  if jnp.dtype(dtype) != jnp.bfloat16:
    return None, (f"{jnp.dtype(dtype).name} pages: the kernel rounds K and V to bfloat16 "
                  f"inside (wait_and_get_loaded → _maybe_dequantize)")
  if e % 128:
    return None, f"head size {e} is not a multiple of 128 (Mosaic lane tiling)"
  if page_size % 16:
    return None, f"page_size {page_size} is not a multiple of 16 (Mosaic sublane tiling)"
  want = max(1, TPU_BLOCK_TOKENS // page_size)
  per_block = max(d for d in range(1, min(want, pages_per_slot) + 1) if pages_per_slot % d == 0)
  return dict(pages_per_compute_block=per_block), None


def kernel_supports(impl: str, q_shape, pages_shape, pages_per_slot: int, dtype):
  """Whether ``impl`` can run a shape, and the kernel parameters it would use.

  Args:
    impl: one of ``IMPLS``. q_shape: (S, H, E). pages_shape: (K, N, page_size, E).
    pages_per_slot: the width of ``page_indices``. dtype: the pages' dtype.

  Returns:
    (params, reason): params a dict of the kernel's static keyword arguments (empty for
    xla) and reason None, or params None and reason a str saying what the kernel lacks.

  Raises:
    ValueError: ``impl`` not in ``IMPLS``, or shapes inconsistent for any impl (H not a
      multiple of K, head sizes differ).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  _, h, e = q_shape
  k, _, page_size, e_k = pages_shape
  if e_k != e or h % k:
    raise ValueError(f"paged attention: q {tuple(q_shape)} does not fit pages "
                     f"{tuple(pages_shape)} (need equal head size and H a multiple of K)")
  if impl == "xla":
    return {}, None
  if impl == "pallas_gpu":
    return _gpu_params(e, page_size, pages_per_slot)
  return _tpu_params(e, page_size, pages_per_slot, dtype)


_WARNED: set = set()


def _warn_once(key, message: str):
  if key not in _WARNED:
    _WARNED.add(key)
    logger.warning(message)


def _xla_attention(q, k_pages, v_pages, lengths, page_indices, scale):
  s, h, e = q.shape
  kh, _, page_size, _ = k_pages.shape
  g = h // kh
  width = page_indices.shape[1] * page_size
  keys = k_pages[:, page_indices].reshape(kh, s, width, e)  # only the listed pages
  vals = v_pages[:, page_indices].reshape(kh, s, width, e)
  qg = q.reshape(s, kh, g, e)
  logits = jnp.einsum("skge,kswe->skgw", qg, keys,
                      preferred_element_type=jnp.float32) * jnp.float32(scale)
  visible = jnp.arange(width, dtype=jnp.int32)[None, :] < lengths[:, None]  # [S, width]
  logits = jnp.where(visible[:, None, None, :], logits, -1e30)
  probs = jax.nn.softmax(logits, axis=-1).astype(vals.dtype)
  y = jnp.einsum("skgw,kswe->skge", probs, vals, preferred_element_type=jnp.float32)
  # a slot with nothing to attend to would otherwise average its masked positions
  y = jnp.where((lengths > 0)[:, None, None, None], y, 0.0)
  return y.reshape(s, h, e).astype(q.dtype)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           lengths: jax.Array, page_indices: jax.Array, *, impl: str = "xla",
                           interpret: bool = False, scale: float | None = None) -> jax.Array:
  """Decode attention of one query token per slot over its pages (grouped-query).

  Slot s, query head h attends to positions 0 .. lengths[s] - 1 of KV head h // G, read
  from pages ``page_indices[s]``; softmax(scale · q·k) · v with float32 logits and softmax.
  A slot with length 0 gives zeros. A kernel impl that cannot take the shapes
  (``kernel_supports``) runs the xla path instead, with one warning per shape.

  Args:
    q: [S, H, E] queries (float32 or bfloat16), H = K · G.
    k_pages, v_pages: [K, N, page_size, E] the pool's keys and values (one layer).
    lengths: [S] int32 positions to attend to, each in [0, pages_per_slot · page_size].
    page_indices: [S, pages_per_slot] int32 page of each slot's i-th page_size positions;
      every entry a valid page index in [0, N) (unused entries are read and masked).
    impl: 'xla' | 'pallas_gpu' | 'pallas_tpu' (see ``resolve_impl``).
    interpret: run a Pallas kernel in interpret mode (on CPU): ``interpret=True`` for the
      GPU kernel, ``pltpu.force_tpu_interpret_mode()`` around the TPU one.
    scale: logit scale; None means E ** -0.5.

  Returns:
    [S, H, E] attention output in q's dtype.

  Raises:
    ValueError: unknown impl, or shapes that fit no impl (H not a multiple of K, head
      sizes differ, k/v pages of different shapes, lengths or page_indices not int32 with
      S rows).
  """
  s, h, e = q.shape
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
  if page_indices.ndim != 2 or page_indices.shape[0] != s or lengths.shape != (s,):
    raise ValueError(f"page_indices {page_indices.shape} and lengths {lengths.shape} must "
                     f"have S = {s} rows")
  if lengths.dtype != jnp.int32 or page_indices.dtype != jnp.int32:
    raise ValueError("lengths and page_indices must be int32")
  scale = e ** -0.5 if scale is None else float(scale)
  params, reason = kernel_supports(impl, q.shape, k_pages.shape, page_indices.shape[1],
                                   k_pages.dtype)
  if params is None:
    _warn_once((impl, q.shape, k_pages.shape, page_indices.shape, jnp.dtype(k_pages.dtype).name),
               f"{impl} paged attention cannot take q {q.shape}, pages {k_pages.shape}, "
               f"{page_indices.shape[1]} pages per slot ({reason}); using the xla path")
    impl = "xla"
  if impl == "xla":
    return _xla_attention(q, k_pages, v_pages, lengths, page_indices, scale)
  # the kernels take no scale: fold it into q in float32
  qs = q.astype(jnp.float32) * scale
  if impl == "pallas_gpu":
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel
    # Triton's dot takes both operands in one dtype: q in the cache dtype
    out = gpu_kernel.paged_attention(qs.astype(k_pages.dtype), k_pages, v_pages, page_indices,
                                     lengths, interpret=interpret, **params)
  else:
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel
    # float32 q: the kernel computes in float32 anyway, and it keeps its running output
    # between compute blocks in q's dtype, which would round it at every block
    call = functools.partial(tpu_kernel, qs, k_pages, v_pages, lengths, page_indices, **params)
    if interpret:
      with pltpu.force_tpu_interpret_mode():
        out = call()
    else:
      out = call()
  return out.astype(q.dtype)
