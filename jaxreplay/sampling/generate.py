"""Generation with a KV cache: one jitted function, prefill then a ``while_loop`` decode.

Sampling distribution: logits / temperature, then top-k, then top-p
(``jaxreplay.models.logit_processing``; CASES.md case 7). ``temperature == 0`` is greedy.

Behaviour log-probs (what ``Generation.logprobs`` stores as mu): for each sampled
token, the log-probability under the distribution it was actually drawn from, i.e.
``log_softmax(process_logits(logits, temperature, top_k, top_p))[token]`` =
log(p_t / S) with S the mass that survives top-k/top-p (S = 1 without truncation).
The trainer gets an importance ratio of exactly 1 at identical parameters when it
recomputes log-probs through the same ``process_logits`` (with ``top_k=0, top_p=1``
that is plain ``log_softmax(logits / temperature)``, what ``rl.scoring.token_logprobs``
computes). ``Generation.full_logprobs`` holds the untruncated
``log_softmax(logits / temperature)[token]``, so full-softmax trainers can use it
instead (their ratio at identical parameters is then also 1). Greedy decoding stores
temperature-1 log-probs in both.

Stops: every id in ``eos_ids`` ends a row (CASES.md case 2); the stop token is kept in
the mask; after it the row holds ``pad_id`` and log-prob 0.

Sharding: with ``mesh``, prompts shard their batch axis over ``("data", "fsdp")``,
parameters follow the partition rules (``jaxreplay.parallel``), and the KV cache is
constrained to batch × kv-head sharding. Random bits do not depend on the layout
(``jax_threefry_partitionable``), so the same key gives the same tokens on any mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.models.logit_processing import process_logits
from jaxreplay.models.transformer import KVCache, init_cache, positions_from_mask
from jaxreplay.parallel import multihost
from jaxreplay.parallel.sharding import BATCH_AXES, PARAM_RULES, batch_sharding, fit_spec, shard_params


@flax.struct.dataclass
class Generation:
  """Sampler output for B rows and M = ``max_new_tokens``.

  Attributes:
    tokens: [B, M] int32 completion ids; ``pad_id`` after the stop token.
    logprobs: [B, M] float32 behaviour log-probs under the sampling distribution
      (after top-k/top-p); 0 where ``mask`` is False.
    mask: [B, M] bool, True up to and including the first stop token.
    truncated: [B] bool, no stop token within M.
    length: [B] int32 completion length (the stop token counts).
    full_logprobs: [B, M] float32 log-probs under the untruncated tempered softmax;
      0 where ``mask`` is False.
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  truncated: jax.Array
  length: jax.Array
  full_logprobs: jax.Array | None = None


def postprocess_stops(raw: jax.Array, eos_ids: Sequence[int], pad_id: int):
  """Masks raw sampled rows after their first stop token (any of ``eos_ids``).

  Every id in ``eos_ids`` stops a row (CASES.md case 2); the stop token itself stays
  in the completion mask and counts in the length.

  Args:
    raw: [B, M] int token rows as sampled.
    eos_ids: stop ids.
    pad_id: id written after the stop.

  Returns:
    (tokens [B, M] int32 with pads after the stop, mask [B, M] bool,
     length [B] int32, truncated [B] bool).
  """
  raw = jnp.asarray(raw, jnp.int32)
  is_stop = jnp.isin(raw, jnp.asarray(list(eos_ids), jnp.int32))
  stops_before = jnp.cumsum(is_stop, axis=-1) - is_stop  # stops strictly before t
  mask = stops_before == 0
  tokens = jnp.where(mask, raw, pad_id)
  return tokens, mask, mask.sum(-1).astype(jnp.int32), ~jnp.any(is_stop, axis=-1)


def categorical(key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row by inverse-CDF sampling with a two-level (blocked) cumsum.

  Equivalent in distribution to ``jax.random.categorical`` but it needs one uniform
  number per row instead of V Gumbel variates (about 10x cheaper on a CPU at V = 8192),
  and the draw does not depend on how the arrays are sharded. Tokens with probability
  0 (logit -inf) are never drawn.

  Args:
    key: PRNG key. logits: [B, V] float32, entries may be -inf (not all of a row).

  Returns:
    (tokens [B] int32, log_softmax(logits)[token] [B] float32).
  """
  b, v = logits.shape
  m = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - m)  # [B, V], 0 where -inf
  w = 1 << math.isqrt(max(v - 1, 0)).bit_length()  # a power of two >= sqrt(V)
  nb = -(-v // w)  # blocks of width w
  e_blk = (e if nb * w == v else jnp.pad(e, ((0, 0), (0, nb * w - v)))).reshape(b, nb, w)
  cb = jnp.cumsum(e_blk.sum(-1), axis=-1)  # [B, nb] cumulative block mass
  z = cb[:, -1]
  u = jax.random.uniform(key, (b,), jnp.float32) * z
  bi = jnp.minimum(jnp.sum(cb <= u[:, None], axis=-1), nb - 1)
  start = jnp.where(bi > 0, jnp.take_along_axis(cb, jnp.maximum(bi - 1, 0)[:, None], -1)[:, 0], 0.0)
  row = jnp.take_along_axis(e_blk, bi[:, None, None], axis=1)[:, 0]  # [B, w]
  ti = jnp.minimum(jnp.sum(jnp.cumsum(row, -1) <= (u - start)[:, None], axis=-1), w - 1)
  tok = bi * w + ti
  # Rounding at a block's end can land on a zero-probability slot: fall back to the argmax.
  ok = (tok < v) & (jnp.take_along_axis(e, jnp.minimum(tok, v - 1)[:, None], -1)[:, 0] > 0)
  tok = jnp.where(ok, tok, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
  picked = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
  return tok, picked - m[:, 0] - jnp.log(z)


def sample_token(key: jax.Array, logits: jax.Array, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per row.

  Args:
    key: PRNG key. logits: [B, V] float32.
    temperature: >= 0 (0: greedy argmax). top_k, top_p: see ``process_logits``.

  Returns:
    (tokens [B] int32, log-prob under the sampling distribution [B] float32,
     log-prob under the untruncated tempered softmax [B] float32).
  """
  take = lambda logp: jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  if temperature == 0.0:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = take(jax.nn.log_softmax(logits, axis=-1))
    return tok, lp, lp
  dist = process_logits(logits, temperature, top_k, top_p)
  tok, lp = categorical(key, dist)
  if top_k == 0 and top_p >= 1.0:
    return tok, lp, lp
  return tok, lp, take(jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1))


def _cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
  kv = NamedSharding(mesh, fit_spec(P(None, BATCH_AXES, "tensor", None, None), cache.k.shape, mesh))
  valid = NamedSharding(mesh, fit_spec(P(BATCH_AXES, None), cache.valid.shape, mesh))
  return KVCache(k=kv, v=kv, valid=valid)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                                             "eos_ids", "pad_id", "top_k", "top_p", "mesh"))
def _generate(graphdef, params, prompt_tokens, prompt_mask, key, *, max_new_tokens, temperature,
              eos_ids, pad_id, top_k, top_p, mesh):
  model = nnx.merge(graphdef, params)
  b, p = prompt_tokens.shape
  cache = init_cache(model.cfg, b, p + max_new_tokens)
  constrain = (lambda c: c) if mesh is None else (
      lambda c: jax.lax.with_sharding_constraint(c, _cache_sharding(mesh, c)))
  cache = constrain(cache)
  positions = positions_from_mask(prompt_mask)
  logits, cache = model.step(prompt_tokens, positions, prompt_mask, cache, jnp.int32(0),
                             last_only=True)
  next_pos = prompt_mask.sum(-1).astype(jnp.int32)  # [B]
  eos = jnp.asarray(eos_ids, jnp.int32)

  def cond(carry):
    i, _, done, *_ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, last_logits, done, cache, toks, lps, flps, key = carry
    key, k = jax.random.split(key)
    tok, lp, flp = sample_token(k, last_logits, temperature, top_k, top_p)
    tok = jnp.where(done, pad_id, tok)
    toks = toks.at[:, i].set(tok)
    lps = lps.at[:, i].set(jnp.where(done, 0.0, lp))
    flps = flps.at[:, i].set(jnp.where(done, 0.0, flp))
    new_done = done | jnp.isin(tok, eos)
    logits, cache = model.step(tok[:, None], (next_pos + i)[:, None], (~done)[:, None],
                               cache, p + i)
    return i + 1, logits[:, 0], new_done, constrain(cache), toks, lps, flps, key

  zeros = jnp.zeros((b, max_new_tokens), jnp.float32)
  init = (jnp.int32(0), logits[:, -1], jnp.zeros((b,), bool), cache,
          jnp.full((b, max_new_tokens), pad_id, jnp.int32), zeros, zeros, key)
  _, _, _, _, toks, lps, flps, _ = jax.lax.while_loop(cond, body, init)
  tokens, mask, length, truncated = postprocess_stops(toks, eos_ids, pad_id)
  return Generation(tokens=tokens, logprobs=jnp.where(mask, lps, 0.0), mask=mask,
                    truncated=truncated, length=length,
                    full_logprobs=jnp.where(mask, flps, 0.0))


def _host_or_array(x, dtype):
  """``x`` in ``dtype``: a NumPy array stays on the host (placed per process by the caller),
  a ``jax.Array`` stays where it is."""
  return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, key: jax.Array, *, max_new_tokens: int,
             temperature: float, eos_ids: Sequence[int], pad_id: int, top_k: int = 0,
             top_p: float = 1.0, mesh: Mesh | None = None,
             rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Generation:
  """Samples completions for a left-padded prompt batch (one jitted program).

  Prefill of the whole prompt batch, then a ``while_loop`` decode against the KV cache
  that stops early once every row has emitted a stop token or M tokens.

  Args:
    graphdef, params: the policy, as split by ``nnx.split(model, nnx.Param)``.
    prompt_tokens: [B, P] int32, left-padded.
    prompt_mask: [B, P] bool, True on real prompt tokens.
    key: PRNG key.
    max_new_tokens: M (static).
    temperature: sampling temperature (static, >= 0; 0 is greedy).
    eos_ids: stop ids (static; every one stops a row).
    pad_id: padding id written after a stop (static).
    top_k: keep the k most likely tokens (static; 0 disables).
    top_p: nucleus mass (static; 1 disables).
    mesh: optional ``("data", "fsdp", "tensor")`` mesh: the batch is split over data ×
      fsdp and parameters are placed by ``rules`` (a no-op if already placed so).
    rules: partition rules used with ``mesh``.

  Returns:
    ``Generation`` with [B, M] arrays (see its docstring and the module docstring for
    what ``logprobs`` holds under truncation).

  Raises:
    ValueError: negative temperature or M < 1, or invalid top_k/top_p.
  """
  if temperature < 0:
    raise ValueError(f"sampler.temperature={temperature} must be >= 0")
  if max_new_tokens < 1:
    raise ValueError(f"sampler.max_new_tokens={max_new_tokens} must be >= 1")
  if top_k < 0 or not 0.0 <= top_p <= 1.0:
    raise ValueError(f"sampler.top_k={top_k} must be >= 0 and sampler.top_p={top_p} in [0, 1]")
  if mesh is not None:
    params = shard_params(params, mesh, rules)
    sh = batch_sharding(mesh, 2, prompt_tokens.shape[0])
    # Each process places only its own devices' rows (the same prompts on every process).
    prompt_tokens = multihost.to_global(_host_or_array(prompt_tokens, jnp.int32), sh)
    prompt_mask = multihost.to_global(_host_or_array(prompt_mask, bool), sh)
    key = multihost.to_global(key, NamedSharding(mesh, P()))
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_mask = jnp.asarray(prompt_mask, bool)
  return _generate(graphdef, params, prompt_tokens, prompt_mask, key,
                   max_new_tokens=max_new_tokens, temperature=float(temperature),
                   eos_ids=tuple(int(e) for e in eos_ids), pad_id=int(pad_id), top_k=int(top_k),
                   top_p=float(top_p), mesh=mesh)
