"""Paged KV cache: page-pool accounting, paged decode attention against a float64 dense
reference (xla path and both Pallas kernels in interpret mode), and the programs the
kernels export for GPU and TPU."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.sampling import paged

# Slot scenario on pages of 16 positions, 2 pages per slot (capacity 32):
#   slots 0 and 1: a group sharing a 20-position prompt (page of positions 0-15 shared,
#     positions 16-19 copied into each slot's private tail page), then 4 and 1 decoded
#     positions of their own; slot 2: empty (length 0, no pages; between filled slots,
#     where the TPU kernel's prefetch skips it); slot 3: length 1; slot 4: just full
#     (32 = 2 pages × 16).
PAGE, PPS, E, KV, G = 16, 2, 128, 2, 2
PROMPT = 20
LENGTHS = np.array([24, 21, 0, 1, 32], np.int32)


def _scenario(seed=0):
  """Contiguous per-slot K/V [S, K, 32, E] (slots 0 and 1 equal on the prompt), the pool
  that maps them, and the pages holding them."""
  rng = np.random.default_rng(seed)
  s = LENGTHS.size
  k = rng.standard_normal((s, KV, PAGE * PPS, E))
  v = rng.standard_normal((s, KV, PAGE * PPS, E))
  k[1, :, :PROMPT], v[1, :, :PROMPT] = k[0, :, :PROMPT], v[0, :, :PROMPT]
  q = rng.standard_normal((s, KV * G, E))

  pool = paged.init_pool(num_pages=8, page_size=PAGE, max_pages_per_slot=PPS, slots=s)
  pool, ok = paged.fill_group(pool, [0, 1], PROMPT)
  assert ok
  for slot in range(s):
    pool, ok = paged.reserve(pool, slot, int(LENGTHS[slot]))
    assert ok
  paged.check_pool(pool)
  assert pool.page_indices[0, 0] == pool.page_indices[1, 0]  # the shared prompt page
  assert pool.page_indices[0, 1] != pool.page_indices[1, 1]

  # unused pool rows hold values that would show up if masking failed
  # and so do positions at or past each slot's length inside its pages
  k_pages = np.full((KV, 8, PAGE, E), 50.0)
  v_pages = np.full((KV, 8, PAGE, E), 50.0)
  past = np.arange(PAGE * PPS)[None, None, :, None] >= LENGTHS[:, None, None, None]
  k_pad, v_pad = np.where(past, 50.0, k), np.where(past, 50.0, v)
  for slot in range(s):
    for j in range(int(pool.mapped[slot])):
      page = pool.page_indices[slot, j]
      if j < pool.shared[slot] and slot != 0:
        continue  # shared pages are written once, by the group's first slot
      k_pages[:, page] = k_pad[slot, :, j * PAGE:(j + 1) * PAGE]
      v_pages[:, page] = v_pad[slot, :, j * PAGE:(j + 1) * PAGE]
  return q, k, v, k_pages, v_pages, pool.page_indices


def _reference(q, k, v, lengths):
  """Dense float64 grouped-query decode attention over contiguous K/V [S, K, C, E]."""
  s, h, e = q.shape
  out = np.zeros((s, h, e))
  for i in range(s):
    n = int(lengths[i])
    if n == 0:
      continue
    for head in range(h):
      logits = k[i, head // G, :n] @ q[i, head] * e ** -0.5
      w = np.exp(logits - logits.max())
      out[i, head] = (w / w.sum()) @ v[i, head // G, :n]
  return out


def _ours(caplog):
  return [r for r in caplog.records if r.name == paged.__name__]


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


# f32: logits are 128-term dot products and the PV sum has <= 32 terms of |v| ~ 3;
#   f32 rounding (6e-8 relative) times such sums stays below 1e-5.
# bf16 (inputs rounded to bf16 before the reference, so only in-kernel rounding counts):
#   the probabilities, the scaled q and the output are rounded to bf16 (2^-9 = 2e-3
#   relative); the probability error times |v| <= 4 summed over at most 32 positions,
#   weighted by the probabilities, is <= 2^-9 * 4 ~ 8e-3 per rounding → 2e-2 for all.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

CASES = [("xla", jnp.float32), ("xla", jnp.bfloat16), ("pallas_gpu", jnp.float32),
         ("pallas_gpu", jnp.bfloat16), ("pallas_tpu", jnp.bfloat16)]


@pytest.mark.numerics
@pytest.mark.parametrize("impl,dtype", CASES, ids=[f"{i}-{jnp.dtype(d).name}" for i, d in CASES])
def test_paged_attention_matches_dense_reference(impl, dtype, caplog):
  q, k, v, k_pages, v_pages, page_indices = _scenario()
  if dtype == jnp.bfloat16:
    q, k, v, k_pages, v_pages = map(_bf16, (q, k, v, k_pages, v_pages))
  with caplog.at_level(logging.WARNING, logger=paged.__name__):
    out = paged.paged_decode_attention(
        jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
        jnp.asarray(LENGTHS), jnp.asarray(page_indices), impl=impl, interpret=True)
  assert not _ours(caplog)  # the kernel took the shape; no fallback to xla
  assert out.shape == q.shape and out.dtype == dtype
  out = np.asarray(out.astype(jnp.float32), np.float64)
  ref = _reference(q, k, v, LENGTHS)
  err = np.abs(out - ref).max(axis=(1, 2))
  assert (err <= TOL[dtype]).all(), (impl, err)
  # the length-0 slot: every impl gives zeros (both kernels do so without help)
  assert not out[2].any()


@pytest.mark.numerics
def test_tpu_kernel_rounds_float32_pages_to_bfloat16():
  """The TPU kernel's error on float32 pages is exactly bf16 rounding of K and V."""
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel
  q, k, v, k_pages, v_pages, page_indices = _scenario(seed=1)
  q = q * E ** -0.5  # the kernel applies no scale
  with pltpu.force_tpu_interpret_mode():
    out = tpu_kernel(jnp.asarray(q, jnp.float32), jnp.asarray(k_pages, jnp.float32),
                     jnp.asarray(v_pages, jnp.float32), jnp.asarray(LENGTHS),
                     jnp.asarray(page_indices), pages_per_compute_block=1)
  out = np.asarray(out, np.float64)
  exact = _reference(q * E ** 0.5, k, v, LENGTHS)
  rounded = _reference(q * E ** 0.5, _bf16(k), _bf16(v), LENGTHS)
  # float32 arithmetic on bf16-rounded K/V: same f32 bound as above
  assert np.abs(out - rounded).max() <= 1e-5
  # against exact K/V it is off by the bf16 rounding of v (2^-9 relative, |v| ~ 1-3)
  assert np.abs(out - exact).max() > 1e-3
  # and the wrapper refuses float32 pages for this kernel
  params, reason = paged.kernel_supports("pallas_tpu", q.shape, k_pages.shape, PPS, jnp.float32)
  assert params is None and "bfloat16" in reason


# --------------------------------------------------------------------------- pool


def test_pool_allocate_grow_share_release_exact_pages():
  pool = paged.init_pool(num_pages=6, page_size=4, max_pages_per_slot=3, slots=3)
  # prompt of 6 positions for a group of 2: page 0 shared (positions 0-3), tails 1 and 2
  pool, ok = paged.fill_group(pool, [0, 1], 6)
  assert ok
  np.testing.assert_array_equal(pool.page_indices, [[0, 1, 0], [0, 2, 0], [0, 0, 0]])
  np.testing.assert_array_equal(pool.refcount, [2, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(pool.shared, [1, 1, 0])
  # slot 0 grows to 9 positions (3 pages): takes page 3; within capacity nothing changes
  pool, ok = paged.reserve(pool, 0, 9)
  assert ok
  same, ok = paged.reserve(pool, 0, 12)
  assert ok and same is pool
  # slot 2 filled alone with 4 positions: page 4; slot 1 grows to 12: page 5
  pool, _ = paged.reserve(pool, 2, 4)
  pool, _ = paged.reserve(pool, 1, 12)
  np.testing.assert_array_equal(pool.page_indices, [[0, 1, 3], [0, 2, 5], [4, 0, 0]])
  np.testing.assert_array_equal(pool.refcount, [2, 1, 1, 1, 1, 1])
  paged.check_pool(pool)
  assert pool.num_free == 0

  # exhausted: growing slot 2 fails and leaves the pool as it was
  again, ok = paged.reserve(pool, 2, 5)
  assert not ok and again is pool
  np.testing.assert_array_equal(pool.page_indices[2], [4, 0, 0])

  # slot 0 finishes: its private pages 1 and 3 are free, the shared page 0 is not
  pool = paged.release(pool, 0)
  np.testing.assert_array_equal(pool.free_pages(), [1, 3])
  np.testing.assert_array_equal(pool.refcount, [1, 0, 1, 0, 1, 1])
  paged.check_pool(pool)
  # the last sharer finishes: page 0 returns with its own pages 2 and 5
  pool = paged.release(pool, 1)
  np.testing.assert_array_equal(pool.free_pages(), [0, 1, 2, 3, 5])
  pool = paged.release(paged.release(pool, 2), 2)  # a second release is a no-op
  np.testing.assert_array_equal(pool.free_pages(), np.arange(6))
  assert not pool.page_indices.any() and not pool.mapped.any() and not pool.shared.any()
  paged.check_pool(pool)
  # check_pool catches a refcount that disagrees with the table
  with pytest.raises(AssertionError, match="page 2: refcount 1, mapped by 0"):
    paged.check_pool(pool.replace(refcount=np.array([0, 0, 1, 0, 0, 0], np.int32)))


def test_write_decode_kv_writes_owned_pages_and_drops_the_rest():
  pages = np.zeros((2, 4, 2, 3), np.float32)  # K=2, N=4 pages of 2 positions, E=3
  page_indices = np.array([[2, 3], [1, 0], [0, 0]], np.int32)
  new = np.arange(3 * 2 * 3, dtype=np.float32).reshape(3, 2, 3) + 1
  out = np.asarray(paged.write_decode_kv(
      jnp.asarray(pages), jnp.asarray(page_indices), jnp.asarray([3, 4, 0], jnp.int32),
      jnp.asarray(new), jnp.asarray([True, True, False])))
  want = pages.copy()
  want[:, 3, 1] = new[0]  # slot 0, position 3: its second page (3), row 1
  # slot 1, position 4 is past its 2-page table: dropped; slot 2 is free: dropped
  np.testing.assert_array_equal(out, want)


def test_pool_group_fill_is_all_or_nothing_and_checks_arguments():
  pool = paged.init_pool(num_pages=3, page_size=4, max_pages_per_slot=2, slots=4)
  # a 6-position prompt for 3 samples needs 1 shared + 3 tail pages: 4 > 3 free
  same, ok = paged.fill_group(pool, [0, 1, 2], 6)
  assert not ok and same is pool and pool.num_free == 3
  # an 8-position prompt fills both pages completely: 2 shared pages, no tails
  pool, ok = paged.fill_group(pool, [0, 1, 2], 8)
  assert ok
  np.testing.assert_array_equal(pool.page_indices[:3], [[0, 1]] * 3)
  np.testing.assert_array_equal(pool.refcount, [3, 3, 0])
  paged.check_pool(pool)
  with pytest.raises(ValueError, match="still holds"):
    paged.fill_group(pool, [0], 4)
  with pytest.raises(ValueError, match="distinct"):
    paged.fill_group(pool, [3, 3], 4)
  with pytest.raises(ValueError, match="page table"):
    paged.reserve(pool, 3, 9)
  with pytest.raises(ValueError, match="out of range"):
    paged.release(pool, 4)
  for slot in (2, 0):
    pool = paged.release(pool, slot)
    assert pool.num_free == 1  # pages 0 and 1 stay while slot 1 maps them
  pool = paged.release(pool, 1)
  np.testing.assert_array_equal(pool.free_pages(), [0, 1, 2])


# --------------------------------------------------------------------------- selection


def test_resolve_impl(caplog):
  assert paged.resolve_impl("auto", "gpu") == "pallas_gpu"
  assert paged.resolve_impl("auto", "cuda") == "pallas_gpu"
  assert paged.resolve_impl("auto", "tpu") == "pallas_tpu"
  assert paged.resolve_impl("auto", "cpu") == "xla"
  assert paged.resolve_impl("xla", "tpu") == "xla"
  assert paged.resolve_impl("pallas", "tpu") == "pallas_tpu"
  paged._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=paged.__name__):
    assert paged.resolve_impl("pallas", "cpu") == "xla"
    assert paged.resolve_impl("pallas", "cpu") == "xla"
  assert len(_ours(caplog)) == 1
  with pytest.raises(ValueError, match=r"sampler\.attention.*'auto', 'xla', 'pallas'.*'flash'"):
    paged.resolve_impl("flash", "gpu")


def test_kernel_constraints_and_single_fallback_warning(caplog):
  q_shape = (64, 28, 128)
  assert paged.kernel_supports("pallas_gpu", q_shape, (4, 4096, 16, 128), 256, jnp.bfloat16)[0] == \
      dict(block_h=16, pages_per_compute_block=8, k_splits=16)
  assert paged.kernel_supports("pallas_tpu", q_shape, (4, 4096, 16, 128), 256, jnp.bfloat16)[0] == \
      dict(pages_per_compute_block=32)
  assert paged.kernel_supports("pallas_tpu", q_shape, (4, 4096, 16, 128), 12, jnp.bfloat16)[0] == \
      dict(pages_per_compute_block=12)
  # 12 pages split in 4 partitions of 3: not a power of two for Triton
  assert "power-of-two partitions" in paged.kernel_supports(
      "pallas_gpu", q_shape, (4, 4096, 16, 128), 12, jnp.bfloat16)[1]
  assert "head size 96" in paged.kernel_supports(
      "pallas_gpu", (2, 4, 96), (2, 8, 16, 96), 2, jnp.float32)[1]
  assert "page_size 8" in paged.kernel_supports(
      "pallas_tpu", q_shape, (4, 4096, 8, 128), 256, jnp.bfloat16)[1]
  with pytest.raises(ValueError, match="multiple of K"):
    paged.kernel_supports("xla", (2, 3, 16), (2, 8, 16, 16), 2, jnp.float32)

  # head size 96: the GPU kernel cannot take it; the call runs xla, warning once
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((2, 4, 96)), jnp.float32)
  kp = jnp.asarray(rng.standard_normal((2, 4, 16, 96)), jnp.float32)
  lengths = jnp.asarray([5, 17], jnp.int32)
  pi = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  paged._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=paged.__name__):
    outs = [paged.paged_decode_attention(q, kp, kp, lengths, pi, impl="pallas_gpu", interpret=True)
            for _ in range(2)]
  records = _ours(caplog)
  assert len(records) == 1 and "head size 96" in records[0].getMessage()
  want = paged.paged_decode_attention(q, kp, kp, lengths, pi, impl="xla")
  np.testing.assert_array_equal(outs[0], want)
  np.testing.assert_array_equal(outs[1], want)


# --------------------------------------------------------------------------- export

# Qwen2.5-7B attention widths: 28 query heads, 4 KV heads, head size 128; 64 slots of
# 256 pages × 16 positions (4096 per slot), a pool of 16384 pages.
QWEN = dict(s=64, h=28, k=4, e=128, page=16, pps=256, pages=16384)


def _dense_types(mlir: str):
  """Float tensor types with a per-slot position axis: 4096 positions, or 256 pages × 16
  positions — the score / gathered-KV arrays of a path that reads every slot's whole
  page table densely. The pool itself ([4, 16384, 16, 128]) has neither."""
  c = QWEN["pps"] * QWEN["page"]
  out = []
  for dims in re.findall(r"tensor<((?:\d+x)+)(?:f32|bf16|f16)>", mlir):
    d = dims.rstrip("x").split("x")
    if str(c) in d or f"{QWEN['pps']}x{QWEN['page']}" in "x".join(d):
      out.append(dims)
  return out


def _export(impl, platform, **kw):
  s, h, k, e, page, pps, n = (QWEN[x] for x in ("s", "h", "k", "e", "page", "pps", "pages"))
  args = (jax.ShapeDtypeStruct((s, h, e), jnp.bfloat16),
          jax.ShapeDtypeStruct((k, n, page, e), jnp.bfloat16),
          jax.ShapeDtypeStruct((k, n, page, e), jnp.bfloat16),
          jax.ShapeDtypeStruct((s,), jnp.int32), jax.ShapeDtypeStruct((s, pps), jnp.int32))
  f = lambda *a: paged.paged_decode_attention(*a, impl=impl)
  return jax.export.export(jax.jit(f), platforms=[platform], **kw)(*args).mlir_module()


def test_exported_kernels_hold_custom_calls_and_no_dense_scores():
  gpu = _export("pallas_gpu", "cuda", disabled_checks=paged.EXPORT_GPU_CHECKS)
  assert paged.TRITON_CUSTOM_CALL in gpu
  assert _dense_types(gpu) == []
  tpu = _export("pallas_tpu", "tpu")
  assert "tpu_custom_call" in tpu
  assert _dense_types(tpu) == []
  # the detector finds the xla path's [64, 4, 7, 4096] f32 scores
  assert "64x4x7x4096x" in _dense_types(_export("xla", "cpu"))
  # without the disabled check export refuses the Triton call (no compatibility guarantee)
  with pytest.raises(ValueError, match="no compatibility guarantees"):
    _export("pallas_gpu", "cuda")
