"""Per-step diagnostics of an off-policy update, overall and split by staleness bucket.

All reductions are masked: off-mask values (padding, sentinels) are never read
(CASES.md case 6). An empty selection gives 0 for means/quantiles and its ``tokens``
count says it was empty.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxreplay.rl import losses
from jaxreplay.rl.spec import DEFAULT_BUCKETS

QUANTILES = (0.1, 0.5, 0.9)


def masked_quantiles(x_bt, mask_bt, qs=QUANTILES) -> jax.Array:
  """Linear-interpolation quantiles of ``x`` over True entries of ``mask``.

  Returns:
    [len(qs)] float32 (zeros when the mask is empty).
  """
  chex.assert_equal_shape([x_bt, mask_bt])
  vals = jnp.where(mask_bt, x_bt.astype(jnp.float32), jnp.nan).reshape(-1)
  q = jnp.nanquantile(vals, jnp.asarray(qs, jnp.float32))
  return jnp.where(jnp.any(mask_bt), q, 0.0)


def effective_sample_size(w_bt, mask_bt) -> jax.Array:
  """Normalised ESS (Kong 1992) of importance weights: (Σw)² / (n Σw²) ∈ (0, 1].

  1 when all weights are equal; 0 when the mask is empty.
  """
  chex.assert_equal_shape([w_bt, mask_bt])
  w = jnp.where(mask_bt, w_bt.astype(jnp.float32), 0.0)
  n = mask_bt.astype(jnp.float32).sum()
  return jnp.where(n > 0, w.sum() ** 2 / jnp.maximum(n * (w * w).sum(), 1e-30), 0.0)


def bucket_names(edges) -> list[str]:
  """Names of the staleness buckets [e_k, e_{k+1}) and [e_last, ∞): 's0', 's2-3', 's8+'."""
  names = []
  for k, lo in enumerate(edges):
    if k + 1 == len(edges):
      names.append(f"s{lo}+")
    else:
      hi = edges[k + 1] - 1
      names.append(f"s{lo}" if hi == lo else f"s{lo}-{hi}")
  return names


def _check_edges(edges):
  edges = tuple(int(e) for e in edges)
  if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
    raise ValueError(f"edges={edges!r} must be strictly increasing and start at 0")
  return edges


def step_metrics(*, ratio_bt, behaviour_log_ratio_bt, clipped_low_bt, clipped_high_bt,
                 entropy_bt, mask_bt, staleness_b, edges=DEFAULT_BUCKETS) -> dict:
  """Ratio mean/quantiles/min/max, clip fractions, KL(μ‖π), entropy and ESS.

  Args:
    ratio_bt: [B, T] ratio the trust region sees. behaviour_log_ratio_bt: [B, T]
      log π − log μ. clipped_low_bt, clipped_high_bt: [B, T] bool. entropy_bt: [B, T].
    mask_bt: [B, T] bool tokens in the loss. staleness_b: [B] int.
    edges: staleness bucket lower edges, strictly increasing from 0.

  Returns:
    Dict of float32 scalars: ``ratio_mean``, ``ratio_p10/p50/p90``, ``ratio_min``,
    ``ratio_max``, ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``,
    ``kl_behaviour`` (k3 estimate of KL(μ‖π) on μ's samples), ``kl_behaviour_k1``,
    ``entropy``, ``ess`` (normalised ESS of the token weights π/μ), ``tokens``; and
    the same keys as ``stale/<bucket>/<key>`` for each staleness bucket.

  Raises:
    ValueError: bad ``edges``.
  """
  edges = _check_edges(edges)
  chex.assert_rank(staleness_b, 1)
  lr = behaviour_log_ratio_bt
  w = jnp.exp(lr)

  def block(m):
    q = masked_quantiles(ratio_bt, m)
    low = losses.masked_mean(clipped_low_bt.astype(jnp.float32), m)
    high = losses.masked_mean(clipped_high_bt.astype(jnp.float32), m)
    return {
        "ratio_mean": losses.masked_mean(ratio_bt, m),
        "ratio_p10": q[0], "ratio_p50": q[1], "ratio_p90": q[2],
        "ratio_min": jnp.where(jnp.any(m), jnp.min(jnp.where(m, ratio_bt, jnp.inf)), 0.0),
        "ratio_max": jnp.where(jnp.any(m), jnp.max(jnp.where(m, ratio_bt, -jnp.inf)), 0.0),
        "clip_frac_low": low, "clip_frac_high": high, "clip_frac": low + high,
        "kl_behaviour": losses.masked_mean(w - 1.0 - lr, m),
        "kl_behaviour_k1": losses.masked_mean(-lr, m),
        "entropy": losses.masked_mean(entropy_bt, m),
        "ess": effective_sample_size(w, m),
        "tokens": m.astype(jnp.float32).sum(),
    }

  # All selections (overall + one per bucket) go through one vmapped ``block``, which
  # keeps the traced graph — and the compile time — independent of the bucket count.
  s = staleness_b.astype(jnp.int32)
  names = bucket_names(edges)
  sel = [jnp.ones_like(s, bool)]
  for k in range(len(edges)):
    in_b = s >= edges[k]
    if k + 1 < len(edges):
      in_b &= s < edges[k + 1]
    sel.append(in_b)
  masks = mask_bt[None] & jnp.stack(sel)[:, :, None]  # [1 + K, B, T]
  stacked = jax.vmap(block)(masks)
  out = {key: v[0] for key, v in stacked.items()}
  for k, name in enumerate(names):
    out.update({f"stale/{name}/{key}": v[k + 1] for key, v in stacked.items()})
  return out


_MIN_KEYS = ("ratio_min",)
_MAX_KEYS = ("skipped_update",)
# Per-token statistics over the loss mask (``step_metrics`` keys, overall and per bucket, and
# ``objective``'s token means): weighted by each update's ``tokens`` of the same selection.
_TOKEN_WEIGHTED = ("ratio_mean", "ratio_p10", "ratio_p50", "ratio_p90", "clip_frac_low",
                   "clip_frac_high", "clip_frac", "kl_behaviour", "kl_behaviour_k1", "entropy",
                   "ess", "ratio_masked_frac", "kl_ref", "value_loss", "value_mean",
                   "return_mean")
# Aggregates of the loss (``losses.aggregate``): weighted by each update's normaliser.
_AGGREGATES = ("loss", "pg_loss")


def combine_updates(per_update: dict, epochs: int, loss_weights) -> dict:
  """Merges the metrics of U optimizer updates (leading axis U) into one step's metrics.

  ``loss`` and ``pg_loss`` are averaged weighted by ``loss_weights`` (each update's
  ``losses.aggregate_normaliser``), which makes them the loss of the whole batch under the
  configured aggregation (averaged over epochs) when every minibatch is evaluated at the
  same parameters. The token means — ``step_metrics`` keys (overall and per bucket) and
  ``ratio_masked_frac``, ``kl_ref``, ``value_loss``, ``value_mean``, ``return_mean`` — are
  averaged weighted by the token count of their selection, which makes them the mean over
  the whole batch's loss tokens under the same condition, and keeps a bucket empty in one
  minibatch from diluting it (quantiles and ``ess`` are not means, and become
  token-weighted averages of the per-minibatch values); ``ratio_min``/``ratio_max`` take
  the min/max over non-empty selections, ``skipped_update`` the max, ``tokens`` the total
  per epoch; every other key the plain mean: per-update values (``grad_norm``) and
  per-sequence means (``staleness_weight_mean``, ``eps_high_mean``), whose minibatches all
  hold B/num_minibatches rows. With U = 1 ``loss`` and ``pg_loss`` are returned unchanged.

  Args:
    per_update: dict of [U] float32 arrays. epochs: passes over the batch among the U.
    loss_weights: [U] float32 normalisers (≥ 0).

  Returns:
    Dict of float32 scalars with the same keys.
  """
  out = {}
  n_loss = jnp.asarray(loss_weights, jnp.float32)
  w_loss = n_loss / jnp.maximum(n_loss.sum(0), 1.0)  # n/n is exactly 1: U = 1 is the identity
  for key, v in per_update.items():
    prefix, _, leaf = key.rpartition("/")
    if leaf in _MIN_KEYS + ("ratio_max",):  # over the updates whose selection was non-empty
      n = per_update[f"{prefix}/tokens" if prefix else "tokens"]
      big = jnp.inf if leaf in _MIN_KEYS else -jnp.inf
      red = jnp.min if leaf in _MIN_KEYS else jnp.max
      out[key] = jnp.where(n.sum(0) > 0, red(jnp.where(n > 0, v, big), 0), 0.0)
    elif leaf in _MAX_KEYS:
      out[key] = v.max(0)
    elif leaf == "tokens":
      out[key] = v.sum(0) / epochs
    elif leaf in _TOKEN_WEIGHTED:
      n = per_update[f"{prefix}/tokens" if prefix else "tokens"]
      out[key] = (v * n).sum(0) / jnp.maximum(n.sum(0), 1.0)
    elif key in _AGGREGATES:
      out[key] = (v * w_loss).sum(0)
    else:
      out[key] = v.mean(0)
  return out
