"""The decode engine: S decode slots, prefill-and-insert, decode chunks over the filled cache.

Requests are (prompt, sample) pairs: request r samples completion r % G of prompt r // G.
The engine holds S slots, each a KV cache of C = P + M positions in which the prompt fills
positions 0 .. len-1 (compacted to the left) and the completion follows. Between decode
chunks the host loop (``_HostLoop``, one method per step)

1. **inserts** waiting requests into free slots: the distinct prompts among them are
   prefilled once, in one batch, and each prompt's keys and values are copied into the
   slots of all its samples — the KV cache of a prompt is shared by its G samples rather
   than recomputed G times (JetStream's prefill → insert);
2. runs a **decode chunk** of up to k steps (``jax.lax.while_loop``, exits early when every
   slot is done) whose attention reads only the first w cache positions, w the longest
   filled slot plus k rounded up to four sizes per octave (``width_bucket``) — so a step's
   cost follows the filled length, not the capacity C — and on the CPU at least the width
   below which attention is an eighth of a step's FLOPs (``attention_floor``: a small
   model's short cache then decodes at one width, one compilation);
3. **shrinks** the batch to a smaller power-of-two bucket once no request waits and at most
   half of the slots still decode (the tail of a batch no longer computes finished rows).

A **stream** of rounds (``stream``, the actor–learner split's generator) keeps one set of
slots across rounds: the next round is taken as soon as every request held is admitted,
its requests fill the slots the round before frees while that round's stragglers finish,
and each round is handed on, in order, when its last request is done (the round regions
of the request ids: ``_Stream``). A stream never shrinks its slots.

Shapes are static per (slots, width) bucket, so XLA compiles a bounded set of programs:
at most about 4·log2(C / 64) widths × log2(S / 8) batch sizes (one width and one size when
every request fits in the slots and M is short), plus one prefill program per power-of-two
prompt count and width.

Random bits: the token of request r at step t is drawn with ``fold_in(fold_in(key, r), t)``
(``distribution.categorical`` with one key per row), so a request's tokens depend neither
on its slot, nor on the slot count, nor on the refill order.

Sharding: with a mesh, the slot axis of every per-slot array splits over ``("data",
"fsdp")`` and the cache's KV heads over ``"tensor"``; parameters keep their placement.
Where the parameters are replicated on every device of the mesh (a generator mesh with
``mesh.generator_tensor=1``) and the cache is contiguous, the decode chunk runs as one engine
per device (``engine_replicas``, ``jax.shard_map``): each device decodes its own slots, runs
its own loop and writes its own output buffer, with no collective per decoded token; the
host merges the buffers once, at the end of the call.

Paged cache (``run(paged=True)``, ``sampling.paged``): the keys and values live in one pool
of N pages of ``page_size`` positions per layer, [L, K, N, page_size, E], and each slot has a
page table (host ``paged.PagePool``, sent to the device once per chunk). An insert prefills
each prompt once and writes its completely filled pages once, mapped read-only into the
slots of all its samples in that insert; each sample gets a private copy of the partially
filled last prompt page, where its completion continues. Before each decode chunk every
decoding slot is given the pages its next k steps write; a finished request's pages return
to the pool after the chunk. Decode attention goes through ``paged.paged_decode_attention``
(xla gather or a Pallas kernel, ``sampler.attention``).

Pool policy (wait, never preempt): a request is admitted only when the pool can hold it at
its full length (prompt + M) on top of the full lengths of every request already decoding,
counting shared prompt pages once. Decoding slots therefore always get their next pages
(no request is ever stopped or recomputed); when the pool is short, fewer slots are filled
and the waiting requests enter as finished ones release their pages. Pages are still taken
only as positions are written, so the pages in use follow the filled lengths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.models import attention
from jaxreplay.parallel import multihost
from jaxreplay.parallel.sharding import BATCH_AXES, batch_sharding, batch_shards, fit_spec
from jaxreplay.sampling import paged as paging
from jaxreplay.sampling.distribution import sample_token

MIN_WIDTH = 64  # smallest attention width bucket (positions)
MIN_SLOTS = 8  # the tail shrinks the batch down to this many slots, not below
PREFILL_PROMPTS = 32  # most prompts one insert call prefills
ON_WEIGHT_SWAP = ("recompute", "keep_kv")  # what an in-flight weight swap does to the caches


@flax.struct.dataclass
class SlotState:
  """The engine's device state for S slots, C cache positions and R requests.

  Attributes:
    k, v: [L, S, K, C, E] per-slot keys and values (activation dtype); positions at or
      past ``length`` hold stale values that attention masks out.
    length: [S] int32 filled cache positions (prompt + completion tokens so far).
    last_logits: [S, V] float32 logits of the next token of each slot.
    request: [S] int32 request id of the slot (R for a slot that never held one).
    step: [S] int32 tokens sampled so far for that request.
    done: [S] bool, the slot is free (stopped, truncated at M, or never filled).
    tokens: [D, R + 1, M] int32 completions by request (row R absorbs writes of free
      slots), one buffer per engine replica (``engine_replicas``: D = 1 for one program
      over the mesh); replica d holds the tokens its own slots sampled, ``pad_id``
      elsewhere (``_merge_replicas``).
    logprobs, full_logprobs: [D, R + 1, M] float32 behaviour log-probs (truncated and
      untruncated distribution, ``distribution.sample_token``; 0 where another replica
      sampled).
    versions: [D, R + 1, M] int32 policy version of the parameters that sampled each token
      (0 where another replica sampled).
    seq: [S, C] int32 the slot's tokens (prompt at 0 .. len-1, then the completion so far):
      what a weight swap re-prefills (``_refresh``).
    logits_version: [S] int32 policy version of the parameters that computed ``last_logits``
      (the version the slot's next token records: after a ``keep_kv`` swap, a decoding
      slot's first token still comes from the old parameters' logits).
    paged: static; True when ``k``, ``v`` are a page pool [L, K, N, page_size, E] (the
      page tables stay on the host, ``paged.PagePool``) instead of per-slot caches.
  """

  k: jax.Array
  v: jax.Array
  length: jax.Array
  last_logits: jax.Array
  request: jax.Array
  step: jax.Array
  done: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  full_logprobs: jax.Array
  versions: jax.Array
  seq: jax.Array
  logits_version: jax.Array
  paged: bool = flax.struct.field(pytree_node=False, default=False)


@dataclasses.dataclass
class EngineStats:
  """Work counters of one ``run`` (host integers).

  Attributes:
    row_steps: decode row-steps executed (slots × steps over every chunk).
    useful_row_steps: row-steps that sampled a token of a request (= generated tokens).
    kv_read: cache positions read by decode attention: contiguous, slots × width per step;
      paged, the positions of each decoding slot's pages up to its length + 1 (Σ of
      pages × page_size): what a kernel that stops at the slot's length reads in whole
      pages (the Pallas kernels stop there in whole compute blocks of several pages; the
      xla gather reads the chunk's table width, ``kv_table_read``).
    kv_needed: positions a step needed (Σ over decoding slots of their filled length + 1).
    kv_table_read: paged only, positions the xla gather reads (slots × the chunk's page
      table width × page_size per step); 0 for the contiguous cache.
    kv_bytes_held: bytes of keys and values held at the peak: contiguous, the whole cache
      (S × C positions); paged, the peak pages in use × bytes per page (a shared prompt
      page counted once). ``kv_bytes_per_token`` divides it by the generated tokens.
    peak_pages: paged only, most pages in use at once (after an insert or a reserve).
    page_size: paged only, positions per page (0 for the contiguous cache).
    pool: paged only, the final ``paged.PagePool`` (every page free after ``run``).
    prefill_rows, prefill_tokens: prompts prefilled and the positions computed for them
      (prefill rows × bucketed prompt width).
    chunks: decode chunks run. inserts: insert calls. programs: distinct
      (slots, width) decode shapes used.
    swaps: in-flight weight swaps (new parameters taken between decode chunks).
  """

  row_steps: int = 0
  useful_row_steps: int = 0
  kv_read: int = 0
  kv_needed: int = 0
  prefill_rows: int = 0
  prefill_tokens: int = 0
  chunks: int = 0
  inserts: int = 0
  programs: int = 0
  swaps: int = 0
  kv_table_read: int = 0
  kv_bytes_held: int = 0
  peak_pages: int = 0
  page_size: int = 0
  pool: object = dataclasses.field(default=None, repr=False)

  @property
  def kv_read_needed(self) -> float:
    """KV positions needed ÷ read (float; 1 = no wasted read)."""
    return self.kv_needed / max(self.kv_read, 1)

  @property
  def kv_bytes_per_token(self) -> float:
    """KV bytes held at the peak ÷ generated tokens (float)."""
    return self.kv_bytes_held / max(self.useful_row_steps, 1)


def _pow2_at_least(n: int, lo: int) -> int:
  return max(lo, 1 << max(int(n) - 1, 0).bit_length())


def width_bucket(needed: int, capacity: int, floor: int = MIN_WIDTH) -> int:
  """Attention width for a chunk: ``needed`` rounded up to four sizes per octave (m · 2^j,
  4 <= m < 8: 64, 80, 96, 112, 128, 160, ...; at least ``floor``), capped at the cache
  capacity C. At most 25% of the read is beyond ``needed`` (or up to ``floor``), and
  lengths 64 .. 4096 use at most 24 widths.

  Args:
    needed: positions the chunk's longest slot will reach (int >= 0). capacity: C.
    floor: the least width (``attention_floor``; at least ``MIN_WIDTH``).

  Returns:
    int width w in [min(floor, C), C], in cache positions.
  """
  n = max(int(needed), int(floor), MIN_WIDTH)
  step = 1 << max(0, n.bit_length() - 3)
  return min(capacity, -(-n // step) * step)


def attention_floor(cfg) -> int:
  """The attention width below which a decode step's attention is at most an eighth of
  its FLOPs: narrower width buckets would save little compute and cost a compilation each.
  The engine uses it on the CPU, where decoding is compute-bound; on GPUs and TPUs a step
  is bound by memory traffic, in which each slot's cache read weighs against weights read
  once for all slots, and widths start at ``MIN_WIDTH``.

  Per token, a decoder's matmuls take 2N FLOPs and attention over w positions 4·L·H·E·w
  (``train.accounting``: Kaplan et al. 2020, Table 1; Chinchilla App. F), so attention is
  at most an eighth for w <= N / (16·L·H·E), with N the parameters a token's matmuls read
  (untied: without the input embedding). SmolLM2-135M: 486 positions, so its contiguous
  cache of prompt + 128 new tokens decodes at one width; the default tiny model: 100.

  Args:
    cfg: the policy's ``TransformerConfig`` (D, L, H, K, E, F, V; the vocabulary counts
      once, as the output head, tied or not).

  Returns:
    int positions, >= ``MIN_WIDTH``.
  """
  d, h, k, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  n = cfg.n_layers * (2 * d * h * e + 2 * d * k * e + 3 * d * cfg.d_ff) + cfg.vocab_size * d
  return max(MIN_WIDTH, n // (16 * cfg.n_layers * h * e))


def _slot_sharding(mesh: Mesh, state: SlotState) -> SlotState:
  """Shardings of ``state``: slots (and the replicas' output buffers) over data × fsdp, KV
  heads over tensor."""
  def sh(spec, x):
    return NamedSharding(mesh, fit_spec(spec, x.shape, mesh))

  def batch(x):
    return sh(P(BATCH_AXES, *([None] * (x.ndim - 1))), x)

  if state.paged:  # pages are shared by any slots: only the KV heads split
    kv = sh(P(None, "tensor", None, None, None), state.k)
  else:
    kv = sh(P(None, BATCH_AXES, "tensor", None, None), state.k)
  # the output buffers: one per engine replica (D = 1: replicated)
  return SlotState(k=kv, v=kv, length=batch(state.length), last_logits=batch(state.last_logits),
                   request=batch(state.request), step=batch(state.step), done=batch(state.done),
                   tokens=batch(state.tokens), logprobs=batch(state.logprobs),
                   full_logprobs=batch(state.full_logprobs), versions=batch(state.versions),
                   seq=batch(state.seq), logits_version=batch(state.logits_version),
                   paged=state.paged)


def _constrain(state: SlotState, mesh: Mesh | None) -> SlotState:
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, _slot_sharding(mesh, state))


def _blocks(model):
  """(per-layer apply(fn, carry) helper): runs ``fn(block, layer_index, carry)`` over the
  layers, a Python loop for the list layout and a ``lax.scan`` for stacked blocks."""
  if model.cfg.scan_layers:
    graphdef, stacked = nnx.split(model.blocks)

    def over(fn, carry):
      def body(c, xs):
        layer, i = xs
        return fn(nnx.merge(graphdef, layer), i, c)
      out, ys = jax.lax.scan(body, carry, (stacked, jnp.arange(model.cfg.n_layers, dtype=jnp.int32)))
      return out, ys
    return over

  def over(fn, carry):
    ys = []
    for i, blk in enumerate(model.blocks):
      carry, y = fn(blk, i, carry)
      ys.append(y)
    return carry, (None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys))
  return over


def prefill(model, tokens: jax.Array, lengths: jax.Array, mesh: Mesh | None = None):
  """Runs left-aligned prompts through the model once and keeps their keys and values.

  Attention is causal over each prompt's real tokens, through the model's full-sequence
  attention (``cfg.attention``: XLA, or cuDNN / splash, ``models.attention``).

  Args:
    model: a ``models.Transformer``. mesh: the mesh the prompt rows are split over, if
      any (a splash kernel then runs per device, ``attention.kernel_mesh``).
    tokens: [N, W] int32 prompts, real tokens at positions 0 .. len-1, padding after.
    lengths: [N] int32 real lengths, >= 1.

  Returns:
    (k, v [L, N, K, W, E] in the activation dtype (RoPE applied to k), logits [N, V]
     float32 of the token after each prompt's last real one).
  """
  n, w = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (n, w))
  cfg = model.cfg

  def layer(blk, i, x):
    q, k, v = blk.attn.project(blk.attn_norm(x), positions)  # q [N, W, H, E]; k, v [N, K, W, E]
    y = attention.causal_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                   impl=cfg.attention, lengths=lengths)
    x = x + blk.attn.o(y.reshape(n, w, cfg.n_heads * cfg.head_dim))
    return x + blk.mlp(blk.mlp_norm(x)), (k, v)

  with attention.kernel_mesh(mesh):
    x, (k, v) = _blocks(model)(layer, model._embed(tokens))
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [N, 1, D]
  return k, v, model.project_logits(model.final_norm(last))[:, 0]


def decode_step(model, tok: jax.Array, length: jax.Array, ck: jax.Array, cv: jax.Array,
                width: int):
  """One token per slot against the cache, attention over the first ``width`` positions.

  Writes each slot's new key and value at position ``length`` (dropped past the capacity)
  and attends to positions 0 .. length, which must lie within ``width``.

  Args:
    model: a ``models.Transformer``. tok: [S] int32 token ids. length: [S] int32, the
      position of ``tok`` (= filled length before it). ck, cv: [L, S, K, C, E].
    width: static, attention reads cache positions [0, width).

  Returns:
    (logits [S, V] float32 of the next token, ck, cv).
  """
  cfg = model.cfg
  s = tok.shape[0]
  g = cfg.n_heads // cfg.n_kv_heads
  rows = jnp.arange(s)
  visible = jnp.arange(width)[None, :] <= length[:, None]  # [S, width]

  def layer(blk, i, carry):
    x, ck, cv = carry
    q, k, v = blk.attn.project(blk.attn_norm(x), length[:, None])  # q [S,1,H,E]; k [S,K,1,E]
    ck = ck.at[i, rows, :, length, :].set(k[:, :, 0].astype(ck.dtype), mode="drop")
    cv = cv.at[i, rows, :, length, :].set(v[:, :, 0].astype(cv.dtype), mode="drop")
    keys = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False)[:, :, :width]  # [S,K,w,E]
    vals = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False)[:, :, :width]
    qg = q[:, 0].reshape(s, cfg.n_kv_heads, g, cfg.head_dim)
    logits = jnp.einsum("skge,skwe->skgw", qg, keys,
                        preferred_element_type=jnp.float32) * cfg.head_dim ** -0.5
    logits = jnp.where(visible[:, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(vals.dtype)
    y = jnp.einsum("skgw,skwe->skge", probs, vals).reshape(s, 1, cfg.n_heads * cfg.head_dim)
    x = x + blk.attn.o(y)
    return (x + blk.mlp(blk.mlp_norm(x)), ck, cv), None

  (x, ck, cv), _ = _blocks(model)(layer, (model._embed(tok[:, None]), ck, cv))
  return model.project_logits(model.final_norm(x))[:, 0], ck, cv


def decode_step_paged(model, tok: jax.Array, length: jax.Array, kp: jax.Array, vp: jax.Array,
                      page_indices: jax.Array, valid: jax.Array, impl: str = "xla"):
  """One token per slot against the paged cache (``decode_step``'s paged counterpart).

  Writes each valid slot's new key and value at position ``length`` (page
  ``page_indices[s, length // page_size]``, which the caller has reserved for the slot) and
  attends to positions 0 .. length through ``paged.paged_decode_attention``. Slots with
  ``valid`` False write nothing (their table rows may point at pages of other slots).

  Args:
    model: a ``models.Transformer``. tok: [S] int32 token ids. length: [S] int32, the
      position of ``tok``. kp, vp: [L, K, N, page_size, E] the page pool.
    page_indices: [S, W] int32 page table (W pages cover every valid slot's length + 1).
    valid: [S] bool, the slots that decode. impl: static, 'xla' | 'pallas_gpu' |
      'pallas_tpu' (``paged.resolve_impl``).

  Returns:
    (logits [S, V] float32 of the next token, kp, vp).
  """
  cfg = model.cfg
  s = tok.shape[0]
  # a slot that does not decode attends to nothing: its length may lie past the table,
  # which a kernel would read out of bounds
  lengths = jnp.where(valid, length + 1, 0)

  def layer(blk, i, carry):
    x, kp, vp = carry
    q, k, v = blk.attn.project(blk.attn_norm(x), length[:, None])  # q [S,1,H,E]; k [S,K,1,E]
    kl = paging.write_decode_kv(jax.lax.dynamic_index_in_dim(kp, i, 0, keepdims=False),
                               page_indices, length, k[:, :, 0], valid)
    vl = paging.write_decode_kv(jax.lax.dynamic_index_in_dim(vp, i, 0, keepdims=False),
                               page_indices, length, v[:, :, 0], valid)
    kp = jax.lax.dynamic_update_index_in_dim(kp, kl, i, 0)
    vp = jax.lax.dynamic_update_index_in_dim(vp, vl, i, 0)
    y = paging.paged_decode_attention(q[:, 0], kl, vl, lengths, page_indices, impl=impl,
                                      scale=cfg.head_dim ** -0.5)
    x = x + blk.attn.o(y.reshape(s, 1, cfg.n_heads * cfg.head_dim))
    return (x + blk.mlp(blk.mlp_norm(x)), kp, vp), None

  (x, kp, vp), _ = _blocks(model)(layer, (model._embed(tok[:, None]), kp, vp))
  return model.project_logits(model.final_norm(x))[:, 0], kp, vp


def init_state(cfg, slots: int, capacity: int, requests: int, max_new_tokens: int,
               pad_id: int, num_pages: int = 0, page_size: int = 0,
               replicas: int = 1) -> SlotState:
  """An engine state with every slot free.

  Args:
    cfg: the model's ``TransformerConfig`` (L, K, E, V, activation dtype). slots: S.
    capacity: C cache positions per slot. requests: R. max_new_tokens: M.
    pad_id: the id the output tokens start as.
    num_pages, page_size: with num_pages >= 1, ``k`` and ``v`` are a page pool [L, K,
      num_pages, page_size, E] (``paged`` True); 0 keeps the contiguous [L, S, K, C, E].
    replicas: D, the engine replicas whose output buffers the state holds
      (``engine_replicas``).

  Returns:
    ``SlotState`` (shapes and dtypes in its docstring), zero caches, ``done`` all True.
  """
  kv = (cfg.n_layers, slots, cfg.n_kv_heads, capacity, cfg.head_dim)
  if num_pages:
    kv = (cfg.n_layers, cfg.n_kv_heads, num_pages, page_size, cfg.head_dim)
  out = (replicas, requests + 1, max_new_tokens)
  return SlotState(k=jnp.zeros(kv, cfg.dtype), v=jnp.zeros(kv, cfg.dtype),
                   length=jnp.zeros((slots,), jnp.int32),
                   last_logits=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
                   request=jnp.full((slots,), requests, jnp.int32),
                   step=jnp.zeros((slots,), jnp.int32), done=jnp.ones((slots,), bool),
                   tokens=jnp.full(out, pad_id, jnp.int32), logprobs=jnp.zeros(out, jnp.float32),
                   full_logprobs=jnp.zeros(out, jnp.float32), versions=jnp.zeros(out, jnp.int32),
                   seq=jnp.full((slots, capacity), pad_id, jnp.int32),
                   logits_version=jnp.zeros((slots,), jnp.int32), paged=bool(num_pages))


def _write_pages(pages: jax.Array, kv: jax.Array, writes) -> jax.Array:
  """Copies whole pages of prefilled keys (or values) into the pool.

  Args:
    pages: [L, K, N, page_size, E] the pool. kv: [L, R, K, W, E] prefilled rows.
    writes: (src_row, src_page, dst) [nw] int32 each: page ``dst`` takes positions
      src_page · page_size .. + page_size - 1 of row ``src_row`` (zeros past W); a ``dst``
      of N drops the write.

  Returns:
    [L, K, N, page_size, E] the updated pool.
  """
  src_row, src_page, dst = writes
  page_size = pages.shape[3]
  w = kv.shape[3]
  wp = -(-w // page_size)
  kv = jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, wp * page_size - w), (0, 0)))
  kv = kv.reshape(kv.shape[:3] + (wp, page_size, kv.shape[-1])).swapaxes(2, 3)  # [L,R,Wp,K,ps,E]
  new = kv[:, src_row, src_page]  # [L, nw, K, ps, E]
  return pages.at[:, :, dst].set(jnp.swapaxes(new, 1, 2).astype(pages.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("state",))
def _insert(graphdef, params, state: SlotState, prompts, prompt_len, fill, source, request,
            writes=None, version=0, *, mesh):
  """Prefills ``prompts`` [N, W] once; every slot s with ``fill[s]`` ([S] bool) takes
  prompt ``source[s]``'s cache for request ``request[s]`` ([S] int32 each); ``version``
  (int32 scalar) is the policy version of ``params``.

  Written per slot (a gather of the N prefilled prompts, then a select), so with a mesh the
  slots' arrays stay split as the state is and only the N prompts' keys and values move.
  A paged state instead takes ``writes`` (``_write_pages``: each prompt's shared pages
  once, each slot's private last prompt page)."""
  model = nnx.merge(graphdef, params)
  k, v, logits = prefill(model, prompts, prompt_len, mesh)
  w = prompts.shape[1]
  sharding = None if mesh is None else _slot_sharding(mesh, state)
  if state.paged:
    state = state.replace(k=_write_pages(state.k, k, writes), v=_write_pages(state.v, v, writes))

  def per_slot(x, axis, like):
    x = jnp.take(x, source, axis=axis)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, like)

  def put(dst, new, axis=0):
    keep = fill.reshape((-1,) + (1,) * (dst.ndim - axis - 1))
    return jnp.where(keep, new.astype(dst.dtype), dst)

  kv_sh = None if sharding is None else sharding.k
  if not state.paged:
    state = state.replace(
        k=state.k.at[:, :, :, :w].set(put(state.k[:, :, :, :w], per_slot(k, 1, kv_sh), 1)),
        v=state.v.at[:, :, :, :w].set(put(state.v[:, :, :, :w], per_slot(v, 1, kv_sh), 1)))
  state = state.replace(
      length=put(state.length, prompt_len[source]),
      last_logits=put(state.last_logits,
                      per_slot(logits, 0, None if sharding is None else sharding.last_logits)),
      request=put(state.request, request), step=jnp.where(fill, 0, state.step),
      done=state.done & ~fill, logits_version=jnp.where(fill, version, state.logits_version),
      seq=state.seq.at[:, :w].set(put(state.seq[:, :w], per_slot(
          prompts, 0, None if sharding is None else sharding.seq))))
  return _constrain(state, mesh)


def _force_lengths(logits, step, target, eos_ids):
  """Logits that stop a request at exactly ``target`` tokens: every stop id in ``eos_ids``
  is impossible before step target-1 and ``eos_ids[0]`` is the only choice at it (a
  benchmark's length control, the same rule as its Hugging Face logits processor)."""
  at = (step == target - 1)[:, None]
  ids = jnp.arange(logits.shape[-1])
  is_stop = jnp.isin(ids, jnp.asarray(eos_ids, jnp.int32))[None, :]
  is_first = (ids == eos_ids[0])[None, :]
  return jnp.where(at, jnp.where(is_first, logits, -jnp.inf),
                   jnp.where(is_stop, -jnp.inf, logits))


def engine_replicas(mesh: Mesh | None, params, paged: bool = False) -> int:
  """How many independent engines decode on ``mesh``: D.

  When the parameters are replicated on every device of the mesh (no tensor or FSDP split,
  as on a generator mesh with ``mesh.generator_tensor=1``) and the KV cache is contiguous,
  each of the mesh's data × fsdp devices decodes its own slots with its own copy of the
  weights (``_decode_chunk`` under ``jax.shard_map``): a decode step needs no collective.
  Otherwise the mesh runs one SPMD program (D = 1).

  Args:
    mesh: the engine's mesh, or None. params: the policy's parameters (arrays or
      ``jax.ShapeDtypeStruct`` leaves with shardings). paged: the page-pool cache (its pages
      are shared by slots on any device: one program).

  Returns:
    int: ``batch_shards(mesh)`` for per-device replicas, else 1.
  """
  d = batch_shards(mesh)
  if mesh is None or paged or d == 1 or mesh.shape["tensor"] > 1:
    return 1
  devices = set(mesh.devices.flat)
  for x in jax.tree.leaves(params):
    sh = getattr(x, "sharding", None)
    if sh is None or not sh.is_fully_replicated or set(sh.device_set) != devices:
      return 1
  return d


def _merge_replicas(tokens: np.ndarray, logprobs: np.ndarray, full: np.ndarray,
                    versions: np.ndarray, pad_id: int):
  """The replicas' output buffers ([D, N, M] host arrays) as one: each token was sampled
  by exactly one replica (its slot's device at that step), the others hold ``pad_id`` and
  zeros there. Returns (tokens, logprobs, full, versions), each [N, M]."""
  t = np.where(tokens != pad_id, tokens, -1).max(0)
  return (np.where(t < 0, pad_id, t).astype(np.int32), logprobs.sum(0), full.sum(0),
          versions.sum(0))


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "width", "steps", "temperature", "top_k", "top_p", "eos_ids", "mesh", "impl"),
    donate_argnames=("state",))
def _decode_chunk(graphdef, params, state: SlotState, key, forced, version, page_indices=None,
                  *, width, steps, temperature, top_k, top_p, eos_ids, mesh, impl="xla"):
  """Up to ``steps`` decode steps of every slot at attention width ``width`` with ``params``
  of policy version ``version`` (int32 scalar): each token records its slot's
  ``logits_version``, which each step then sets to ``version``. A paged state
  decodes over its pool with ``page_indices`` [S, W] int32 (``width`` unused) and attention
  ``impl``. A state with D > 1 output buffers (``engine_replicas``) decodes as D engines,
  one per device, each over its own slots and its local copy of ``params``, each stopping
  when its own slots are done.

  Returns (state, steps run [D] int32, kv positions needed [D] int32, kv positions of the
  pages up to each decoding slot's length [D] int32 (0 for a contiguous state), one entry
  per engine replica; (done [S] bool, length [S] int32, request [S] int32) — copies that
  outlive the state's donation to the next chunk, for the host to read while it runs)."""
  decode = functools.partial(_decode_steps, graphdef, width=width, steps=steps,
                             temperature=temperature, top_k=top_k, top_p=top_p,
                             eos_ids=eos_ids, impl=impl)
  if state.tokens.shape[0] == 1:
    state, *counts = decode(params, state, key, forced, version, page_indices, mesh=mesh)
    return state, *(x[None] for x in counts), (state.done, state.length, state.request)
  specs = jax.tree.map(lambda sh: sh.spec, _slot_sharding(mesh, state))
  per_device = fit_spec(P(BATCH_AXES), (state.tokens.shape[0],), mesh)

  def local(p, st, k, f, v):
    st, *counts = decode(p, st, k, f, v, None, mesh=None)
    return st, *(x[None] for x in counts), (st.done, st.length, st.request)

  # check_vma off: the loop's counters start replicated and end per device.
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(), P(), P()),
                       out_specs=(specs, per_device, per_device, per_device,
                                  (specs.done, specs.length, specs.request)),
                       check_vma=False)(params, state, key, forced, version)


def _decode_steps(graphdef, params, state: SlotState, key, forced, version, page_indices, *,
                  width, steps, temperature, top_k, top_p, eos_ids, mesh, impl):
  """``_decode_chunk``'s loop over one program's slots (all of them, or one replica's):
  (state, steps run, kv positions needed, kv positions of the pages read), int32 scalars."""
  model = nnx.merge(graphdef, params)
  n_req, m = state.tokens.shape[1] - 1, state.tokens.shape[2]
  eos = jnp.asarray(eos_ids, jnp.int32)

  def cond(c):
    i, st, _, _ = c
    return (i < steps) & ~jnp.all(st.done)

  def body(c):
    i, st, needed, read = c
    active = ~st.done
    logits = st.last_logits
    if forced is not None:
      logits = _force_lengths(logits, st.step, forced[jnp.minimum(st.request, n_req - 1)],
                              eos_ids)
    if key.ndim:  # a stream's round keys: request r is r mod R of round region r // R
      per_round = n_req // key.shape[0]
      region = jnp.minimum(st.request // per_round, key.shape[0] - 1)
      keys = jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
          key[region], st.request % per_round, st.step)
    else:
      keys = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(
          st.request, st.step)
    tok, lp, flp = sample_token(keys, logits, temperature, top_k, top_p)
    row = jnp.where(active, st.request, n_req + 1)  # out of range: dropped
    at = (0, row, st.step)  # the program's own output buffer
    stopped = jnp.isin(tok, eos) | (st.step + 1 >= m)
    if st.paged:
      logits, ck, cv = decode_step_paged(model, tok, st.length, st.k, st.v, page_indices,
                                         active, impl)
      page_size = st.k.shape[3]
      read = read + jnp.where(active, (st.length + page_size) // page_size * page_size,
                              0).sum(dtype=jnp.int32)
    else:
      logits, ck, cv = decode_step(model, tok, st.length, st.k, st.v, width)
    st = st.replace(
        k=ck, v=cv, last_logits=logits, done=st.done | stopped,
        tokens=st.tokens.at[at].set(tok, mode="drop"),
        logprobs=st.logprobs.at[at].set(lp, mode="drop"),
        full_logprobs=st.full_logprobs.at[at].set(flp, mode="drop"),
        versions=st.versions.at[at].set(st.logits_version, mode="drop"),
        seq=st.seq.at[jnp.arange(st.seq.shape[0]), jnp.where(active, st.length, st.seq.shape[1])
                      ].set(tok, mode="drop"),
        length=st.length + active, step=st.step + active,
        logits_version=jnp.where(active, version, st.logits_version))
    needed = needed + jnp.where(active, st.length, 0).sum(dtype=jnp.int32)
    return i + 1, _constrain(st, mesh), needed, read

  i, state, needed, read = jax.lax.while_loop(
      cond, body, (jnp.int32(0), state, jnp.int32(0), jnp.int32(0)))
  return state, i, needed, read


@functools.partial(jax.jit, static_argnames=("mesh",))
def _select_slots(state: SlotState, keep, *, mesh):
  """The state restricted to slots ``keep`` [S'] (a smaller batch bucket); a paged state
  keeps its pool (the host reorders the page tables)."""
  take = lambda x, axis: jnp.take(x, keep, axis=axis)
  kv = {} if state.paged else dict(k=take(state.k, 1), v=take(state.v, 1))
  return _constrain(state.replace(
      **kv, length=take(state.length, 0),
      last_logits=take(state.last_logits, 0), request=take(state.request, 0),
      step=take(state.step, 0), done=take(state.done, 0), seq=take(state.seq, 0),
      logits_version=take(state.logits_version, 0)), mesh)


# A weight swap's re-prefill runs a few slots at a time (``refresh_slot_block``): its
# attention scores, [slots, H, width, width] float32, stay within this many bytes per device.
REFRESH_SCORE_BYTES = 1 << 31


def refresh_slot_block(cfg, slots_per_device: int, width: int) -> int:
  """Slots per device re-prefilled together on a weight swap (``_refresh``).

  Args:
    cfg: the model's ``TransformerConfig`` (H query heads). slots_per_device: S / D, the
      slots one device holds. width: the re-prefill's width (positions).

  Returns:
    int g >= 1 dividing ``slots_per_device``: the largest power of two (or all the slots)
    whose scores g · H · width² · 4 bytes fit ``REFRESH_SCORE_BYTES``.
  """
  fit = max(1, REFRESH_SCORE_BYTES // (cfg.n_heads * width * width * 4))
  if fit >= slots_per_device:
    return slots_per_device
  g = 1
  while g * 2 <= fit and slots_per_device % (g * 2) == 0:
    g *= 2
  return g


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "mesh", "slot_block"),
                   donate_argnames=("state",))
def _refresh(graphdef, params, state: SlotState, writes=None, version=None, *, width, mesh,
             slot_block=0):
  """Every decoding slot's keys, values and next-token logits recomputed with ``params``.

  An in-flight weight swap (PipelineRL's in-flight update) re-prefills each slot's tokens
  so far (``state.seq``, the first ``width`` >= max length positions) with the new
  parameters: every token sampled afterwards comes from the new policy given the whole
  context, so its recorded behaviour log-prob is the one the learner recomputes for the
  version it records (the cache would otherwise mix the two versions' keys and values).
  A paged state writes the new keys and values into each slot's pages (``writes``, see
  ``_write_pages``: a shared prompt page once). ``version`` (int32 scalar, or None to leave
  it) becomes each decoding slot's ``logits_version``.

  The contiguous cache is refreshed in place, ``slot_block`` slots per device at a time
  (``refresh_slot_block``; 0: all at once): a ``lax.scan`` over slot blocks, each block's
  new keys and values written into the donated cache before the next, so the temporaries
  are one block's prefill — attention scores [D · g, H, width, width] float32 and one
  layer's activations — instead of every slot's, and no second cache-sized array.
  """
  model = nnx.merge(graphdef, params)
  if version is not None:  # every decoding slot's next logits now come from ``params``
    state = state.replace(logits_version=jnp.where(~state.done, version, state.logits_version))
  lengths = jnp.maximum(state.length, 1)
  live = ~state.done
  if state.paged:
    keep = lambda new, old, axis: jnp.where(
        live.reshape((-1,) + (1,) * (old.ndim - axis - 1)), new.astype(old.dtype), old)
    k, v, logits = prefill(model, state.seq[:, :width], lengths, mesh)
    state = state.replace(k=_write_pages(state.k, k, writes), v=_write_pages(state.v, v, writes),
                          last_logits=keep(logits, state.last_logits, 0))
    return _constrain(state, mesh)
  s = lengths.shape[0]
  d = batch_shards(mesh)
  per = s // d
  g = per if not slot_block else slot_block
  # Block j re-prefills slots j·g .. j·g + g − 1 of every device's per = S / D slots. The
  # cache keeps its [L, S, ...] layout (a reshape would make XLA copy it) when D = 1.
  rows = lambda x, j: jax.lax.dynamic_slice_in_dim(x.reshape((d, per) + x.shape[1:]), j * g, g,
                                                   1).reshape((d * g,) + x.shape[1:])
  by_device = lambda x: x if d == 1 else x.reshape(x.shape[:1] + (d, per) + x.shape[2:])

  def block(carry, j):
    ck, cv, last = carry
    k, v, logits = prefill(model, rows(state.seq[:, :width], j), rows(lengths, j), mesh)

    def at(c, new):  # new [L, D·g, K, width, E] into c at slots j·g of every device
      # Finished slots are rewritten too: no later step reads their cache (an insert
      # rewrites a slot before it decodes again), and keeping their old keys would read
      # the old block back for a select.
      new = new.astype(c.dtype)
      if d > 1:
        new = new.reshape(new.shape[:1] + (d, g) + new.shape[2:])
      return jax.lax.dynamic_update_slice_in_dim(c, new, j * g, 1 if d == 1 else 2)

    on = rows(live, j)
    old = rows(last, j)
    new_last = jnp.where(on[:, None], logits, old).reshape(d, g, -1)
    last = jax.lax.dynamic_update_slice_in_dim(last.reshape(d, per, -1), new_last, j * g,
                                               1).reshape(last.shape)
    return (at(ck, k), at(cv, v), last), None

  (ck, cv, last), _ = jax.lax.scan(
      block, (by_device(state.k), by_device(state.v), state.last_logits), jnp.arange(per // g))
  unsplit = lambda x: x.reshape(x.shape[:1] + (s,) + x.shape[3:]) if d > 1 else x
  state = state.replace(k=unsplit(ck), v=unsplit(cv), last_logits=last)
  return _constrain(state, mesh)


def _left_align(tokens: np.ndarray, mask: np.ndarray, pad_id: int, width: int):
  """Prompts with their real tokens moved to positions 0 .. len-1: ([N, width], [N])."""
  n = tokens.shape[0]
  lengths = mask.sum(-1).astype(np.int32)
  out = np.full((n, width), pad_id, np.int32)
  for i in range(n):
    real = tokens[i][mask[i]]
    out[i, :len(real)] = real
  return out, lengths


def _admit(pool, prompts: np.ndarray, worst: np.ndarray, full: np.ndarray,
           live_worst: np.ndarray, live: np.ndarray) -> int:
  """How many of the next requests the pool takes now (the wait policy).

  A request is admitted while the free pages cover every decoding request's remaining
  growth to its full length plus the new requests' full lengths, the complete prompt pages
  of a prompt counted once per insert (they are shared).

  Args:
    pool: the ``paged.PagePool``. prompts: [n] int the prompt of each candidate request,
      in order. worst: [N] int pages of each prompt's request at full length. full: [N]
      int complete pages of each prompt (shared by its samples).
    live_worst: [D] int full-length pages of each decoding slot. live: [S] bool, the
      decoding slots (the order of ``live_worst``).

  Returns:
    int k: the first k candidates fit.
  """
  budget = pool.num_free - int((live_worst - pool.mapped[live]).sum())
  seen = set()
  for i, p in enumerate(prompts):
    cost = int(worst[p]) - (int(full[p]) if p in seen else 0)
    if cost > budget:
      return i
    budget -= cost
    seen.add(p)
  return len(prompts)


def _fill_pages(pool, slots: np.ndarray, source: np.ndarray, prompt_len: np.ndarray, size: int):
  """Maps each inserted prompt to its slots (``paged.fill_group``) and lists the page writes
  of its prefill: its complete pages once (shared), its last partial page once per slot.

  Args:
    pool: the ``paged.PagePool``. slots: [n] int the slots filled. source: [n] int the
      prefill row (prompt) of each. prompt_len: [B] int32 lengths of the prefill rows.
    size: static length of the write list (>= the writes; padded with dropped writes).

  Returns:
    (pool, (src_row, src_page, dst) [size] int32 each, ``_write_pages``'s writes).

  Raises:
    RuntimeError: the pool cannot take a prompt (``_admit`` should have kept it waiting).
  """
  page_size, n = pool.page_size, pool.refcount.shape[0]
  writes = []
  for row in np.unique(source):
    group = [int(x) for x in slots[source == row]]
    pool, ok = paging.fill_group(pool, group, int(prompt_len[row]))
    if not ok:
      raise RuntimeError(f"page pool exhausted filling slots {group}: admission bug")
    full, tail = divmod(int(prompt_len[row]), page_size)
    writes += [(row, j, pool.page_indices[group[0], j]) for j in range(full)]
    if tail:
      writes += [(row, full, pool.page_indices[slot, full]) for slot in group]
  out = np.zeros((3, size), np.int32)
  out[2] = n  # padding: dropped
  out[:, :len(writes)] = np.asarray(writes, np.int32).reshape(-1, 3).T
  return pool, tuple(out)


def _refresh_writes(pool, length: np.ndarray, live: np.ndarray, width: int):
  """The page writes of a weight swap's re-prefill (``_refresh``): every page up to each
  decoding slot's length, a shared prompt page once.

  Args:
    pool: the ``paged.PagePool``. length: [S] int filled positions. live: [S] bool, the
      decoding slots. width: the re-prefill width (>= every live length).

  Returns:
    (src_row, src_page, dst) [S · ceil(width / page_size)] int32 each (padded with dropped
    writes).
  """
  page_size, n = pool.page_size, pool.refcount.shape[0]
  writes, seen = [], set()
  for slot in np.flatnonzero(live):
    for j in range(paging.pages_for(int(length[slot]), page_size)):
      page = int(pool.page_indices[slot, j])
      if j < pool.shared[slot]:
        if page in seen:
          continue
        seen.add(page)
      writes.append((slot, j, page))
  out = np.zeros((3, live.shape[0] * paging.pages_for(width, page_size)), np.int32)
  out[2] = n
  out[:, :len(writes)] = np.asarray(writes, np.int32).reshape(-1, 3).T
  return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
  """What one ``run`` call fixes: its prompts, shapes and sampling settings (``run``'s
  arguments, validated, and what follows from them)."""
  graphdef: nnx.GraphDef
  cfg: object  # the policy's TransformerConfig
  mesh: Mesh | None
  aligned: np.ndarray  # [N, P] int32 prompts, real tokens first
  plen: np.ndarray  # [N] int32 prompt lengths
  n_req: int  # N·G requests
  group_size: int  # G
  m: int  # max_new_tokens
  capacity: int  # C = P + M positions per slot
  slots: int  # S at the start
  steps: int  # k decode steps per chunk
  shards: int  # the mesh's data × fsdp devices (slot counts are multiples of it)
  min_slots: int  # the tail shrinks to no fewer slots
  min_width: int  # the narrowest attention width a chunk decodes at (``attention_floor``)
  prefill_prompts: int
  pad_id: int
  eos_ids: tuple[int, ...]
  temperature: float
  top_k: int
  top_p: float
  key: jax.Array
  forced: jax.Array | None  # [N·G] int32 forced lengths, placed
  paged: bool
  impl: str  # the decode attention ('xla' for the contiguous cache)
  worst: np.ndarray | None  # [N] int pages of each prompt's request at full length
  n_pages: int
  page_size: int
  table: int  # pages of one slot at full length
  pipelined: bool  # the host reads a chunk's slots while the next one runs (contiguous cache)
  on_weight_swap: str  # 'recompute' | 'keep_kv' (``ON_WEIGHT_SWAP``)

  @classmethod
  def make(cls, cfg, prompt_tokens, prompt_mask, key, *, max_new_tokens, temperature, eos_ids,
           pad_id, top_k, top_p, group_size, slots, chunk_steps, mesh, forced_lengths,
           prefill_prompts, paged, page_size, num_pages, attention, graphdef,
           pipelined=False, on_weight_swap="recompute") -> "_Call":
    """``run``'s arguments checked (its Raises) and the call's fixed quantities derived."""
    toks = np.asarray(prompt_tokens)
    mask = np.asarray(prompt_mask, bool)
    n_prompts, p = toks.shape
    if prefill_prompts < 1:
      raise ValueError(f"prefill_prompts={prefill_prompts} must be >= 1")
    if n_prompts and (mask.sum(-1) == 0).any():
      raise ValueError("every prompt row needs at least one real token (prompt_mask all False)")
    if forced_lengths is not None and not eos_ids:
      raise ValueError("forced_lengths needs a stop id (eos_ids is empty)")
    if on_weight_swap not in ON_WEIGHT_SWAP:
      raise ValueError(f"sampler.on_weight_swap={on_weight_swap!r}; valid: "
                       f"{', '.join(map(repr, ON_WEIGHT_SWAP))}")
    n_req = n_prompts * group_size
    m = max_new_tokens
    capacity = p + m
    aligned, plen = _left_align(toks, mask, pad_id, p)
    # Slots split over the batch axes: a multiple of their devices (extra slots start free).
    shards = batch_shards(mesh)
    s = -(-max(1, min(slots or n_req, n_req)) // shards) * shards
    impl, worst, n_pages, table = "xla", None, 0, 0
    if paged:
      impl = paging.resolve_impl(attention, jax.default_backend())
      if page_size < 1:
        raise ValueError(f"sampler.page_size={page_size} must be >= 1")
      table = paging.pages_for(capacity, page_size)
      # the most pages one request holds: its prompt and M tokens
      worst = -(-(plen.astype(np.int64) + m) // page_size)
      n_pages = int(num_pages) or s * table
      if num_pages < 0 or (n_prompts and n_pages < int(worst.max())):
        raise ValueError(f"sampler.num_pages={num_pages} must be 0 or >= "
                         f"{int(worst.max()) if n_prompts else 1} (one request at full length: "
                         f"prompt + max_new_tokens positions in pages of {page_size})")
    c = cls(graphdef=graphdef, cfg=cfg, mesh=mesh, aligned=aligned, plen=plen, n_req=n_req,
            group_size=group_size, m=m, capacity=capacity, slots=s,
            steps=max(1, min(chunk_steps, m)), shards=shards,
            min_slots=-(-MIN_SLOTS // shards) * shards,
            # a CPU decodes compute-bound (FLOPs); accelerators memory-bound, where each
            # slot's cache read weighs against the weights read once for all slots
            min_width=attention_floor(cfg) if jax.default_backend() == "cpu" else MIN_WIDTH,
            prefill_prompts=prefill_prompts,
            pad_id=pad_id, eos_ids=tuple(int(e) for e in eos_ids),
            temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), key=key,
            forced=None, paged=paged, impl=impl, worst=worst, n_pages=n_pages,
            page_size=page_size, table=table, pipelined=bool(pipelined) and not paged,
            on_weight_swap=on_weight_swap)
    forced = (None if forced_lengths is None
              else c.place(np.clip(np.asarray(forced_lengths, np.int32), 1, m)))
    key = key if mesh is None else multihost.to_global(key, NamedSharding(mesh, P()))
    return dataclasses.replace(c, forced=forced, key=key)

  def place(self, x):
    """``x`` replicated over the mesh (as is without one)."""
    return x if self.mesh is None else multihost.to_global(x, NamedSharding(self.mesh, P()))

  def place_rows(self, x):
    """``x`` split by rows over the batch axes: each device prefills its share."""
    return x if self.mesh is None else multihost.to_global(
        x, batch_sharding(self.mesh, x.ndim, x.shape[0]))


@dataclasses.dataclass(eq=False)
class _HostLoop:
  """``run``'s state between decode chunks, advanced by one method per step of its loop.

  The device holds the ``SlotState``; the host keeps what each of the S slots holds (free
  or not, its length, its prompt's length, its request), the page pool (paged), the policy
  and its version, and the next request to admit.

  Pipelined (``overlap_host_check``, the contiguous cache): the host's view of the slots is
  one chunk behind the device. A chunk is dispatched before the host reads the one before
  it (whose copy to the host started at its dispatch), so the device never waits for the
  host's check:
  the next requests go into the slots the chunk before freed, and the attention width
  covers the k steps the chunk in flight may add. Slots filled since the chunk being read
  was dispatched keep their new host view (``fresh``). The paged cache reads each chunk
  at once: its page accounting needs the lengths now.
  """
  c: _Call
  params: nnx.State
  version: int
  state: SlotState
  pool: object  # paged.PagePool, or None for the contiguous cache
  s: int
  done: np.ndarray  # [S] bool: free (finished or never filled)
  length: np.ndarray  # [S] int32 positions written
  prompt_len: np.ndarray  # [S] int32
  request: np.ndarray  # [S] int32 (N·G: none)
  stats: EngineStats
  next_req: int = 0  # requests admitted so far (request id: next_req mod N·G)
  admit_end: int = 0  # requests loaded so far: all N·G, or a stream's rounds (``stream``)
  streaming: bool = False  # a stream: slots never shrink (the next round refills them)
  shapes: set = dataclasses.field(default_factory=set)  # (S, width) of the decode programs
  inflight: tuple | None = None  # (slot view, width, table pages) of the chunk not yet read
  fresh: np.ndarray | None = None  # [S] bool: filled since the chunk in flight was dispatched

  @classmethod
  def start(cls, c: _Call, params, version: int) -> "_HostLoop":
    """Every slot free, the pool (paged) empty."""
    cfg, s = c.cfg, c.slots
    stats = EngineStats()
    pool = None
    if c.paged:
      pool = paging.init_pool(c.n_pages, c.page_size, c.table, s)
      stats.page_size = int(c.page_size)
    else:
      stats.kv_bytes_held = s * c.capacity * _kv_position_bytes(cfg)
    state = _new_state(cfg, s, c.capacity, c.n_req, c.m, c.pad_id, c.mesh,
                       *((pool.refcount.shape[0], c.page_size) if c.paged else (0, 0)),
                       replicas=engine_replicas(c.mesh, params, c.paged))
    return cls(c=c, params=params, version=int(version), state=state, pool=pool, s=s,
               done=np.ones((s,), bool), length=np.zeros((s,), np.int32),
               prompt_len=np.zeros((s,), np.int32), request=np.full((s,), c.n_req, np.int32),
               stats=stats, admit_end=c.n_req, fresh=np.zeros((s,), bool))

  def pending(self) -> bool:
    """Requests still to admit or to finish (the chunk in flight read first when the host's
    view says none)."""
    if self.next_req < self.admit_end or not self.done.all():
      return True
    if self.inflight is None:
      return False
    self._drain()
    return self.pending()

  def fill_free_slots(self):
    """Prefills the next requests into the free slots: at most ``prefill_prompts`` prompts
    per insert (requests are ordered by prompt), and, paged, only as many as the pool's
    free pages cover (``_admit``; the rest wait for finishing requests' pages)."""
    c = self.c
    free = np.flatnonzero(self.done)
    while self.next_req < self.admit_end and len(free):
      last = min(self.admit_end, self.next_req + len(free),
                 (self.next_req // c.group_size + c.prefill_prompts) * c.group_size)
      if c.paged:
        last = self.next_req + _admit(
            self.pool, np.arange(self.next_req, last) % c.n_req // c.group_size, c.worst,
            c.plen // c.page_size, c.worst[self.request[~self.done] // c.group_size],
            ~self.done)
        if last == self.next_req:
          break  # the pool is short: the requests wait for pages of finishing ones
      reqs = np.arange(self.next_req, last) % c.n_req
      self.next_req = last
      self._insert(reqs, free[:len(reqs)])
      free = free[len(reqs):]

  def _insert(self, reqs: np.ndarray, slots: np.ndarray):
    """One prefill: requests ``reqs`` [n] into the free slots ``slots`` [n], each of their
    prompts prefilled once (the group's samples share it)."""
    c = self.c
    prompt_ids, source = np.unique(reqs // c.group_size, return_inverse=True)
    w = min(c.aligned.shape[1], _pow2_at_least(int(c.plen[prompt_ids].max()), 16))
    n_b = _pow2_at_least(len(prompt_ids), 1)
    pr = np.full((n_b, w), c.pad_id, np.int32)
    pr[:len(prompt_ids)] = c.aligned[prompt_ids, :w]
    pl = np.ones((n_b,), np.int32)
    pl[:len(prompt_ids)] = c.plen[prompt_ids]
    fill = np.zeros((self.s,), bool)
    fill[slots] = True
    src = np.zeros((self.s,), np.int32)
    src[slots] = source
    rq = np.array(self.request, np.int32)
    rq[slots] = reqs
    writes = None
    if c.paged:
      self.pool, writes = _fill_pages(self.pool, slots, source, pl,
                                      n_b * paging.pages_for(w, c.page_size) + self.s)
      writes = tuple(map(c.place, writes))
      self.stats.peak_pages = max(self.stats.peak_pages, c.n_pages - self.pool.num_free)
    self.state = _insert(c.graphdef, self.params, self.state, c.place_rows(pr),
                         c.place_rows(pl), *map(c.place, (fill, src, rq)), writes,
                         c.place(np.int32(self.version)), mesh=c.mesh)
    self.done[slots] = False
    self.fresh[slots] = True
    self.length[slots] = pl[source]
    self.prompt_len[slots] = pl[source]
    self.request[slots] = reqs
    self.stats.inserts += 1
    self.stats.prefill_rows += len(prompt_ids)
    self.stats.prefill_tokens += len(prompt_ids) * w

  def reserve_chunk(self):
    """The chunk's attention width (``width_bucket`` of the longest slot + k) and, paged,
    the pages its k steps write, taken now: (width, table_pages | None).

    Raises:
      RuntimeError: the pool cannot grow a slot (``_admit`` should have prevented it).
    """
    c = self.c
    active = ~self.done
    width = width_bucket(int(self.length[active].max()) + c.steps + self._lag(), c.capacity,
                         c.min_width)
    if not c.paged:
      return width, None
    for slot in np.flatnonzero(active):
      self.pool, ok = paging.reserve(self.pool, slot, min(int(self.length[slot]) + c.steps,
                                                          int(self.prompt_len[slot]) + c.m))
      if not ok:  # _admit keeps every decoding request's full length in the pool
        raise RuntimeError(f"page pool exhausted growing slot {slot}: admission bug")
    self.stats.peak_pages = max(self.stats.peak_pages, c.n_pages - self.pool.num_free)
    table_pages = paging.pages_for(width, c.page_size)
    if c.impl != "xla":  # the GPU kernel splits the table into power-of-two partitions
      table_pages = min(_pow2_at_least(table_pages, 1), c.table)
    return width, table_pages

  def maybe_swap_weights(self, weights):
    """Asks ``weights`` (``run``'s argument) for a newer policy. With one, 'recompute'
    re-prefills every decoding slot with it (``_refresh``), so every later token comes
    from it; 'keep_kv' keeps the slots' caches (and the next-token logits the old
    parameters computed), so the later tokens come from the new parameters over the old
    keys and values, as PipelineRL samples. Each token records the version of the
    parameters whose logits it was drawn from (``SlotState.logits_version``)."""
    if weights is None:
      return
    swap = weights()
    if swap is None or int(swap[1]) == self.version:
      return
    c = self.c
    self.params, self.version = swap[0], int(swap[1])
    self.stats.swaps += 1
    active = ~self.done
    if c.on_weight_swap == "keep_kv" or not active.any():  # no cache to recompute
      return
    r_width = width_bucket(int(self.length[active].max()) + self._lag(), c.capacity)
    writes = None
    if c.paged:
      writes = tuple(map(c.place, _refresh_writes(self.pool, self.length, active, r_width)))
    block = refresh_slot_block(c.cfg, self.state.length.shape[0] // batch_shards(c.mesh),
                               r_width)
    self.state = _refresh(c.graphdef, self.params, self.state, writes,
                          c.place(np.int32(self.version)), width=r_width, mesh=c.mesh,
                          slot_block=block)

  def _lag(self) -> int:
    """Positions the device's slots may be ahead of the host's view: the k steps of the
    chunk in flight (0 when every chunk has been read)."""
    return self.c.steps if self.inflight is not None else 0

  def decode_chunk(self, width: int, table_pages: int | None):
    """Dispatches k decode steps (``_decode_chunk``), then reads the slots (stop, length,
    request) after the chunk before it (pipelined) or after this one (paged)."""
    c = self.c
    self.shapes.add((self.s, width))
    self.state, ran, needed, read, (done, length, request) = _decode_chunk(
        c.graphdef, self.params, self.state, c.key, c.forced, c.place(np.int32(self.version)),
        None if self.pool is None else c.place(self.pool.page_indices[:, :table_pages]),
        width=width, steps=c.steps, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
        eos_ids=c.eos_ids, mesh=c.mesh, impl=c.impl)
    view = ({"done": done, "length": length, "request": request, "ran": ran,
             "needed": needed, "read": read}, width, table_pages)
    if c.pipelined:
      for x in jax.tree.leaves(view[0]):
        if x.is_fully_addressable:
          x.copy_to_host_async()
      view, self.inflight = self.inflight, view
    else:
      self.fresh[:] = False
    if view is not None:
      self._read(*view)
    self.fresh[:] = False

  def _drain(self):
    """Reads the chunk in flight (waits for it)."""
    view, self.inflight = self.inflight, None
    if view is not None:
      self._read(*view)

  def _read(self, view: dict, width: int, table_pages: int | None):
    """One chunk's slot view into the host's (except the ``fresh`` slots) and its stats; a
    finished request's pages go back to the pool."""
    c, st = self.c, self.stats
    h = multihost.to_host(view)
    ran, s = int(np.max(h["ran"])), len(h["done"])  # the replicas' longest loop
    st.chunks += 1
    st.row_steps += s * ran
    st.kv_needed += int(np.sum(h["needed"]))
    if c.paged:
      st.kv_read += int(np.sum(h["read"]))
      st.kv_table_read += s * table_pages * c.page_size * ran
    else:
      st.kv_read += s * width * ran
    keep = self.fresh
    self.done, self.length, self.request = (np.where(keep, getattr(self, k), np.array(h[k]))
                                            for k in ("done", "length", "request"))
    if c.paged:
      for slot in np.flatnonzero(self.done & (self.pool.mapped > 0)):
        self.pool = paging.release(self.pool, slot)

  def shrink_slots(self):
    """Once every request is admitted and at most half the slots decode, keeps only the
    decoding slots in a smaller bucket (``_select_slots``; the dropped slots are finished,
    their pages already released)."""
    c = self.c
    if not self._shrinkable():
      return
    self._drain()  # the slots are reordered: no chunk may be read against the old order
    if not self._shrinkable():
      return
    n_active = int((~self.done).sum())
    new_s = -(-max(c.min_slots, _pow2_at_least(n_active, 1)) // c.shards) * c.shards
    keep = np.concatenate([np.flatnonzero(~self.done), np.flatnonzero(self.done)])[:new_s]
    self.state = _select_slots(self.state, c.place(keep.astype(np.int32)), mesh=c.mesh)
    self.done, self.length, self.request = self.done[keep], self.length[keep], self.request[keep]
    self.prompt_len, self.fresh = self.prompt_len[keep], self.fresh[keep]
    if c.paged:
      self.pool = self.pool.replace(page_indices=self.pool.page_indices[keep],
                                    mapped=self.pool.mapped[keep],
                                    shared=self.pool.shared[keep])
    self.s = new_s

  def _shrinkable(self) -> bool:
    c = self.c
    n_active = int((~self.done).sum())
    return (not self.streaming and self.next_req >= self.admit_end
            and 0 < n_active <= self.s // 2 and self.s > c.min_slots)

  def outputs(self, lo: int = 0, hi: int | None = None):
    """Requests [lo, hi)'s tokens, log-probs (truncated, full) and versions on the host and
    their stop-inclusive lengths; with the default range (all), ``run``'s return value,
    the finished ``EngineStats`` last."""
    c, st = self.c, self.stats
    every = hi is None
    hi = c.n_req if every else hi
    out = multihost.to_host({"tokens": self.state.tokens[:, lo:hi],
                             "logprobs": self.state.logprobs[:, lo:hi],
                             "full": self.state.full_logprobs[:, lo:hi],
                             "versions": self.state.versions[:, lo:hi]})
    tokens, logprobs, full, versions = _merge_replicas(
        out["tokens"], out["logprobs"], out["full"], out["versions"], c.pad_id)
    is_stop = np.isin(tokens, np.asarray(c.eos_ids, np.int32))
    length = np.where(is_stop.any(-1), is_stop.argmax(-1) + 1, c.m).astype(np.int32)
    st.useful_row_steps += int(length.sum())
    st.programs = len(self.shapes)
    if not every:
      return tokens, logprobs, full, length, versions
    if c.paged:
      st.kv_bytes_held = st.peak_pages * c.page_size * _kv_position_bytes(c.cfg)
      st.pool = self.pool
    return tokens, logprobs, full, length, versions, st


def _kv_position_bytes(cfg) -> int:
  """Bytes of one position's keys and values over every layer."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def run(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens, prompt_mask, key: jax.Array, *,
        max_new_tokens: int, temperature: float, eos_ids: Sequence[int], pad_id: int,
        top_k: int = 0, top_p: float = 1.0, group_size: int = 1, slots: int = 0,
        chunk_steps: int = 16, mesh: Mesh | None = None, forced_lengths=None,
        prefill_prompts: int = PREFILL_PROMPTS, version: int = 0, weights=None,
        paged: bool = False, page_size: int = 16, num_pages: int = 0,
        attention: str = "auto", overlap_host_check: bool = False,
        on_weight_swap: str = "recompute"):
  """Decodes G completions of each prompt with S refilled slots (the host loop).

  Args:
    graphdef, params: the policy (parameters already placed for ``mesh``).
    prompt_tokens: [N, P] int prompts (host array; padding anywhere, positions follow
      ``prompt_mask``). prompt_mask: [N, P] bool, True on real tokens (>= 1 per row).
    key: PRNG key; request r's token t uses ``fold_in(fold_in(key, r), t)``.
    max_new_tokens: M >= 1. temperature, top_k, top_p: the sampling distribution
      (``distribution.sample_token``; temperature 0 is greedy). eos_ids: stop ids (each
      stops a request; the stop token is kept). pad_id: written after a stop.
    group_size: G >= 1, completions per prompt; request r is prompt r // G.
    slots: S, rows decoded at once (0: one per request), rounded up to a multiple of the
      mesh's data × fsdp devices; the tail shrinks to powers of two.
    chunk_steps: k >= 1, decode steps between host checks (refill, shrink, width).
    mesh: optional mesh (slots split over data × fsdp).
    prefill_prompts: most prompts prefilled by one insert call (bounds its memory: the
      prompts' activations and keys/values; a first fill of many slots takes several).
    forced_lengths: optional [N·G] int lengths in [1, M] at which each request is made to
      emit ``eos_ids[0]`` (and no stop id before): a benchmark's control of completion lengths.
    version: int, the policy version of ``params`` (recorded per token).
    weights: optional ``() -> (params, version) | None``, asked before every decode chunk:
      a pair with another version is swapped in (an in-flight weight update, PipelineRL
      style; ``on_weight_swap`` says whether the decoding slots are re-prefilled with it),
      and each token records the version of the parameters whose logits it was drawn from
      (``SlotState.logits_version``). With several processes it must return the
      same answer on every process (``actor_learner`` agrees on it over the mesh); it
      may raise to abandon the call.
    paged: keep the KV cache in a page pool (module docstring: shared prompt pages, pages
      taken as positions are written, the wait policy of a short pool); the tokens and
      versions equal the contiguous cache's, log-probs agree to float rounding.
    page_size: positions per page (>= 1). num_pages: pages in the pool (0: every slot at
      full length, S · ceil(C / page_size); else >= the pages of one request at full
      length). attention: 'auto' | 'xla' | 'pallas', the paged decode attention
      (``paged.resolve_impl`` on ``jax.default_backend()``).
    overlap_host_check: the contiguous cache's host loop pipelined (``_HostLoop``): each
      chunk dispatched before the host reads the one before; a freed slot is refilled a
      chunk later (the same tokens unless ``weights`` swaps mid-call: the swap then lands
      at other steps). Ignored with ``paged``.
    on_weight_swap: 'recompute' (a swap re-prefills the decoding slots with the new
      parameters) or 'keep_kv' (their caches are kept; ``_HostLoop.maybe_swap_weights``).

  Returns:
    (tokens [N·G, M] int32, logprobs [N·G, M] float32, full_logprobs [N·G, M] float32,
     length [N·G] int32 (stop token included), versions [N·G, M] int32 (each token's
     policy version; 0 past the stop), ``EngineStats``), host NumPy arrays.

  Raises:
    ValueError: a prompt row without real tokens; ``forced_lengths`` without ``eos_ids``;
      paged with page_size < 1, num_pages < 0 or too small for one request at full
      length, an ``attention`` choice not in ``paged.CHOICES``, or ``on_weight_swap`` not
      in ``ON_WEIGHT_SWAP``.
  """
  cfg = nnx.merge(graphdef, params).cfg
  c = _Call.make(cfg, prompt_tokens, prompt_mask, key, max_new_tokens=max_new_tokens,
                 temperature=temperature, eos_ids=eos_ids, pad_id=pad_id, top_k=top_k,
                 top_p=top_p, group_size=group_size, slots=slots, chunk_steps=chunk_steps,
                 mesh=mesh, forced_lengths=forced_lengths, prefill_prompts=prefill_prompts,
                 paged=paged, page_size=page_size, num_pages=num_pages, attention=attention,
                 graphdef=graphdef, pipelined=overlap_host_check,
                 on_weight_swap=on_weight_swap)
  loop = _HostLoop.start(c, params, version)
  while loop.pending():
    # 1. the next requests into the free slots, one bounded prefill at a time (pages permitting)
    loop.fill_free_slots()
    # 2. the chunk's attention width, and the pages its k steps will write
    width, table_pages = loop.reserve_chunk()
    # 3. an in-flight weight update: the decoding slots re-prefilled with the new parameters
    loop.maybe_swap_weights(weights)
    # 4. k decode steps on the device, then each slot's stop and length back on the host
    loop.decode_chunk(width, table_pages)
    # 5. no request left to admit and at most half the slots busy: a smaller slot bucket
    loop.shrink_slots()
  return loop.outputs()


@functools.partial(jax.jit, static_argnames=("lo", "hi", "pad_id", "mesh"),
                   donate_argnames=("state",))
def _clear_requests(state: SlotState, *, lo: int, hi: int, pad_id: int, mesh) -> SlotState:
  """The output buffers' rows [lo, hi) of every replica reset (``pad_id``, zeros): a
  stream's round region emptied for its next round (``_merge_replicas`` reads a token
  only from the replica that wrote it)."""
  def reset(x, value):
    return x.at[:, lo:hi].set(jnp.asarray(value, x.dtype))
  return _constrain(state.replace(
      tokens=reset(state.tokens, pad_id), logprobs=reset(state.logprobs, 0),
      full_logprobs=reset(state.full_logprobs, 0), versions=reset(state.versions, 0)), mesh)


def _typed_key(key) -> jax.Array:
  """``key`` as a typed PRNG key (a raw uint32 key wrapped with the default implementation)."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


# A stream's round regions: the rounds held at once, the oldest finishing its stragglers.
# bench/stream_rounds.py (6 rounds, lognormal lengths): 2 left the slots half idle behind a
# straggler (decode steps 0.61 of one call per round), 4 and 8 both 0.46.
ROUNDS_IN_FLIGHT = 4


class _Stream:
  """A stream's rounds over ``ROUNDS_IN_FLIGHT`` regions of the request ids: round j takes
  region j mod K (request ids region · R .. + R − 1), its prompts, forced lengths and key
  written there when it is loaded and its outputs read, in round order, once its last
  request is done; the region is then cleared for round j + K."""

  def __init__(self, loop: _HostLoop, per_round: int, keys: list):
    self.loop, self.r, self.keys = loop, per_round, keys
    self.forced = np.full((len(keys) * per_round,), loop.c.m, np.int32)  # host copy
    self.loaded: list = []  # (round index, tag) of the rounds loaded and not delivered
    self.rounds = 0

  @classmethod
  def start(cls, cfg, graphdef, params, version: int, first: tuple, options: dict) -> "_Stream":
    """The stream's host loop (``ROUNDS_IN_FLIGHT`` regions of the first round's shape,
    ``options`` as ``_Call.make``'s) with the first round loaded."""
    toks, mask, key = np.asarray(first[0]), np.asarray(first[1], bool), _typed_key(first[2])
    forced = None if len(first) < 5 or first[4] is None else np.asarray(first[4], np.int32)
    k, per_round = ROUNDS_IN_FLIGHT, toks.shape[0] * options["group_size"]
    c = _Call.make(cfg, np.concatenate([toks] * k), np.concatenate([mask] * k), key,
                   forced_lengths=None if forced is None else np.concatenate([forced] * k),
                   graphdef=graphdef, **options | dict(slots=options["slots"] or per_round))
    loop = _HostLoop.start(c, params, version)
    loop.admit_end, loop.streaming = 0, True
    rounds = cls(loop, per_round, [key] * k)
    rounds.load(*first)
    return rounds

  def take(self, next_round, deliver) -> bool:
    """Loads rounds from ``next_round`` while ``can_load`` (blocking for one when nothing
    decodes); returns whether the stream has ended (none while idle)."""
    while self.can_load():
      idle = not self.loop.pending()  # reads the chunk in flight when none decodes
      if idle:
        self.deliver_finished(deliver)
      nxt = next_round(idle)
      if nxt is None:
        return idle
      self.load(*nxt)
    return False

  def can_load(self) -> bool:
    """Every loaded request admitted and a region free."""
    return (self.loop.next_req == self.loop.admit_end
            and len(self.loaded) < len(self.keys))

  def load(self, prompt_tokens, prompt_mask, key, tag, forced_lengths=None):
    """The next round's prompts (and forced lengths, when the stream's first round had
    them) into its region; the host admits them from now on."""
    loop, c = self.loop, self.loop.c
    if (forced_lengths is None) != (c.forced is None):
      raise ValueError("forced_lengths must be given for every round of a stream or for none")
    toks, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask, bool)
    n = self.r // c.group_size
    if toks.shape != (n, c.aligned.shape[1]) or mask.shape != toks.shape:
      raise ValueError(f"a stream's rounds need [{n}, {c.aligned.shape[1]}] prompts (the "
                       f"first round's); got {toks.shape} and mask {mask.shape}")
    if (mask.sum(-1) == 0).any():
      raise ValueError("every prompt row needs at least one real token (prompt_mask all False)")
    region = self.rounds % len(self.keys)
    rows = slice(region * n, (region + 1) * n)
    c.aligned[rows], c.plen[rows] = _left_align(toks, mask, c.pad_id, toks.shape[1])
    if c.paged:
      c.worst[rows] = -(-(c.plen[rows].astype(np.int64) + c.m) // c.page_size)
    key = _typed_key(key)
    self.keys[region] = key
    key_arr = jax.random.wrap_key_data(np.stack([np.asarray(multihost.to_host(
        jax.random.key_data(x))) for x in self.keys]), impl=jax.random.key_impl(key))
    forced = c.forced
    if forced_lengths is not None:
      self.forced[region * self.r:(region + 1) * self.r] = np.clip(
          np.asarray(forced_lengths, np.int32), 1, c.m)
      forced = c.place(self.forced.copy())
    loop.c = dataclasses.replace(c, key=c.place(key_arr), forced=forced)
    loop.admit_end += self.r
    self.loaded.append((self.rounds, tag))
    self.rounds += 1

  def deliver_finished(self, deliver):
    """Reads, hands to ``deliver`` and clears the oldest rounds whose requests are done."""
    loop = self.loop
    while self.loaded:
      j, tag = self.loaded[0]
      region = j % len(self.keys)
      lo, hi = region * self.r, (region + 1) * self.r
      admitted = loop.next_req >= (j + 1) * self.r
      busy = ((loop.request >= lo) & (loop.request < hi) & ~loop.done).any()
      if not admitted or busy:
        return
      deliver(tag, *loop.outputs(lo, hi))
      loop.state = _clear_requests(loop.state, lo=lo, hi=hi, pad_id=loop.c.pad_id,
                                   mesh=loop.c.mesh)
      self.loaded.pop(0)


def stream(graphdef: nnx.GraphDef, params: nnx.State, next_round, deliver, *,
           max_new_tokens: int, temperature: float, eos_ids: Sequence[int], pad_id: int,
           top_k: int = 0, top_p: float = 1.0, group_size: int = 1, slots: int = 0,
           chunk_steps: int = 16, mesh: Mesh | None = None,
           prefill_prompts: int = PREFILL_PROMPTS, version: int = 0, weights=None,
           paged: bool = False, page_size: int = 16, num_pages: int = 0,
           attention: str = "auto", overlap_host_check: bool = False,
           on_weight_swap: str = "recompute") -> EngineStats:
  """Decodes a stream of rounds with one set of S slots kept full across rounds.

  ``run`` decodes one round and returns when its last request is done, so the slots its
  finished requests free idle through the round's tail. Here the next round is asked for
  as soon as every request of the rounds held has been admitted, and its requests take
  the freed slots at once: the slots stay full while a round's stragglers finish. Up to
  ``ROUNDS_IN_FLIGHT`` rounds are held; each is handed to ``deliver`` when its last
  request is done, in the order the rounds came. Request r of a round draws token t with
  ``fold_in(fold_in(round key, r), t)``, as ``run`` does, so each round's tokens equal
  ``run``'s with its key (and its log-probs to float rounding), whatever the slots held
  beside it.

  Args:
    graphdef, params: the policy (parameters already placed for ``mesh``).
    next_round: ``(block: bool) -> (prompt_tokens [N, P], prompt_mask [N, P], key, tag
      [, forced_lengths [N·G]]) | None``: the next round's prompts (every round the same
      [N, P] shape), its PRNG key, any ``tag`` handed back with its outputs and, for every
      round or none, ``run``'s ``forced_lengths``; None for none now. With ``block``
      (nothing is decoding) it may wait for one; None then ends the stream. It may raise
      to abandon the stream (the rounds held are lost). With several processes it must
      answer alike on every process.
    deliver: ``(tag, tokens [R, M] int32, logprobs [R, M] float32, full_logprobs [R, M]
      float32, length [R] int32, versions [R, M] int32) -> None``, a finished round's
      outputs as ``run`` returns them (host NumPy), R = N·G.
    max_new_tokens ... on_weight_swap: as ``run`` (``slots`` 0: one per request of a
      round; a stream never shrinks its slots).

  Returns:
    ``EngineStats`` of the whole stream.

  Raises:
    ValueError: as ``run``; a round's prompts of another shape than the first's; forced
      lengths for some rounds only.
  """
  cfg = nnx.merge(graphdef, params).cfg
  first = next_round(True)
  if first is None:
    return EngineStats()
  rounds = _Stream.start(cfg, graphdef, params, version, first, options=dict(
      max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos_ids,
      pad_id=pad_id, top_k=top_k, top_p=top_p, group_size=group_size, slots=slots,
      chunk_steps=chunk_steps, mesh=mesh, prefill_prompts=prefill_prompts, paged=paged,
      page_size=page_size, num_pages=num_pages, attention=attention,
      pipelined=overlap_host_check, on_weight_swap=on_weight_swap))
  loop, ended = rounds.loop, False
  while True:
    # 0. finished rounds out, in order; the next round in once every request held is
    #    admitted (waiting for one when nothing decodes: none then ends the stream)
    rounds.deliver_finished(deliver)
    ended = ended or rounds.take(next_round, deliver)
    if not loop.pending():
      rounds.deliver_finished(deliver)
      if ended:
        break
      continue
    # 1. an in-flight weight update (before the fill: new requests start on the new weights)
    loop.maybe_swap_weights(weights)
    # 2. the next requests into the free slots (pages permitting), the next round's too
    #    when this fill admits the last requests held
    loop.fill_free_slots()
    if not ended and loop.done.any() and rounds.can_load():
      ended = rounds.take(next_round, deliver)
      loop.fill_free_slots()
    # 3. the chunk's attention width, and the pages its k steps will write
    width, table_pages = loop.reserve_chunk()
    # 4. k decode steps on the device, then each slot's stop and length back on the host
    loop.decode_chunk(width, table_pages)
  loop.stats.programs = len(loop.shapes)
  return loop.stats


def _new_state(cfg, slots: int, capacity: int, requests: int, max_new_tokens: int, pad_id: int,
               mesh: Mesh | None, num_pages: int = 0, page_size: int = 0,
               replicas: int = 1) -> SlotState:
  """``init_state`` built directly in its layout (``_slot_sharding``) when there is a mesh."""
  if mesh is None:
    return init_state(cfg, slots, capacity, requests, max_new_tokens, pad_id, num_pages,
                      page_size)
  return _state_builder(cfg, slots, capacity, requests, max_new_tokens, pad_id, mesh,
                        num_pages, page_size, replicas)()


@functools.lru_cache(maxsize=64)
def _state_builder(cfg, slots: int, capacity: int, requests: int, max_new_tokens: int,
                   pad_id: int, mesh: Mesh, num_pages: int = 0, page_size: int = 0,
                   replicas: int = 1):
  """The jitted ``init_state`` of one engine shape on ``mesh``, built once: a new jit per
  call would trace and compile it again every round."""
  build = functools.partial(init_state, cfg, slots, capacity, requests, max_new_tokens, pad_id,
                            num_pages, page_size, replicas)
  return jax.jit(build, out_shardings=_slot_sharding(mesh, jax.eval_shape(build)))


def lower_programs(graphdef: nnx.GraphDef, params, *, slots: int, prompt_width: int,
                   max_new_tokens: int, requests: int, temperature: float, top_k: int = 0,
                   top_p: float = 1.0, chunk_steps: int = 16, mesh: Mesh | None = None) -> dict:
  """The engine's largest programs, lowered and compiled for abstract inputs (memory plans).

  Args:
    graphdef, params: the policy; ``params`` may be ``jax.ShapeDtypeStruct`` leaves with
      shardings. slots: S, rounded up to a multiple of the mesh's data × fsdp devices as
      ``run`` rounds it. prompt_width: P. max_new_tokens: M. requests: R (the output
      arrays are [D, R + 1, M]). temperature, top_k, top_p, chunk_steps: as ``run``.
    mesh: optional mesh (the state takes ``_slot_sharding``; with the parameters replicated
      on it, one engine per device, ``engine_replicas``).

  Returns:
    {"insert": compiled prefill of min(S, ``PREFILL_PROMPTS``) prompts of width P into S slots,
     "decode": compiled decode chunk at the full width P + M, "refresh": a weight swap's
     re-prefill of the S slots at the full width, ``refresh_slot_block`` slots per device
     at a time} (``jax.stages.Compiled``; the paged cache is not planned here).
  """
  cfg = nnx.merge(graphdef, params).cfg
  capacity = prompt_width + max_new_tokens
  slots = -(-slots // batch_shards(mesh)) * batch_shards(mesh)  # as ``_Call.make``
  build = functools.partial(init_state, cfg, slots, capacity, requests, max_new_tokens, 0,
                            replicas=engine_replicas(mesh, params))
  state = jax.eval_shape(build)
  rep = None if mesh is None else NamedSharding(mesh, P())
  if mesh is not None:
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         state, _slot_sharding(mesh, state))
  arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
  rows = lambda shape, dtype: jax.ShapeDtypeStruct(
      shape, dtype, sharding=None if mesh is None else batch_sharding(mesh, len(shape), shape[0]))
  n = _pow2_at_least(min(slots, PREFILL_PROMPTS), 1)  # the largest prefill batch
  insert = _insert.lower(graphdef, params, state, rows((n, prompt_width), jnp.int32),
                         rows((n,), jnp.int32), arg((slots,), jnp.bool_),
                         arg((slots,), jnp.int32), arg((slots,), jnp.int32), mesh=mesh).compile()
  decode = _decode_chunk.lower(graphdef, params, state, key, None, arg((), jnp.int32),
                               width=capacity,
                               steps=max(1, min(chunk_steps, max_new_tokens)),
                               temperature=float(temperature), top_k=int(top_k),
                               top_p=float(top_p), eos_ids=(0,), mesh=mesh).compile()
  block = refresh_slot_block(cfg, slots // batch_shards(mesh), capacity)
  refresh = _refresh.lower(graphdef, params, state, width=capacity, mesh=mesh,
                           slot_block=block).compile()
  return {"insert": insert, "decode": decode, "refresh": refresh}
