"""Per-token log-probs, entropy and critic values of stored rollouts under a policy.

The distribution is the sampler's (``models.logit_processing.process_logits``): logits
divided by the temperature, then top-k, then top-p renormalised. For the parameters that
generated a rollout these log-probs equal the behaviour log-probs ``sampling.generate``
recorded, so the importance ratio is exactly 1.

With ``chunk > 0`` (``algo.logprob_chunk``) the output head, the log-softmax and the
entropy run over ``chunk`` sequence positions at a time (``lax.map`` of a
``jax.checkpoint``-ed function), so the [B, T, V] float32 logits never exist at once:
the forward pass holds [B, chunk, V] and the backward pass recomputes each chunk's logits
from the [B, T, D] hidden states. The values are those of the unchunked path (each
position's logits are the same dot products), the memory ~ B·chunk·V instead of B·T·V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models.logit_processing import process_logits
from jaxreplay.rl import packing, value
from jaxreplay.rl.spec import AlgoSpec

# Log-prob given to a token outside the current policy's top-k/top-p set, whose log-prob
# under the truncated distribution is -inf: finite, so its ratio is exactly 0 (it cannot be
# sampled any more) and the metrics stay finite. Never reached without truncation.
LOGP_FLOOR = -1e4


def token_logprobs(graphdef: nnx.GraphDef, params, tokens: jax.Array, attention_mask: jax.Array,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs of ``tokens`` under the policy's sampling distribution, and its entropy.

  The distribution is the sampler's (``models.logit_processing.process_logits``): logits
  divided by ``temperature``, then top-k, then top-p renormalised — so for the same
  parameters these equal the behaviour log-probs ``sampling.generate`` records and the
  importance ratio is exactly 1. Without truncation this is ``log_softmax(logits / T)``.

  Args:
    graphdef, params: the policy (``nnx.split``).
    tokens: [B, T] int32. attention_mask: [B, T] bool.
    temperature: logits are divided by it (> 0), matching the sampler.
    top_k, top_p: the sampler's truncation (static; 0 and 1 disable it).
    chunk: ≥ 0, positions per chunk of the vocabulary computations (module docstring);
      0 = all T at once.

  Returns:
    (logp [B, T] float32 with column 0 set to 0 — column t is log π(tokens_t | tokens_<t),
     floored at ``LOGP_FLOOR`` for a token outside the truncated set;
     entropy [B, T] float32 of the (truncated) distribution that predicted column t,
     0 at column 0).

  Raises:
    ValueError: temperature <= 0, top_k < 0 or top_p outside [0, 1].
  """
  model = nnx.merge(graphdef, params)
  if chunk:
    return chunked_scores(_projector(model), model.hidden(tokens, attention_mask), tokens,
                          chunk, temperature, top_k, top_p)
  return _scores(model(tokens, attention_mask), tokens, temperature, top_k, top_p)


def micro_batches(tree, n: int):
  """Splits every leading axis R of ``tree`` into ``n`` strided micro-batches: [n, R/n, ...].

  Micro-batch k holds rows k, k + n, k + 2n, ...: a batch sharded contiguously over
  devices keeps every micro-batch spread over all of them. ``merge_micro_batches`` inverts.

  Args:
    tree: pytree of arrays with a common leading axis R (None leaves pass through).
    n: ≥ 1, dividing R.

  Returns:
    The pytree with leaves [n, R/n, ...].

  Raises:
    ValueError: ``n`` does not divide R.
  """
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"{x.shape[0]} rows do not split into {n} micro-batches")
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, tree)


def merge_micro_batches(tree):
  """Inverse of ``micro_batches``: leaves [n, R/n, ...] -> [R, ...] in the original row order."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def micro_batch_rows(batch_size: int, algo) -> int:
  """Rows per micro-batch of the learner's gradient-free passes, 0 for the whole batch.

  The learner splits each minibatch of ``batch_size / num_minibatches`` rows into
  ``grad_accum_steps`` micro-batches when it accumulates gradients, because then a whole
  batch's activations are assumed not to fit; every other pass that scores rollouts under
  the policy (behaviour log-probs in the learner's numerics, the KL reward penalty, the
  drift monitor, the held-out entropy) takes the same rows at a time.

  Args:
    batch_size: B, the learner's batch (``train.batch_size``).
    algo: ``AlgoSpec``, or an ``algo`` mapping (ConfigDict, dict).

  Returns:
    B / (num_minibatches · grad_accum_steps) if grad_accum_steps > 1, else 0.
  """
  spec = AlgoSpec.from_config(algo)
  if spec.grad_accum_steps == 1:
    return 0
  return batch_size // (spec.num_minibatches * spec.grad_accum_steps)


def plan_rows(attention_mask: np.ndarray, rows: int = 0, multiple: int = 1) -> packing.PackPlan:
  """The packing plan ``token_logprobs_by_rows`` takes for a batch scored ``rows`` at a time.

  Host numpy. B is padded up to a multiple of ``rows`` with copies of row 0, as
  ``token_logprobs_by_rows`` pads, and each pass's rows (``micro_batches``) are packed.

  Args:
    attention_mask: [B, T] bool. rows: ≥ 0 rows per pass; 0 or ≥ B: one pass.
    multiple: each pass's packed rows are a multiple of it (the devices they split over).

  Returns:
    ``packing.PackPlan`` with leaves [1, n, ...] (n = passes; ``packing.plan_groups``).
  """
  mask = np.asarray(attention_mask, bool)
  b = mask.shape[0]
  if not rows or rows >= b:
    return packing.plan_groups(mask, multiple=multiple)
  pad = -b % rows
  mask = np.concatenate([mask, np.repeat(mask[:1], pad, 0)], 0)
  return packing.plan_groups(mask, 1, mask.shape[0] // rows, multiple=multiple)


def token_logprobs_by_rows(graphdef: nnx.GraphDef, params, tokens: jax.Array,
                           attention_mask: jax.Array, temperature: float = 1.0, top_k: int = 0,
                           top_p: float = 1.0, chunk: int = 0, rows: int = 0,
                           plan: packing.PackPlan | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """``token_logprobs`` of a batch, ``rows`` rows at a time (``lax.map``): bounded memory.

  For scoring without gradients (behaviour log-probs, reference, drift, entropy): with
  ``rows`` and ``chunk`` set, at most [rows, chunk, V] float32 logits and one micro-batch's
  activations are live, whatever B. Rows are split as ``micro_batches`` splits them (after
  padding B up to a multiple of ``rows`` with copies of row 0, dropped from the output);
  each row's values are those ``token_logprobs`` gives it in a batch of ``rows`` rows.

  Args:
    graphdef, params, tokens [B, T] int32, attention_mask [B, T] bool, temperature, top_k,
      top_p, chunk: as ``token_logprobs``.
    rows: ≥ 0 rows per pass (static); 0 or ≥ B scores all B rows at once.
    plan: None (each pass at full width) or ``plan_rows(attention_mask, rows)``: each pass
      runs on its rows' real tokens packed (``packed_scores``); columns without a
      prediction (padding, each sequence's first token) are then 0.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32), as ``token_logprobs``.

  Raises:
    ValueError: as ``token_logprobs``.
  """
  b = tokens.shape[0]
  if plan is not None:
    n = plan.src.shape[1]
    pad = n * plan.dst.shape[2] - b
    tokens = jnp.concatenate([tokens, jnp.repeat(tokens[:1], pad, 0)], 0)
    flat_plan = jax.tree.map(lambda x: x[0], plan)
    out = jax.lax.map(lambda a: packed_scores(graphdef, params, a[0], a[1], temperature,
                                              top_k, top_p, chunk)[:2],
                      (micro_batches(tokens, n), flat_plan))
    return jax.tree.map(lambda x: x[:b], merge_micro_batches(out))
  if not rows or rows >= b:
    return token_logprobs(graphdef, params, tokens, attention_mask, temperature, top_k, top_p,
                          chunk)
  pad = -b % rows
  if pad:
    tokens, attention_mask = (jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)], 0)
                              for x in (tokens, attention_mask))
  parts = micro_batches((tokens, attention_mask), tokens.shape[0] // rows)
  out = jax.lax.map(lambda tm: token_logprobs(graphdef, params, tm[0], tm[1], temperature,
                                              top_k, top_p, chunk), parts)
  return jax.tree.map(lambda x: x[:b], merge_micro_batches(out))


def _projector(model):
  """The model's output head for many chunks: ``logits_projector()`` where the policy has
  it (the weight laid out once), else ``project_logits``."""
  make = getattr(model, "logits_projector", None)
  return make() if callable(make) else model.project_logits


def chunked_scores(project, hidden_btd: jax.Array, tokens: jax.Array, chunk: int,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
  """Per-token log-probs and entropy from hidden states, ``chunk`` positions at a time.

  Column t + 1 is scored from the logits ``project(hidden[:, t])``; the T − 1 scored
  positions are padded to a multiple of ``chunk`` (the padding is computed and dropped).
  Each chunk's function is rematerialised (``jax.checkpoint``), so neither pass keeps
  more than one chunk's [B, chunk, V] float32 logits.

  Args:
    project: the output head, [B, c, D] -> [B, c, V] float32 logits
      (``Transformer.project_logits``).
    hidden_btd: [B, T, D] final-normed hidden states (``Transformer.hidden``).
    tokens: [B, T] int32. chunk: > 0 positions per chunk.
    temperature, top_k, top_p: as ``token_logprobs``.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32), as ``token_logprobs``.

  Raises:
    ValueError: chunk ≤ 0; temperature, top_k or top_p invalid.
  """
  if chunk <= 0:
    raise ValueError(f"chunk={chunk} must be > 0")
  logp, ent = scores_at(project, hidden_btd[:, :-1], tokens[:, 1:], chunk, temperature,
                        top_k, top_p)
  col0 = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  return jnp.concatenate([col0, logp], 1), jnp.concatenate([col0, ent], 1)


def scores_at(project, hidden_bnd: jax.Array, next_bn: jax.Array, chunk: int = 0,
              temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
              ) -> tuple[jax.Array, jax.Array]:
  """Log-prob and entropy of token ``next_bn[b, j]`` under the distribution that hidden
  state ``hidden_bnd[b, j]`` predicts, ``chunk`` entries at a time (0: all at once).

  With ``chunk > 0`` the N entries are padded to a multiple of it (the padding is
  computed and dropped) and each chunk's head and log-softmax are rematerialised
  (``jax.checkpoint``): neither pass holds more than [B, chunk, V] float32 logits.

  Args:
    project: the output head, [B, c, D] -> [B, c, V] float32 logits.
    hidden_bnd: [B, N, D] final-normed hidden states. next_bn: [B, N] int32 tokens.
    chunk: ≥ 0. temperature, top_k, top_p: as ``token_logprobs``.

  Returns:
    (logp [B, N] float32, floored at ``LOGP_FLOOR``; entropy [B, N] float32).
  """
  if not chunk:
    return _token_scores(project(hidden_bnd), next_bn, temperature, top_k, top_p)
  b, m = next_bn.shape
  n = -(-m // chunk)
  pad = n * chunk - m
  h = jnp.pad(hidden_bnd, ((0, 0), (0, pad), (0, 0)))
  nxt = jnp.pad(next_bn, ((0, 0), (0, pad)))
  h = h.reshape(b, n, chunk, h.shape[-1]).swapaxes(0, 1)  # [n, B, c, D]
  nxt = nxt.reshape(b, n, chunk).swapaxes(0, 1)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one(args):
    h_c, tok_c = args
    return _token_scores(project(h_c), tok_c, temperature, top_k, top_p)

  logp, ent = jax.lax.map(one, (h, nxt))  # [n, B, c] each
  return (logp.swapaxes(0, 1).reshape(b, -1)[:, :m], ent.swapaxes(0, 1).reshape(b, -1)[:, :m])


def _token_scores(logits_bcv, next_bc, temperature, top_k, top_p):
  """(logp [B, c], entropy [B, c]) of tokens ``next_bc`` under the processed logits."""
  logits = process_logits(logits_bcv, temperature, top_k, top_p)
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, next_bc[..., None], axis=-1)[..., 0]
  logp = jnp.maximum(logp, LOGP_FLOOR)
  probs = jnp.exp(logp_all)
  ent = -jnp.sum(probs * jnp.where(probs > 0, logp_all, 0.0), axis=-1)  # 0·(-inf) -> 0
  return logp, ent


def _scores(logits_btv, tokens, temperature, top_k=0, top_p=1.0):
  # predicts tokens[:, 1:]; dropped tokens at -inf when truncated
  logits = process_logits(logits_btv[:, :-1], temperature, top_k, top_p)
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  logp = jnp.maximum(logp, LOGP_FLOOR)
  probs = jnp.exp(logp_all)
  ent = -jnp.sum(probs * jnp.where(probs > 0, logp_all, 0.0), axis=-1)  # 0·(-inf) -> 0
  pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1)


def policy_and_values(graphdef: nnx.GraphDef, params, value_params, tokens: jax.Array,
                      attention_mask: jax.Array, temperature: float, top_k: int = 0,
                      top_p: float = 1.0, chunk: int = 0
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``token_logprobs`` and the critic's values from one forward pass of the policy trunk.

  Args:
    graphdef, params: the policy (``nnx.split``). value_params: the ``value.ValueHead``
      state (``value.init_value_params``).
    tokens: [B, T] int32. attention_mask: [B, T] bool.
    temperature, top_k, top_p, chunk: as ``token_logprobs``.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32 — both as ``token_logprobs`` —,
     values [B, T] float32 aligned with logp: column t holds V(tokens_<t), column 0 is 0).

  Raises:
    ValueError: as ``token_logprobs``.
    RuntimeError: the model did not call ``final_norm`` once (``value.forward_with_hidden``).
  """
  model = nnx.merge(graphdef, params)
  head = nnx.merge(value.value_graphdef(), value_params)
  if chunk:
    hidden = model.hidden(tokens, attention_mask)
    logp, ent = chunked_scores(_projector(model), hidden, tokens, chunk, temperature,
                               top_k, top_p)
    return logp, ent, value.token_values(head, hidden)
  logits, hidden = value.forward_with_hidden(model, tokens, attention_mask)
  logp, ent = _scores(logits, tokens, temperature, top_k, top_p)
  return logp, ent, value.token_values(head, hidden)


def packed_scores(graphdef: nnx.GraphDef, params, tokens: jax.Array, plan: packing.PackPlan,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  chunk: int = 0, value_params=None
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """``token_logprobs`` (and ``policy_and_values``) computed on packed rows.

  The trunk, the output head and the log-softmax run on the plan's [R, W] packed tokens
  (``packing``: several sequences per row, attention within a sequence, positions
  restarting at 0), then every per-token output is gathered back to the [Bg, T] layout
  (``packing.unpack``; gradients flow through the gather). A sequence's values equal the
  unpacked ones up to float rounding; columns without a prediction (padding and each
  sequence's first token) are 0, where the unpacked path has values predicted from
  padding that no loss reads. A plan with ``score_slot`` (``packing.add_score_slots``)
  runs the head and the log-softmax on those slots alone: log-prob and entropy are 0 on
  every other token (the prompt's), which no loss term reads. A plan with ``prefix_ids``
  packs a group's prompt once (``packing.place_units``; no value head).

  Args:
    graphdef, params: the policy (``nnx.split``).
    tokens: [Bg, T] int32, the group's rows. plan: its ``packing.PackPlan`` (no leading
      group axes), built from the same rows' attention mask.
    temperature, top_k, top_p, chunk: as ``token_logprobs``.
    value_params: the ``value.ValueHead`` state, or None.

  Returns:
    (logp [Bg, T] float32, entropy [Bg, T] float32, values [Bg, T] float32 — column t holds
     V(tokens_<t), as ``policy_and_values`` — or None without ``value_params``).

  Raises:
    ValueError: as ``token_logprobs``.
  """
  model = nnx.merge(graphdef, params)
  tok_rw = packing.pack(tokens, plan)
  shared = {} if plan.prefix_ids is None else {"prefix_ids": plan.prefix_ids}
  hidden = model.hidden(tok_rw, plan.mask, plan.segment_ids, plan.positions, **shared)
  if plan.score_slot is not None:  # the slots the loss reads: the completion tokens
    g = plan.score_slot.shape[0]  # blocks of R / G rows, one per batch device
    h = jnp.take_along_axis(hidden.reshape(g, -1, hidden.shape[-1]),
                            plan.score_pred[..., None], axis=1)  # [G, N, D]
    nxt = jnp.take_along_axis(tok_rw.reshape(g, -1), plan.score_slot, axis=1)
    project = _projector(model) if chunk else model.project_logits
    out = scores_at(project, h, nxt, chunk, temperature, top_k, top_p)
    zeros = jnp.zeros((g, tok_rw.size // g), jnp.float32)
    logp, ent = (jax.vmap(lambda z, i, x: z.at[i].add(x))(
        zeros, plan.score_slot, jnp.where(plan.score_valid, x, 0.0)).reshape(tok_rw.shape)
        for x in out)
  elif chunk:
    logp, ent = chunked_scores(_projector(model), hidden, tok_rw, chunk, temperature,
                               top_k, top_p)
  else:
    logp, ent = _scores(model.project_logits(hidden), tok_rw, temperature, top_k, top_p)
  values = None
  if value_params is not None:
    head = nnx.merge(value.value_graphdef(), value_params)
    values = packing.unpack(value.token_values(head, hidden), plan)
  return packing.unpack(logp, plan), packing.unpack(ent, plan), values
