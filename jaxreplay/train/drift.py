"""Drift monitor: how far the current policy has moved from the policies behind the buffer.

Every ``drift.every`` learner steps a fixed-size uniform sample of the whole buffer (not
just the training batch) is scored under the current policy. Per staleness bucket
(``algo.staleness_buckets``, current version − generating version) it logs

* ``kl``: KL(μ ‖ π) by the k3 estimator exp(x) − 1 − x, x = log π − log μ, averaged over
  completion tokens drawn from μ (Schulman 2020, "Approximating KL divergence");
* ``ess_seq``: normalised effective sample size (Σw)²/(n·Σw²) (Kong 1992) of the
  sequence-level importance weights w = π(z|q)/μ(z|q) = exp(Σ_t x_t);
* ``ess_token``: the same for the per-token weights exp(x_t);
* ``reward``: mean stored reward; ``count``: sampled rollouts in the bucket.

Shapes are fixed (``num_samples`` rows), so the jitted function compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxreplay.rl import diagnostics
from jaxreplay.parallel import multihost
from jaxreplay.rl.scoring import plan_rows, token_logprobs_by_rows

KEYS = ("kl", "ess_seq", "ess_token", "reward", "count")


def drift_stats(logp_bt, behaviour_logp_bt, mask_bt, reward_b, staleness_b, valid_b,
                edges=diagnostics.DEFAULT_BUCKETS) -> dict:
  """Drift statistics overall and per staleness bucket (pure, jittable).

  Args:
    logp_bt: [S, T] float32 log π of the stored tokens under the current policy.
    behaviour_logp_bt: [S, T] float32 stored log μ. mask_bt: [S, T] bool completion tokens.
    reward_b: [S] float32. staleness_b: [S] int32 current − generating version.
    valid_b: [S] bool, rows that hold a real buffer item.
    edges: staleness bucket lower edges (strictly increasing from 0).

  Returns:
    dict of float32 scalars ``drift/<key>`` and ``drift/<bucket>/<key>`` for each key in
    ``KEYS`` (buckets named by ``rl.diagnostics.bucket_names``); an empty bucket gives 0.

  Raises:
    ValueError: bad ``edges``.
  """
  edges = diagnostics._check_edges(edges)
  x = jnp.where(mask_bt, logp_bt - behaviour_logp_bt, 0.0)
  k3 = jnp.expm1(x) - x
  seq_x = x.sum(-1)

  def block(rows_b):
    m = mask_bt & rows_b[:, None]
    n_tok = m.sum()
    n = rows_b.sum()
    s = jnp.where(rows_b, seq_x, -jnp.inf)
    w = jnp.where(rows_b, jnp.exp(s - jnp.max(jnp.where(rows_b, seq_x, -1e30))), 0.0)
    ess_seq = jnp.where(n > 0, w.sum() ** 2 / jnp.maximum(n * (w * w).sum(), 1e-30), 0.0)
    return {"kl": jnp.where(m, k3, 0.0).sum() / jnp.maximum(n_tok, 1),
            "ess_seq": ess_seq,
            "ess_token": diagnostics.effective_sample_size(jnp.exp(x), m),
            "reward": jnp.where(rows_b, reward_b, 0.0).sum() / jnp.maximum(n, 1),
            "count": n.astype(jnp.float32)}

  s = staleness_b.astype(jnp.int32)
  sel = [valid_b]
  for k in range(len(edges)):
    in_b = valid_b & (s >= edges[k])
    if k + 1 < len(edges):
      in_b &= s < edges[k + 1]
    sel.append(in_b)
  stacked = jax.vmap(block)(jnp.stack(sel))
  out = {f"drift/{k}": v[0] for k, v in stacked.items()}
  for j, name in enumerate(diagnostics.bucket_names(edges)):
    out.update({f"drift/{name}/{k}": v[j + 1] for k, v in stacked.items()})
  return out


def sample_slots(valid_c, key, num_samples: int):
  """``num_samples`` distinct buffer slots, uniform over the valid ones (Gumbel top-k).

  Args:
    valid_c: [C] bool. key: PRNG key. num_samples: S <= C (static).

  Returns:
    (idx [S] int32, ok [S] bool); ``ok`` is False for rows beyond the valid count.
  """
  g = jax.random.gumbel(key, valid_c.shape)
  _, idx = jax.lax.top_k(jnp.where(valid_c, g, -jnp.inf), num_samples)
  return idx.astype(jnp.int32), valid_c[idx]


def make_drift_fn(graphdef, temperature: float, num_samples: int,
                  edges=diagnostics.DEFAULT_BUCKETS, top_k: int = 0, top_p: float = 1.0,
                  chunk: int = 0, rows: int = 0, pack: bool = False):
  """Builds ``drift(params, buffer, key, version_now) -> dict`` (jitted, buffer not donated).

  Args:
    graphdef: the policy graph. temperature: the sampler's (logits / temperature, as the
      behaviour log-probs were computed). num_samples: S rows scored (clipped to C).
    edges: staleness bucket lower edges.
    top_k, top_p: the sampler's truncation (log-probs under the same distribution).
    chunk, rows: score ``rows`` items at a time, ``chunk`` positions of the vocabulary
      computations at a time (``scoring.token_logprobs_by_rows``; 0 = all at once).
    pack: score on packed rows (``scoring.plan_rows``): the function is then a jitted draw,
      the packing plan of the drawn items on the host, and a jitted scoring pass
      (``drift.lower`` lowers the unpacked program, the packed one's upper bound in memory).

  Returns:
    The function; its output is ``drift_stats`` of S slots sampled uniformly from the
    valid items of ``buffer`` (a ``replay.BufferState`` of ``Rollout`` items).
  """
  edges = diagnostics._check_edges(edges)

  def draw(buffer, key):
    s = min(num_samples, buffer.valid.shape[0])
    idx, ok = sample_slots(buffer.valid, key, s)
    return idx, ok, jax.tree.map(lambda a: a[idx], buffer.items)

  def score(params, buffer, idx, ok, items, version_now, plan=None):
    logp, _ = token_logprobs_by_rows(graphdef, params, items.tokens, items.attention_mask,
                                     temperature, top_k, top_p, chunk, rows, plan)
    return drift_stats(logp, items.behaviour_logprobs, items.completion_mask,
                       buffer.reward[idx], version_now - buffer.policy_version[idx], ok, edges)

  @jax.jit
  def drift(params, buffer, key, version_now):
    return score(params, buffer, *draw(buffer, key), version_now)

  if not pack:
    return drift
  draw_jit, score_jit = jax.jit(draw), jax.jit(score)

  def packed_drift(params, buffer, key, version_now):
    idx, ok, items = draw_jit(buffer, key)
    plan = plan_rows(multihost.to_host(items.attention_mask), rows)
    return score_jit(params, buffer, idx, ok, items, version_now, plan)

  packed_drift.lower = drift.lower
  return packed_drift
