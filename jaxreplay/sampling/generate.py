"""Generation with a KV cache: one jitted function, prefill then a ``while_loop`` decode.

Behaviour log-probs: for each sampled token the sampler stores
``log softmax(logits / temperature)[token]`` — the log-probability under the
distribution it actually sampled from. The trainer recomputes log-probs with the same
temperature, so at identical parameters the importance ratio is exactly 1.
``temperature == 0`` means greedy decoding (log-probs then use temperature 1).
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxreplay.models.transformer import init_cache, positions_from_mask


@flax.struct.dataclass
class Generation:
  """Sampler output for B rows and M = ``max_new_tokens``.

  Attributes:
    tokens: [B, M] int32 completion ids; ``pad_id`` after the stop token.
    logprobs: [B, M] float32 behaviour log-probs; 0 where ``mask`` is False.
    mask: [B, M] bool, True up to and including the first stop token.
    truncated: [B] bool, no stop token within M.
    length: [B] int32 completion length (the stop token counts).
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  truncated: jax.Array
  length: jax.Array


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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                                             "eos_ids", "pad_id"))
def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, key: jax.Array, *, max_new_tokens: int,
             temperature: float, eos_ids: tuple[int, ...], pad_id: int) -> Generation:
  """Samples completions for a left-padded prompt batch.

  The decode loop stops early once every row has emitted a stop token.

  Args:
    graphdef, params: the policy, as split by ``nnx.split(model)``.
    prompt_tokens: [B, P] int32, left-padded.
    prompt_mask: [B, P] bool, True on real prompt tokens.
    key: PRNG key.
    max_new_tokens: M (static).
    temperature: sampling temperature (static, >= 0; 0 is greedy).
    eos_ids: stop ids (static tuple).
    pad_id: padding id (static).

  Returns:
    ``Generation`` with [B, M] arrays.
  """
  model = nnx.merge(graphdef, params)
  b, p = prompt_tokens.shape
  cache = init_cache(model.cfg, b, p + max_new_tokens)
  positions = positions_from_mask(prompt_mask)
  logits, cache = model.step(prompt_tokens, positions, prompt_mask, cache, jnp.int32(0))
  next_pos = prompt_mask.sum(-1).astype(jnp.int32)  # [B]
  eos = jnp.asarray(eos_ids, jnp.int32)

  def sample(logits_bv, k):
    if temperature == 0.0:
      tok = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
      logp = jax.nn.log_softmax(logits_bv, axis=-1)
    else:
      scaled = logits_bv / temperature
      tok = jax.random.categorical(k, scaled, axis=-1).astype(jnp.int32)
      logp = jax.nn.log_softmax(scaled, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

  def cond(carry):
    i, _, done, *_ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, last_logits, done, cache, toks, lps, key = carry
    key, k = jax.random.split(key)
    tok, lp = sample(last_logits, k)
    tok = jnp.where(done, pad_id, tok)
    lp = jnp.where(done, 0.0, lp)
    toks = toks.at[:, i].set(tok)
    lps = lps.at[:, i].set(lp)
    new_done = done | jnp.isin(tok, eos)
    logits, cache = model.step(tok[:, None], (next_pos + i)[:, None], (~done)[:, None],
                               cache, p + i)
    return i + 1, logits[:, 0], new_done, cache, toks, lps, key

  init = (jnp.int32(0), logits[:, -1], jnp.zeros((b,), bool), cache,
          jnp.full((b, max_new_tokens), pad_id, jnp.int32),
          jnp.zeros((b, max_new_tokens), jnp.float32), key)
  _, _, _, _, toks, lps, _ = jax.lax.while_loop(cond, body, init)
  tokens, mask, length, truncated = postprocess_stops(toks, eos_ids, pad_id)
  return Generation(tokens=tokens, logprobs=jnp.where(mask, lps, 0.0), mask=mask,
                    truncated=truncated, length=length)
