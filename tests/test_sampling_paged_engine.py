"""The engine on a paged KV cache (``engine.run(paged=True)``) against the contiguous one.

With the same key the paged engine samples exactly the same tokens, lengths and policy
versions as the contiguous cache, and log-probs equal to float32 reordering (the decode
attention's masked width differs: the slot's page table instead of the width bucket),
greedy and sampled, with G = 3 samples sharing their prompt pages, more requests than slots
(refills, then the tail shrinks), prompt lengths on, before and past page boundaries, an
in-flight weight swap, a pool too small for all slots at once (requests wait for pages),
and on an 8-device mesh. Every page is back in the pool after ``run``; page counts are
checked by hand. The contiguous cache's weight-swap re-prefill, one slot block at a time,
keeps its compiled temporaries to one block's; a swap that keeps the caches
(``on_weight_swap='keep_kv'``) records each token's logits' version.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import forward_terms, reorder_tol
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.parallel import make_mesh
from jaxreplay.sampling import engine, generate
from jaxreplay.sampling import paged as paging

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=64, tie_embeddings=False, qkv_bias=True)
PAGE = 4
# prompt lengths: one position, a page minus one, exactly one page, one page plus one,
# two pages plus one, exactly three pages (no private last prompt page)
LENGTHS = (1, 3, 4, 5, 9, 12)
N, P_WIDTH, M, G, SLOTS = len(LENGTHS), 12, 20, 3, 8  # 18 requests on 8 slots
KW = dict(max_new_tokens=M, eos_ids=(2, 3), pad_id=0, group_size=G, slots=SLOTS, chunk_steps=4)
# Log-probs: the same forward chain, the attention's softmax summed over another masked
# width: reorder_tol of the chain, twice (log-softmax), at logits of size <= 10 (measured
# difference: ~1e-6).
LOGP_ATOL = 2 * reorder_tol(forward_terms(CFG, P_WIDTH + M), scale=10.0)
# bytes of keys and values of one position: 2 (k, v) × L × K × E × 4 (float32)
POSITION_BYTES = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  toks = np.zeros((N, P_WIDTH), np.int32)
  mask = np.zeros((N, P_WIDTH), bool)
  for i, n in enumerate(LENGTHS):
    toks[i, P_WIDTH - n:] = rng.integers(8, CFG.vocab_size, n)
    mask[i, P_WIDTH - n:] = True
  return toks, mask


def run(policy, prompts, temperature, **kw):
  graphdef, params = policy
  return engine.run(graphdef, params, *prompts, jax.random.key(3), temperature=temperature,
                    **(KW | kw))


def assert_same(a, b):
  """Equal tokens, lengths and versions; log-probs within LOGP_ATOL."""
  for i in (0, 3, 4):
    np.testing.assert_array_equal(a[i], b[i])
  for i in (1, 2):
    np.testing.assert_allclose(a[i], b[i], rtol=0, atol=LOGP_ATOL)


def assert_pool_empty(stats, pages):
  paging.check_pool(stats.pool)
  assert stats.pool.refcount.shape == (pages,)
  assert stats.pool.num_free == pages
  assert not stats.pool.mapped.any()


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["greedy", "sampled"])
def contiguous(request, policy, prompts):
  return request.param, run(policy, prompts, request.param)


@pytest.mark.numerics
def test_paged_equals_contiguous(policy, prompts, contiguous):
  temperature, ref = contiguous
  out = run(policy, prompts, temperature, paged=True, page_size=PAGE)
  assert_same(ref, out)
  assert ref[3].max() > 2 * PAGE  # completions that cross several pages
  stats = out[5]
  assert stats.inserts > 1 and stats.row_steps == ref[5].row_steps  # refilled, same schedule
  # the default pool: every slot at full length, ceil((12 + 20) / 4) = 8 pages each
  assert_pool_empty(stats, SLOTS * 8)
  assert 0 < stats.peak_pages < SLOTS * 8
  assert stats.kv_needed == ref[5].kv_needed
  assert stats.kv_needed <= stats.kv_read < stats.kv_needed + stats.row_steps * PAGE
  assert stats.kv_bytes_held == stats.peak_pages * PAGE * POSITION_BYTES
  assert ref[5].kv_bytes_held == SLOTS * (P_WIDTH + M) * POSITION_BYTES


@pytest.mark.numerics
def test_pool_too_small_for_all_slots_waits(policy, prompts, contiguous):
  """9 pages: one request at full length (8 pages) at a time, the longest prompt's."""
  temperature, ref = contiguous
  out = run(policy, prompts, temperature, paged=True, page_size=PAGE, num_pages=9)
  assert_same(ref, out)
  stats = out[5]
  assert_pool_empty(stats, 9)
  assert stats.peak_pages <= 9
  assert stats.inserts > ref[5].inserts  # requests entered as others released their pages


@pytest.mark.numerics
@pytest.mark.parametrize("score_bytes", [engine.REFRESH_SCORE_BYTES, 1])
def test_in_flight_weight_swap(policy, prompts, score_bytes, monkeypatch):
  """Version 1 replaces version 0 before the third decode chunk: the paged slots are
  re-prefilled into their pages (a shared prompt page once) as the contiguous ones are,
  whether the contiguous cache re-prefills every slot at once or one slot at a time
  (``engine.REFRESH_SCORE_BYTES`` = 1: ``refresh_slot_block`` is 1)."""
  monkeypatch.setattr(engine, "REFRESH_SCORE_BYTES", score_bytes)
  assert engine.refresh_slot_block(CFG, SLOTS, 32) == (SLOTS if score_bytes > 1 else 1)
  graphdef, _ = policy
  _, new = nnx.split(Transformer(CFG, nnx.Rngs(1)), nnx.Param)

  def weights_after(chunks):
    calls = []

    def weights():
      calls.append(1)
      return (new, 1) if len(calls) > chunks else None
    return weights

  ref = run(policy, prompts, 1.0, weights=weights_after(2))
  out = run(policy, prompts, 1.0, weights=weights_after(2), paged=True, page_size=PAGE)
  assert_same(ref, out)
  assert ref[5].swaps == out[5].swaps == 1
  assert set(np.unique(ref[4])) == {0, 1}  # both versions sampled tokens
  assert_pool_empty(out[5], SLOTS * 8)


def swap_after(chunks, params, version):
  """A weight source that returns (params, version) from its call ``chunks`` + 1 on."""
  calls = []

  def weights():
    calls.append(1)
    return (params, version) if len(calls) > chunks else None
  return weights


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_keep_kv_swap_records_the_version_of_each_tokens_logits(policy, prompts, paged):
  """``on_weight_swap='keep_kv'`` with the same parameters published as version 1 before
  the third chunk: nothing is re-prefilled, so the tokens and log-probs are the run's
  without a swap, bit for bit; a request decoding at the swap draws its next token from
  the logits version 0 computed, so it records one more version-0 token than under
  'recompute' (which re-prefills and records 1 from the swap on); requests that finished
  before or started after are all 0 or all 1 under both."""
  _, params = policy
  kw = dict(paged=paged, page_size=PAGE) if paged else {}
  plain = run(policy, prompts, 1.0, **kw)
  keep = run(policy, prompts, 1.0, weights=swap_after(2, params, 1), on_weight_swap="keep_kv",
             **kw)
  recompute = run(policy, prompts, 1.0, weights=swap_after(2, params, 1), **kw)
  for i in (0, 1, 2, 3):
    np.testing.assert_array_equal(keep[i], plain[i])
  assert keep[5].swaps == recompute[5].swaps == 1
  np.testing.assert_array_equal(recompute[3], plain[3])  # same lengths (same draws)
  length = plain[3]
  written = np.arange(M)[None, :] < length[:, None]
  zeros_keep = ((keep[4] == 0) & written).sum(1)
  zeros_rec = ((recompute[4] == 0) & written).sum(1)
  decoding = (zeros_rec > 0) & (zeros_rec < length)
  assert decoding.any() and (~decoding).any()
  np.testing.assert_array_equal(zeros_keep, zeros_rec + decoding)
  for versions in (keep[4], recompute[4]):  # 0s, then 1s, in every request
    assert (np.diff(np.where(written, versions, 1), axis=1) >= 0).all()


def test_keep_kv_swap_samples_from_the_new_parameters(policy, prompts):
  """``keep_kv`` with other parameters: every token recorded as version 0 is the run
  without a swap's (same keys, parameters and cache up to it), and the tokens recorded as
  version 1 come from the new parameters (they differ from that run's)."""
  _, new = nnx.split(Transformer(CFG, nnx.Rngs(1)), nnx.Param)
  plain = run(policy, prompts, 1.0)
  keep = run(policy, prompts, 1.0, weights=swap_after(2, new, 1), on_weight_swap="keep_kv")
  before = np.arange(M)[None, :] < np.minimum(keep[3], plain[3])[:, None]
  old = before & (keep[4] == 0)
  np.testing.assert_array_equal(keep[0][old], plain[0][old])
  np.testing.assert_array_equal(keep[1][old], plain[1][old])
  newer = before & (keep[4] == 1)
  assert newer.any() and (keep[0][newer] != plain[0][newer]).any()


def test_unknown_on_weight_swap_names_the_field(policy, prompts):
  with pytest.raises(ValueError,
                     match="sampler.on_weight_swap='keep'; valid: 'recompute', 'keep_kv'"):
    run(policy, prompts, 1.0, on_weight_swap="keep")


@pytest.mark.numerics
def test_peak_pages_of_one_group_by_hand(policy, prompts):
  """Prompt 3 (5 positions) × G = 2 on 2 slots, both forced to 8 tokens in one chunk of 8:
  the insert maps 1 shared page + 1 private last page per slot (3 pages); the chunk's
  reserve grows each slot to 5 + 8 = 13 positions, 4 pages (1 shared + 3 private): 7."""
  graphdef, params = policy
  toks, mask = (x[3:4] for x in prompts)
  kw = dict(max_new_tokens=8, temperature=1.0, eos_ids=(2,), pad_id=0, group_size=2, slots=2,
            chunk_steps=8, forced_lengths=[8, 8])
  ref = engine.run(graphdef, params, toks, mask, jax.random.key(3), **kw)
  out = engine.run(graphdef, params, toks, mask, jax.random.key(3), paged=True, page_size=PAGE,
                   **kw)
  assert_same(ref, out)
  stats = out[5]
  assert stats.peak_pages == 7
  assert stats.kv_bytes_held == 7 * PAGE * POSITION_BYTES
  assert stats.kv_bytes_per_token == 7 * PAGE * POSITION_BYTES / 16
  # steps write positions 5 .. 12: step t reads length 6 + t, i.e. 2, 2, 2, 3, 3, 3, 3, 4 pages
  assert stats.kv_needed == 2 * sum(range(6, 14))
  assert stats.kv_read == 2 * PAGE * (2 + 2 + 2 + 3 + 3 + 3 + 3 + 4)
  assert_pool_empty(stats, 2 * 5)  # the default pool: 2 slots × ceil((12 + 8) / 4) pages


def test_fill_pages_shares_full_prompt_pages():
  """9 positions in pages of 4 for 3 slots: pages 0, 1 shared (refcount 3), each slot's last
  prompt page private (pages 2, 3, 4); the writes copy the shared pages once."""
  pool = paging.init_pool(20, PAGE, 8, 4)
  pool, writes = engine._fill_pages(pool, np.array([0, 2, 3]), np.array([0, 0, 0]),
                                    np.array([9], np.int32), 8)
  paging.check_pool(pool)
  np.testing.assert_array_equal(pool.refcount[:6], [3, 3, 1, 1, 1, 0])
  np.testing.assert_array_equal(pool.page_indices[:, :3], [[0, 1, 2], [0, 0, 0], [0, 1, 3],
                                                           [0, 1, 4]])
  np.testing.assert_array_equal(pool.shared, [2, 0, 2, 2])
  np.testing.assert_array_equal(np.stack(writes), [[0, 0, 0, 0, 0, 0, 0, 0],
                                                   [0, 1, 2, 2, 2, 0, 0, 0],
                                                   [0, 1, 2, 3, 4, 20, 20, 20]])


def test_admission_waits_for_full_length():
  """Requests of a prompt whose full length takes 8 pages, 2 of them complete prompt pages
  (shared by its samples). A pool of 10 with a decoding slot holding 3 of its 8 pages: 7
  free, 5 promised to that slot, 2 left: none fits. The empty pool of 10: the first takes
  8, the second 8 - 2 = 6 more: one fits. A pool of 14: both."""
  pool = paging.init_pool(10, PAGE, 8, 2)
  pool, _ = paging.reserve(pool, 0, 12)
  live = np.array([True, False])
  worst, full = np.array([8]), np.array([2])
  assert engine._admit(pool, np.array([0, 0]), worst, full, np.array([8]), live) == 0
  empty = paging.release(pool, 0)
  assert engine._admit(empty, np.array([0, 0]), worst, full, np.zeros(0, int), ~live) == 1
  big = paging.init_pool(14, PAGE, 8, 2)
  assert engine._admit(big, np.array([0, 0]), worst, full, np.zeros(0, int), ~live) == 2


def test_bad_paged_settings_raise(policy, prompts):
  with pytest.raises(ValueError, match="sampler.num_pages=7 must be 0 or >= 8"):
    run(policy, prompts, 1.0, paged=True, page_size=PAGE, num_pages=7)
  with pytest.raises(ValueError, match="sampler.attention must be one of 'auto', 'xla', "
                                       "'pallas'; got 'flash'"):
    run(policy, prompts, 1.0, paged=True, attention="flash")


@pytest.mark.numerics
def test_paged_on_a_mesh_matches_contiguous_one_device(policy, prompts):
  """On a data × fsdp × tensor = 2 × 2 × 2 mesh (slots over data × fsdp, the pool's KV heads
  over tensor, its pages replicated) the paged engine samples the one-device tokens."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  temperature = 1.0
  ref = run(policy, prompts, temperature)  # the contiguous fixture's shapes: compiled once
  graphdef, params = policy
  gen, stats = generate(graphdef, params, *prompts, jax.random.key(3), temperature=temperature,
                        mesh=make_mesh(data=2, fsdp=2, tensor=2), paged=True, page_size=PAGE,
                        return_stats=True, **KW)
  np.testing.assert_array_equal(np.asarray(gen.length), ref[3])
  np.testing.assert_array_equal(np.where(np.asarray(gen.mask), np.asarray(gen.tokens), -1),
                                np.where(np.asarray(gen.mask), ref[0], -1))
  np.testing.assert_allclose(np.asarray(gen.logprobs),
                             np.where(np.asarray(gen.mask), ref[1], 0.0), rtol=0, atol=LOGP_ATOL)
  assert_pool_empty(stats, SLOTS * 8)


def test_weight_swap_refresh_temporaries_follow_the_slot_block(policy):
  """The compiled re-prefill of 16 slots × 256 positions: its temporaries (XLA's memory
  analysis) with one slot at a time are a fraction of every slot's at once, whose
  attention scores alone are 16 × 4 heads × 256² × 4 bytes = 16 MiB."""
  graphdef, params = policy
  slots, width = 16, 256
  state = jax.eval_shape(lambda: engine.init_state(CFG, slots, width, 4, 8, 0))
  temp = {}
  for block in (0, 1):
    compiled = engine._refresh.lower(graphdef, params, state, width=width, mesh=None,
                                     slot_block=block).compile()
    temp[block] = compiled.memory_analysis().temp_size_in_bytes
  scores = slots * CFG.n_heads * width * width * 4
  assert temp[0] >= scores  # every slot's scores at once
  assert temp[1] < temp[0] / 4 and temp[1] < scores / 2


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_weight_swap_refresh_in_slot_blocks_equals_all_at_once_on_a_mesh(policy):
  """8 slots split over 4 devices: re-prefilling one slot per device at a time (4 blocks)
  gives every slot the keys, values and next-token logits of all slots at once."""
  import jax.numpy as jnp
  graphdef, params = policy
  mesh = make_mesh(4, 1, 1, devices=jax.devices()[:4])
  state = engine.init_state(CFG, 8, 32, 4, 8, 0)
  rng = np.random.default_rng(1)
  state = state.replace(seq=jnp.asarray(rng.integers(4, CFG.vocab_size, (8, 32)), jnp.int32),
                        length=jnp.asarray([1, 5, 9, 12, 17, 20, 26, 31], jnp.int32),
                        done=jnp.asarray([False, False, True, False, False, True, False, False]))
  place = lambda: jax.device_put(jax.tree.map(jnp.copy, state),  # the call donates it
                                 engine._slot_sharding(mesh, state))
  whole = engine._refresh(graphdef, params, place(), width=32, mesh=mesh, slot_block=0)
  blocks = engine._refresh(graphdef, params, place(), width=32, mesh=mesh, slot_block=1)
  live = ~np.asarray(state.done)
  np.testing.assert_allclose(np.asarray(blocks.k), np.asarray(whole.k), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(blocks.v), np.asarray(whole.v), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(blocks.last_logits)[live],
                             np.asarray(whole.last_logits)[live], rtol=0, atol=1e-5)
  # a finished slot keeps its logits; a live one's are its prefill's (not zero any more)
  np.testing.assert_array_equal(np.asarray(blocks.last_logits)[~live], 0.0)
  assert np.abs(np.asarray(blocks.last_logits)[live]).min(-1).max() > 0
  assert blocks.k.sharding == whole.k.sharding
