"""Generation: G completions per prompt from the decode engine, with behaviour log-probs.

``generate`` validates the sampling settings and runs ``jaxreplay.sampling.engine`` (S
decode slots refilled from the request queue, one prefill per prompt shared by its G
samples, attention over the filled part of the cache).

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

Sharding: with ``mesh``, decode slots split over ``("data", "fsdp")``, parameters follow
the partition rules (``jaxreplay.parallel``), and the KV cache's heads split over
``"tensor"``. Random bits are keyed by request and step, so the same key gives the same
tokens on any mesh and with any slot count.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxreplay.parallel import multihost
from jaxreplay.parallel.sharding import PARAM_RULES, batch_sharding, shard_params
from jaxreplay.sampling import engine
from jaxreplay.sampling.distribution import categorical, sample_token  # noqa: F401  (re-exported)


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
    versions: [B, M] int32 policy version that sampled each token (``engine.run``'s
      ``weights`` may change it between decode chunks); 0 where ``mask`` is False.
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  truncated: jax.Array
  length: jax.Array
  full_logprobs: jax.Array | None = None
  versions: jax.Array | None = None


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


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens, prompt_mask, key: jax.Array,
             *, max_new_tokens: int, temperature: float, eos_ids: Sequence[int], pad_id: int,
             top_k: int = 0, top_p: float = 1.0, mesh: Mesh | None = None,
             rules: Sequence[tuple[str, P]] = PARAM_RULES, group_size: int = 1, slots: int = 0,
             chunk_steps: int = 16, forced_lengths=None, return_stats: bool = False,
             version: int = 0, weights=None, paged: bool = False, page_size: int = 16,
             num_pages: int = 0, attention: str = "auto", overlap_host_check: bool = False,
             on_weight_swap: str = "recompute"):
  """Samples G completions for each prompt of a batch with the decode engine.

  Each prompt is prefilled once and its KV cache shared by its G samples; ``slots`` rows
  decode at once, a finished row's slot taking the next request, and decode attention
  reads only the filled part of the cache (``jaxreplay.sampling.engine``). Request r
  (completion r % G of prompt r // G) draws its token t with
  ``fold_in(fold_in(key, r), t)``: the tokens do not depend on ``slots`` or on the order
  in which slots are refilled.

  Args:
    graphdef, params: the policy, as split by ``nnx.split(model, nnx.Param)``.
    prompt_tokens: [N, P] int32 prompts (left-padded, or padded anywhere: positions follow
      the mask), a host array or a ``jax.Array``.
    prompt_mask: [N, P] bool, True on real prompt tokens (at least one per row).
    key: PRNG key.
    max_new_tokens: M >= 1.
    temperature: sampling temperature (>= 0; 0 is greedy).
    eos_ids: stop ids (every one stops a row; the stop token is kept).
    pad_id: padding id written after a stop.
    top_k: keep the k most likely tokens (0 disables).
    top_p: nucleus mass (1 disables).
    mesh: optional ``("data", "fsdp", "tensor")`` mesh: slots split over data × fsdp and
      parameters are placed by ``rules`` (a no-op if already placed so).
    rules: partition rules used with ``mesh``.
    group_size: G >= 1 completions per prompt (rows r·G .. r·G + G - 1 of the output).
    slots: decode slots S (0: one per request, all decoded at once).
    chunk_steps: decode steps between host checks (refill, shrink, width); capped at M.
    forced_lengths: optional [N·G] int lengths at which each completion is made to stop
      (a benchmark's length control; see ``engine.run``).
    return_stats: also return the engine's ``EngineStats``.
    version: policy version of ``params``. weights: optional in-flight weight source
      (``engine.run``): ``() -> (params, version) | None`` before every decode chunk.
    paged, page_size, num_pages, attention: the paged KV cache (``engine.run``; the
      ``sampler`` options of the same names). overlap_host_check, on_weight_swap:
      ``engine.run``'s, the ``sampler`` options.

  Returns:
    ``Generation`` with [N·G, M] arrays (see its docstring and the module docstring for
    what ``logprobs`` holds under truncation); with ``return_stats``, a pair
    (``Generation``, ``engine.EngineStats``).

  Raises:
    ValueError: negative temperature, M < 1, invalid top_k/top_p, G < 1, negative
      slots, chunk_steps < 1, a prompt row without real tokens, or (paged) a bad
      page_size, num_pages or attention, an unknown on_weight_swap (``engine.run``).
  """
  if temperature < 0:
    raise ValueError(f"sampler.temperature={temperature} must be >= 0")
  if max_new_tokens < 1:
    raise ValueError(f"sampler.max_new_tokens={max_new_tokens} must be >= 1")
  if top_k < 0 or not 0.0 <= top_p <= 1.0:
    raise ValueError(f"sampler.top_k={top_k} must be >= 0 and sampler.top_p={top_p} in [0, 1]")
  if group_size < 1:
    raise ValueError(f"rollout.group_size={group_size} must be >= 1")
  if slots < 0:
    raise ValueError(f"sampler.slots={slots} must be >= 0 (0: one slot per request)")
  if chunk_steps < 1:
    raise ValueError(f"sampler.chunk_steps={chunk_steps} must be >= 1")
  if mesh is not None:
    params = shard_params(params, mesh, rules)
  tokens, logprobs, full, _, versions, stats = engine.run(
      graphdef, params, multihost.to_host(prompt_tokens), multihost.to_host(prompt_mask), key,
      max_new_tokens=max_new_tokens, temperature=float(temperature),
      eos_ids=tuple(int(e) for e in eos_ids), pad_id=int(pad_id), top_k=int(top_k),
      top_p=float(top_p), group_size=int(group_size), slots=int(slots),
      chunk_steps=int(chunk_steps), mesh=mesh, forced_lengths=forced_lengths,
      version=int(version), weights=weights, paged=bool(paged), page_size=int(page_size),
      num_pages=int(num_pages), attention=str(attention),
      overlap_host_check=bool(overlap_host_check), on_weight_swap=str(on_weight_swap))
  gen = as_generation(tokens, logprobs, full, versions, eos_ids=eos_ids, pad_id=pad_id,
                      mesh=mesh)
  return (gen, stats) if return_stats else gen


def as_generation(tokens, logprobs, full, versions, *, eos_ids: Sequence[int], pad_id: int,
                  mesh: Mesh | None = None) -> Generation:
  """The engine's raw outputs (``engine.run``, or a round of ``engine.stream``) as a
  ``Generation``: masked after each row's first stop (``postprocess_stops``), log-probs
  and versions 0 past it.

  Args:
    tokens: [B, M] int32. logprobs, full: [B, M] float32 (truncated and untruncated
      distribution). versions: [B, M] int32. eos_ids, pad_id: as ``generate``.
    mesh: optional mesh: the rows are split over its batch axes.

  Returns:
    ``Generation`` with [B, M] arrays.
  """
  tokens, mask, length, truncated = postprocess_stops(tokens, eos_ids, pad_id)
  gen = Generation(tokens=tokens, logprobs=jnp.where(mask, logprobs, 0.0), mask=mask,
                   truncated=truncated, length=length,
                   full_logprobs=jnp.where(mask, full, 0.0),
                   versions=jnp.where(mask, versions, 0))
  if mesh is not None:  # rows split over the batch axes, as the rollouts built from them
    gen = jax.tree.map(lambda x: multihost.to_global(
        np.asarray(x), batch_sharding(mesh, x.ndim, x.shape[0])), gen)
  return gen
