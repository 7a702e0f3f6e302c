"""The theory's noise constants, measured: σ²(s) per staleness bucket, α and ρ.

Arnal et al. 2026 (§4, Thm 4.4–4.5; ``../shared/paper/NOTES.md`` §4) model the minibatch
gradient at step t as (1/B) Σ_i G(θ_t, z_i), each buffer sample's error
ε_{t,i} = G(θ_t, z_i) − ∇F(θ_t) having

* variance  E‖ε_{t,i}‖² ≤ σ²(s_i), s_i = t − t_i the sample's staleness (learner steps since
  it was generated, ``version_now − policy_version``), σ non-decreasing; the power law
  σ(s) = σ(1)·s^α of App. 9.3.2 (there written (s/τ)^α) gives the closed form of
  ``theory.power_law_design``;
* correlation  corr(ε_{t,i}, ε_{t,j}) ≤ ρ·|t_i − t_j|/N, ρ ∈ [0, 1], N the number of items in
  the buffer. Since t_i = t − s_i, |t_i − t_j| = |s_i − s_j|: only ages are needed.

The correlation is of vectors, corr(a, b) = E⟨a, b⟩ / √(E‖a‖² E‖b‖²): that is the quantity
the bound uses, because E‖(1/B) Σ_b ε_{i_b}‖² = (1/B²) Σ_{b,b'} E⟨ε_{i_b}, ε_{i_b'}⟩. With
B draws of N co-resident items whose insertion times span x = N/R steps, the diagonal gives
σ̄²/B, a repeated item σ̄²/N, and distinct pairs at most σ̄²·ρ·mean|t_i − t_j|/N ≤ σ̄²·ρ/R:
the V = σ̄²(x)(1/B + 1/N + ρ/R) of Thm 4.4. (The linear-in-|t_i − t_j| form is a valid
covariance only while ρ·x is small enough: I + (ρ/N)|t_i − t_j| is PSD up to about
ρ·x ≈ 5; ``synthetic_errors`` checks.)

**What is estimated.** Taking the paper's bounds as equalities defines the model

    C_ij = E⟨ε_i, ε_j⟩ = σ(s_i) σ(s_j) · (δ_ij + (1 − δ_ij) ρ |s_i − s_j| / N),

with σ²(s) constant on each staleness bucket [e_b, e_{b+1}) (``edges``). ∇F(θ_t) is unknown,
so the errors are measured against a reference: e_i = g_i − Σ_j a_j g_j (``center='mean'``:
a = 1/n over the drawn items, the buffer-mean gradient; ``'fresh'``: a uniform over the
staleness-0 items, the on-policy gradient; ``'reference'``: a = 0 and a given reference
vector, e.g. an independent fresh batch's mean). Then e = H ε with H = I − 1aᵀ (the common
∇F cancels exactly), and the Gram matrix Ĝ = e eᵀ has E[Ĝ] = H C Hᵀ, linear in
(σ²_1..σ²_E, ρ) once σ is fixed inside the ρ term. ``estimate_noise`` solves E + 1 moment
equations — per bucket, Σ_{i∈b} Ĝ_ii = Σ_{i∈b} E[Ĝ_ii]; and the least-squares slope
equation Σ_{i≠j} Q_ij Ĝ_ij = Σ_{i≠j} Q_ij E[Ĝ_ij] with Q = (H W Hᵀ)_ij / (σ_i² σ_j²),
W_ij = σ_i σ_j |s_i − s_j|/N — re-solving ``iters`` times with σ updated. With a = 0 the ρ
equation is exactly the least-squares slope, through the origin, of the pairwise error
correlations Ĝ_ij/(σ_iσ_j) on |t_i − t_j|/N: the paper's ρ, the constant that makes its
correlation bound tight. Everything the centering does (the −2a_i σ_i² on the diagonal,
the induced negative correlation between all pairs) is in the model, so no 1/n bias
remains. With ``center='mean'`` the buffer-wide mean bias of stale samples is part of
the reference, not of σ² (use ``'fresh'`` or an on-policy reference to include it).

α is the weighted (by bucket count) least-squares slope of log σ̂(s) = ½ log σ̂²_b on
log s̄_b over buckets with lower edge ≥ 1 and at least ``min_count`` items (s̄_b the
geometric-mean age of the bucket's items; App. 9.3.2 fits σ(s) ∝ s^α, σ(0) = 0, so the
s = 0 bucket carries no information on α). The spread of α and ρ is a delete-a-group
jackknife over items (``jackknife`` groups; Efron & Stein 1981 / Shao & Tu 1995 §2.1):
SE = √((m−1)/m Σ_g (θ̂_(g) − θ̄)²).

**Bias.** The paper's third assumption, ‖E[ε_{t,i} | F_t]‖ ≤ κ‖θ_t − θ_{t_i}‖, is the one its
optimal design drops (Thm 4.5 is Thm 4.4 as compute → ∞). ``bias_profile`` measures it on the
same projected gradients: per bucket, the squared distance of the bucket's mean gradient from
the youngest items' mean, corrected for both means' sampling noise, and its largest slope per
step of age (``NoiseEstimate.bias2``, ``bias_slope``, with ``grad2`` = ‖∇F‖²).

**Cheap.** The estimators need only inner products of per-sample gradients, which a random
Gaussian projection P ∈ R^{k×D} with entries N(0, 1/k) keeps in expectation
(E⟨Pa, Pb⟩ = ⟨a, b⟩; Johnson–Lindenstrauss; Achlioptas 2003): ``projected_grads`` computes
P g_i for all items with k forward-mode products (``jax.linearize`` once, then one JVP per
direction ``projection_direction(params, key, d, k)``, generated from the key on the fly),
so neither a per-sample gradient nor P is ever materialised. The relative error of a
projected squared norm is ≈ √(2/k); tests compare the projected estimate with the exact one.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.rl import diagnostics
from jaxreplay.rl.objective import policy_loss
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rl.spec import AlgoSpec

DEFAULT_EDGES = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
CENTERS = ("mean", "fresh", "reference")
DIRECTIONS_PER_PASS = 8  # JVPs vectorised together in ``projected_grads`` (8 tangents live)
_HI = jax.lax.Precision.HIGHEST
_TINY = 1e-30


class NoiseEstimate(NamedTuple):
  """The estimates of one pass (``estimate_noise``); E = len(edges) buckets.

  Attributes:
    sigma2: [E] float32, σ̂²(s) per staleness bucket [e_b, e_{b+1}) (the last open), in
      squared gradient units (of the loss per parameter); NaN for an empty bucket.
    count: [E] int32, items in each bucket.
    age: [E] float32, the bucket's representative staleness (geometric mean of its items'
      ages for a lower edge >= 1, arithmetic mean for the bucket holding 0; NaN if empty).
    alpha: float32 scalar, the power-law exponent α (NaN with < 2 usable buckets).
    alpha_se: float32 scalar, its jackknife standard error (NaN without ``jackknife``).
    log_sigma1: float32 scalar, the fit's intercept log σ(1).
    rho: float32 scalar, ρ (unclamped; NaN when all items have one age).
    rho_se: float32 scalar, its jackknife standard error.
    num_items: int32 scalar, items used (valid rows).
    bias2: [E] float32, β̂²(s) = ‖E[g | age in bucket] − E[g | youngest age]‖² per bucket
      (``bias_profile``; NaN for the youngest age's bucket, an empty one or one below
      ``min_count``), squared gradient units.
    bias_slope: float32 scalar, max over buckets of β̂_b / (s̄_b − s_min): the bias per
      learner step of age (gradient units; NaN without a usable bucket).
    grad2: float32 scalar, ‖∇F‖² estimated from the youngest items (unbiased; may be < 0).
    fresh_var: float32 scalar, per-item E‖g − ∇F‖² of the youngest items.
  """

  sigma2: jax.Array
  count: jax.Array
  age: jax.Array
  alpha: jax.Array
  alpha_se: jax.Array
  log_sigma1: jax.Array
  rho: jax.Array
  rho_se: jax.Array
  num_items: jax.Array
  bias2: jax.Array
  bias_slope: jax.Array
  grad2: jax.Array
  fresh_var: jax.Array


def metrics(est: NoiseEstimate, edges=DEFAULT_EDGES, prefix: str = "noise") -> dict:
  """The estimate as flat float metrics (host values).

  Args:
    est: a ``NoiseEstimate`` (device or host arrays). edges: the buckets it was made with.
    prefix: the metric namespace.

  Returns:
    {``noise/alpha``, ``noise/alpha_se``, ``noise/log_sigma1``, ``noise/rho``,
     ``noise/rho_se``, ``noise/num_items``, ``noise/bias_slope``, ``noise/grad2``,
     ``noise/fresh_var``, and per non-empty bucket named as ``diagnostics.bucket_names``
     (``s0``, ``s2-3``, ``s64+``): ``noise/sigma2_<bucket>``, ``noise/count_<bucket>`` and,
     where finite, ``noise/bias2_<bucket>``} — floats.
  """
  out = {f"{prefix}/{k}": float(np.asarray(getattr(est, k)))
         for k in ("alpha", "alpha_se", "log_sigma1", "rho", "rho_se", "num_items",
                   "bias_slope", "grad2", "fresh_var")}
  s2, cnt, b2 = np.asarray(est.sigma2), np.asarray(est.count), np.asarray(est.bias2)
  for name, v, c, b in zip(diagnostics.bucket_names(edges), s2, cnt, b2):
    if c > 0:
      out[f"{prefix}/sigma2_{name}"] = float(v)
      out[f"{prefix}/count_{name}"] = float(c)
      if np.isfinite(b):
        out[f"{prefix}/bias2_{name}"] = float(b)
  return out


def _onehot(ages, valid, edges) -> jax.Array:
  """[n, E] float32 bucket membership of the valid items."""
  lo = jnp.asarray(edges, jnp.int32)
  hi = jnp.concatenate([lo[1:], jnp.array([jnp.iinfo(jnp.int32).max], jnp.int32)])
  s = ages.astype(jnp.int32)[:, None]
  return ((s >= lo) & (s < hi) & valid[:, None]).astype(jnp.float32)


def _center_weights(ages, valid, center) -> jax.Array:
  """a [n]: the reference is Σ_j a_j g_j (module docstring)."""
  m = valid.astype(jnp.float32)
  if center == "mean":
    w = m
  elif center == "fresh":
    w = m * (ages == 0)
  else:
    return jnp.zeros_like(m)
  return w / jnp.maximum(w.sum(), 1.0)  # all zero when there is no item (``estimate_noise``)


def _hxh(x, a):
  """H X Hᵀ for H = I − 1aᵀ: X − 1(aᵀX) − (Xa)1ᵀ + (aᵀXa) (O(n²))."""
  xa = jnp.matmul(x, a, precision=_HI)
  ax = jnp.matmul(a, x, precision=_HI)
  return x - ax[None, :] - xa[:, None] + jnp.dot(a, xa, precision=_HI)


def _moments(gram, a, onehot, ages, valid, num_items, iters):
  """Solves the E + 1 moment equations (module docstring) for (σ² [E], ρ)."""
  n, e = onehot.shape
  m = valid.astype(jnp.float32)
  offd = (1.0 - jnp.eye(n, dtype=jnp.float32)) * m[:, None] * m[None, :]
  s = ages.astype(jnp.float32)
  dist = jnp.abs(s[:, None] - s[None, :]) / num_items * offd  # |t_i − t_j| / N
  n_b = onehot.sum(0)
  empty = n_b == 0
  c = jnp.matmul(a * a, onehot, precision=_HI)  # Σ_l a_l² o_lb
  # Σ_{i∈b} (H S Hᵀ)_ii = Σ_b' v_b' K_bb': diagonal (1 − 2a_i) o_ib δ_bb' + n_b c_b'.
  k_vv = jnp.diag(jnp.matmul(1.0 - 2.0 * a, onehot, precision=_HI)) + n_b[:, None] * c[None, :]
  k_vv = jnp.where(empty[:, None], jnp.eye(e, dtype=jnp.float32), k_vv)
  lhs_v = jnp.where(empty, 0.0, jnp.matmul(jnp.diag(gram), onehot, precision=_HI))
  v = jnp.linalg.solve(k_vv, lhs_v)  # ρ = 0 start
  rho = jnp.float32(0.0)
  has_pairs = dist.sum() > 0
  for _ in range(iters):
    sig2 = jnp.maximum(jnp.matmul(onehot, v, precision=_HI), _TINY) * m + (1.0 - m)
    sig = jnp.sqrt(sig2)
    wt = _hxh(sig[:, None] * dist * sig[None, :], a)
    k_v_rho = jnp.where(empty, 0.0, jnp.matmul(jnp.diag(wt) * m, onehot, precision=_HI))
    q = wt / (sig2[:, None] * sig2[None, :]) * offd
    q_rho = jnp.where(has_pairs, (q * wt).sum(), 1.0)
    q_row = jnp.where(has_pairs,
                      -2.0 * jnp.matmul(q.sum(0) * a, onehot, precision=_HI) + c * q.sum(), 0.0)
    lhs_rho = jnp.where(has_pairs, (q * gram).sum(), 0.0)
    mat = jnp.block([[k_vv, k_v_rho[:, None]], [q_row[None, :], q_rho[None, None]]])
    sol = jnp.linalg.solve(mat, jnp.concatenate([lhs_v, lhs_rho[None]]))
    v, rho = sol[:e], sol[e]
  return jnp.where(empty, jnp.nan, v), jnp.where(has_pairs, rho, jnp.nan)


def fit_power_law(sigma2, age, count, edges=DEFAULT_EDGES, min_count: int = 2):
  """α and log σ(1) of σ(s) = σ(1)·s^α from per-bucket variances (App. 9.3.2).

  Weighted least squares of ½·log σ̂²_b on log s̄_b, weights the bucket counts, over the
  buckets with lower edge >= 1, count >= ``min_count`` and σ̂²_b > 0.

  Args:
    sigma2: [E] float σ̂² per bucket. age: [E] float representative ages. count: [E] int.
    edges: the buckets' lower edges (static). min_count: >= 1 items for a bucket to count.

  Returns:
    (alpha, log_sigma1) float32 scalars; NaN with fewer than 2 usable buckets.
  """
  lo = jnp.asarray(edges, jnp.float32)
  use = (lo >= 1) & (count >= min_count) & (sigma2 > 0) & jnp.isfinite(sigma2)
  w = jnp.where(use, count.astype(jnp.float32), 0.0)
  x = jnp.where(use, jnp.log(jnp.where(use, age, 1.0)), 0.0)
  y = jnp.where(use, 0.5 * jnp.log(jnp.where(use, sigma2, 1.0)), 0.0)
  sw = w.sum()
  xm, ym = (w * x).sum() / sw, (w * y).sum() / sw
  sxx = (w * (x - xm) ** 2).sum()
  alpha = (w * (x - xm) * (y - ym)).sum() / sxx
  ok = (use.sum() >= 2) & (sxx > 0)
  return jnp.where(ok, alpha, jnp.nan), jnp.where(ok, ym - alpha * xm, jnp.nan)


def _point(errors, ages, valid, a, num_items, edges, iters, min_count):
  """(σ² [E], count [E], age [E], α, log σ1, ρ) from centred errors [n, k]."""
  e_c = errors * valid[:, None].astype(errors.dtype)
  gram = jnp.matmul(e_c, e_c.T, precision=_HI).astype(jnp.float32)
  onehot = _onehot(ages, valid, edges)
  count = onehot.sum(0)
  log_s = jnp.log(jnp.maximum(ages.astype(jnp.float32), 1.0))
  lo = jnp.asarray(edges, jnp.float32)
  geo = jnp.exp(jnp.matmul(log_s, onehot, precision=_HI) / count)
  arith = jnp.matmul(ages.astype(jnp.float32), onehot, precision=_HI) / count
  age = jnp.where(lo >= 1, geo, arith)
  sigma2, rho = _moments(gram, a, onehot, ages, valid, num_items, iters)
  alpha, log_s1 = fit_power_law(sigma2, age, count, edges, min_count)
  return sigma2, count.astype(jnp.int32), age, alpha, log_s1, rho


def bias_profile(grads, ages, valid, edges=DEFAULT_EDGES, min_count: int = 2, groups=None):
  """The bias of stale items' expected gradient against the youngest items' (Thm 4.4).

  The paper's bias assumption is ‖E[ε_{t,i} | F_t]‖ ≤ κ‖θ_t − θ_{t_i}‖ (§4; NOTES.md §4):
  an item generated s steps ago has an expected gradient off ∇F(θ_t) by up to κ times the
  distance the parameters moved since. With m_0 the mean gradient of the youngest items
  (age s_min: 0 in ``sync``, an unbiased estimate of ∇F), m_b a bucket's mean and v the
  per-item variance Σ‖g − m‖²/(n − 1),

      β̂²_b = ‖m_b − m_0‖² − V̂(m_b) − V̂(m_0)   (for ‖E m_b − ∇F‖²),
      ĝ² = ‖m_0‖² − V̂(m_0)                      (for ‖∇F‖²),

  with V̂(m) the cluster-robust variance of a mean over ``groups`` (the G completions of one
  prompt are correlated, so v/n would understate it): V̂(m) = C/(C − 1) · Σ_c ‖Σ_{i∈c}
  (g_i − m)‖² / n², C the clusters in the bucket (Liang & Zeger 1986); with every item its
  own cluster this is v/n, the unbiased correction for independent items. Groups must not
  straddle buckets (a group is generated, hence aged, together).

  and the bias per step of age is max_b β̂_b/(s̄_b − s_min) over buckets with at least
  ``min_count`` items (β̂_b = √max(β̂²_b, 0); s̄_b the bucket's mean age). The maximum makes
  the slope an estimate of the Lipschitz-type constant (the bound must hold at every age),
  not of an average; a bias that saturates after one step (stale items carry none of the
  fresh gradient) gives its largest slope at the first stale age.

  Args:
    grads: [n, k] float per-item gradients (or projections), all at θ_t.
    ages: [n] int staleness. valid: [n] bool. edges: bucket lower edges (static).
    min_count: >= 2 items a bucket (and the youngest age) needs; it also needs 2 clusters.
    groups: [n] int cluster labels (``Rollout.group_id``), or None (independent items).

  Returns:
    (bias2 [E], bias_slope, grad2, fresh_var) float32; NaN where not identifiable (fewer
    than ``min_count`` youngest items or 2 clusters, no other usable bucket). The maximum
    over noisy buckets has a floor above 0 when there is no bias (with 4 groups of 8 per
    age and 5 ages, about 0.3–0.5 relative to the minibatch gradient: the tests simulate it).
  """
  grads = jnp.asarray(grads, jnp.float32)
  m = valid.astype(jnp.float32)
  big = jnp.iinfo(jnp.int32).max
  s_min = jnp.min(jnp.where(valid, ages, big))
  young = m * (ages == s_min)
  onehot = _onehot(ages, valid, edges) * (1.0 - young)[:, None]  # youngest items apart

  n_all = ages.shape[0]
  if groups is None:
    cluster = jnp.arange(n_all)
  else:  # labels 0..n−1 of the sample's distinct groups
    _, cluster = jnp.unique(jnp.asarray(groups), size=n_all, return_inverse=True)
    cluster = cluster.reshape(-1)

  def stats(w):  # mean [k], per-item variance, count, cluster-robust variance of the mean
    n = w.sum()
    mean = jnp.matmul(w, grads, precision=_HI) / jnp.maximum(n, 1.0)
    dev = w[:, None] * (grads - mean[None, :])
    ss = (dev ** 2).sum()
    sums = jax.ops.segment_sum(dev, cluster, num_segments=n_all)
    c = (jax.ops.segment_sum(w, cluster, num_segments=n_all) > 0).sum().astype(jnp.float32)
    v_mean = c / jnp.maximum(c - 1.0, 1.0) * (sums ** 2).sum() / jnp.maximum(n, 1.0) ** 2
    return mean, ss / jnp.maximum(n - 1.0, 1.0), n, v_mean, c

  m0, v0, n0, vm0, c0 = stats(young)
  means, _, n_b, vm_b, c_b = jax.vmap(stats, in_axes=1)(onehot)
  d2 = ((means - m0[None, :]) ** 2).sum(1)
  bias2 = d2 - vm_b - vm0
  age_b = jnp.matmul(ages.astype(jnp.float32), onehot, precision=_HI) / jnp.maximum(n_b, 1.0)
  use = (n_b >= min_count) & (n0 >= min_count) & (c_b >= 2) & (c0 >= 2)
  slope = jnp.where(use, jnp.sqrt(jnp.maximum(bias2, 0.0)) /
                    jnp.maximum(age_b - s_min.astype(jnp.float32), 1e-6), -jnp.inf)
  ok0 = (n0 >= min_count) & (c0 >= 2)
  return (jnp.where(use, bias2, jnp.nan),
          jnp.where(use.any(), slope.max(), jnp.nan),
          jnp.where(ok0, (m0 ** 2).sum() - vm0, jnp.nan),
          jnp.where(ok0, v0, jnp.nan))


@functools.partial(jax.jit, static_argnames=("edges", "center", "iters", "jackknife",
                                             "min_count"))
def estimate_noise(grads, ages, valid=None, *, num_items, edges=DEFAULT_EDGES,
                   center: str = "mean", reference=None, iters: int = 3, jackknife: int = 8,
                   min_count: int = 2, groups=None) -> NoiseEstimate:
  """σ²(s) per staleness bucket, α and ρ from per-sample gradients (module docstring).

  Pure and jitted (``edges`` a tuple, ``center``, ``iters``, ``jackknife``, ``min_count``
  static; it may be called inside other jitted or vmapped code). Works on exact per-sample gradients (k = D) and on projected ones (``projected_grads``)
  alike: only inner products are used.

  Args:
    grads: [n, k] float, per-sample gradients G(θ_t, z_i) (or their projections P g_i) of
      the loss, all at the current parameters θ_t.
    ages: [n] int, staleness s_i = t − t_i in learner steps (>= 0).
    valid: [n] bool rows to use (default all).
    num_items: N, items co-resident in the buffer (the paper's N; float or int scalar,
      may be traced).
    edges: staleness bucket lower edges, strictly increasing from 0.
    center: one of ``CENTERS``: the reference ∇F(θ_t) is the mean of the valid items,
      of the staleness-0 items, or ``reference``.
    reference: [k] float, the reference gradient (projected like ``grads``), for
      ``center='reference'``.
    iters: >= 1 re-solves with σ updated inside the ρ equation.
    jackknife: m >= 2 delete-a-group jackknife groups (item i in group i mod m), or 0 for
      no standard errors (NaN).
    min_count: items a bucket needs to enter the α fit.
    groups: [n] int cluster labels for the bias's variance correction (``bias_profile``;
      ``Rollout.group_id``), or None.

  Returns:
    ``NoiseEstimate`` (float32; NaN where not identifiable: empty buckets, < 2 usable
    buckets for α, a single age for ρ, ``center='fresh'`` with no staleness-0 item).

  Raises:
    ValueError: bad ``edges`` or ``center``, ``center='reference'`` without ``reference``,
      ``jackknife == 1``, ``iters < 1``, or mismatched shapes.
  """
  edges = diagnostics._check_edges(edges)
  if center not in CENTERS:
    raise ValueError(f"center={center!r} must be one of {CENTERS}")
  if (center == "reference") != (reference is not None):
    raise ValueError("center='reference' needs reference= (and only it takes one)")
  if jackknife == 1 or jackknife < 0 or iters < 1:
    raise ValueError(f"jackknife={jackknife} must be 0 or >= 2, iters={iters} >= 1")
  grads = jnp.asarray(grads, jnp.float32)
  ages = jnp.asarray(ages, jnp.int32)
  if grads.ndim != 2 or ages.shape != grads.shape[:1]:
    raise ValueError(f"grads {grads.shape} must be [n, k] and ages {ages.shape} [n]")
  n = grads.shape[0]
  valid = jnp.ones((n,), bool) if valid is None else jnp.asarray(valid, bool)
  num_items = jnp.asarray(num_items, jnp.float32)

  def run(ok):
    a = _center_weights(ages, ok, center)
    base = grads - (jnp.asarray(reference, jnp.float32)[None, :] if center == "reference"
                    else jnp.matmul(a, grads, precision=_HI)[None, :])
    return _point(base, ages, ok, a, num_items, edges, iters, min_count)

  sigma2, count, age, alpha, log_s1, rho = run(valid)
  alpha_se = rho_se = jnp.float32(jnp.nan)
  if jackknife:
    folds = jnp.arange(n) % jackknife
    masks = valid[None, :] & (folds[None, :] != jnp.arange(jackknife)[:, None])
    _, _, _, a_j, _, r_j = jax.vmap(run)(masks)
    se = lambda t: jnp.sqrt((jackknife - 1) / jackknife * ((t - t.mean()) ** 2).sum())
    alpha_se, rho_se = se(a_j), se(r_j)
  # no staleness-0 item to centre on ('fresh'): nothing is measured
  ok = (valid & (ages == 0)).any() if center == "fresh" else jnp.bool_(True)
  nan = lambda x: jnp.where(ok, x, jnp.nan)
  bias2, slope, grad2, fresh_var = bias_profile(grads, ages, valid, edges,
                                                max(min_count, 2), groups)
  return NoiseEstimate(sigma2=nan(sigma2), count=count, age=age, alpha=nan(alpha),
                       alpha_se=nan(alpha_se), log_sigma1=nan(log_s1), rho=nan(rho),
                       rho_se=nan(rho_se), num_items=valid.sum().astype(jnp.int32),
                       bias2=bias2, bias_slope=slope, grad2=grad2, fresh_var=fresh_var)


# --------------------------------------------------------------------------- synthetic


def synthetic_covariance(ages, alpha: float, rho: float, num_items: float,
                         sigma1: float = 1.0, sigma_fresh: float | None = None) -> np.ndarray:
  """The paper's error covariance with its bounds as equalities (module docstring).

  C_ij = σ(s_i)σ(s_j)(δ_ij + (1−δ_ij)·ρ|s_i − s_j|/N), σ(s) = σ1·s^α for s >= 1.

  Args:
    ages: [n] int staleness. alpha: the exponent α. rho: ρ >= 0. num_items: N > 0.
    sigma1: σ(1) > 0. sigma_fresh: σ(0) (default σ1; the power law's σ(0) = 0 would make
      fresh items noiseless).

  Returns:
    [n, n] float64 covariance of E⟨ε_i, ε_j⟩.

  Raises:
    ValueError: the matrix is not positive definite (ρ·x too large, x the age span).
  """
  s = np.asarray(ages, np.float64)
  sig = np.where(s >= 1, sigma1 * np.maximum(s, 1.0) ** alpha,
                 sigma1 if sigma_fresh is None else sigma_fresh)
  corr = np.eye(len(s)) + (1 - np.eye(len(s))) * rho * np.abs(s[:, None] - s[None, :]) / num_items
  c = sig[:, None] * corr * sig[None, :]
  if np.linalg.eigvalsh(c)[0] <= 0:
    raise ValueError(f"rho={rho} with ages up to {s.max():g} and N={num_items} gives no valid "
                     "covariance (I + (rho/N)|s_i - s_j| is not positive definite)")
  return c


def synthetic_errors(rng: np.random.Generator, ages, alpha: float, rho: float,
                     num_items: float, dim: int, sigma1: float = 1.0,
                     sigma_fresh: float | None = None) -> np.ndarray:
  """Gaussian per-sample gradient errors with the paper's σ(s) and correlation structure.

  ε = L Z with L Lᵀ = ``synthetic_covariance(...)`` and Z [n, dim] i.i.d. N(0, 1/dim), so
  E⟨ε_i, ε_j⟩ = C_ij exactly (Arnal et al. 2026 §4 assumptions, as equalities).

  Args:
    rng: numpy Generator. ages: [n] int. alpha, rho, num_items, sigma1, sigma_fresh: as
      ``synthetic_covariance``. dim: D >= 1 gradient dimension.

  Returns:
    [n, dim] float64 errors.

  Raises:
    ValueError: as ``synthetic_covariance``.
  """
  c = synthetic_covariance(ages, alpha, rho, num_items, sigma1, sigma_fresh)
  z = rng.standard_normal((len(c), dim)) / np.sqrt(dim)
  return np.linalg.cholesky(c) @ z


def gaussian_projection(rng: np.random.Generator, dim: int, k: int) -> np.ndarray:
  """[k, dim] float64 matrix with i.i.d. N(0, 1/k) entries: E⟨Pa, Pb⟩ = ⟨a, b⟩ (JL)."""
  return rng.standard_normal((k, dim)) / np.sqrt(k)


# --------------------------------------------------------------------------- per-sample grads


def projection_direction(params, key, d, k: int):
  """Direction d of the projection: a pytree like ``params``, i.i.d. N(0, 1/k) entries.

  Row d of P (``projected_grads``), generated from ``fold_in(fold_in(key, d), leaf index)``
  in each leaf's dtype, so it is never stored with the other k − 1.

  Args:
    params: parameter pytree. key: PRNG key. d: int (may be traced) in [0, k). k: rows.

  Returns:
    pytree of arrays shaped and typed like ``params``.
  """
  leaves, tree = jax.tree.flatten(params)
  kd = jax.random.fold_in(key, d)
  scale = 1.0 / np.sqrt(k)
  out = [(jax.random.normal(jax.random.fold_in(kd, i), jnp.shape(x), jnp.float32) * scale
          ).astype(jnp.result_type(x)) for i, x in enumerate(leaves)]
  return jax.tree.unflatten(tree, out)


def projected_grads(loss_vec_fn: Callable, params, key, k: int) -> jax.Array:
  """P·∇ℓ_i for all items: [n, k] without forming a per-sample gradient or P.

  ``jax.linearize`` of the per-item loss vector L(θ) = (ℓ_1..ℓ_n) once, then one JVP per
  direction p_d (``projection_direction``): J p_d = (⟨∇ℓ_i, p_d⟩)_i, column d of the result.
  ``DIRECTIONS_PER_PASS`` directions are pushed through together (that many parameter-sized
  tangents live at once).

  Args:
    loss_vec_fn: params -> [n] float32 per-item losses. params: pytree. key: PRNG key.
    k: >= 1 directions (static).

  Returns:
    [n, k] float32.
  """
  _, jvp = jax.linearize(loss_vec_fn, params)
  cols = jax.lax.map(lambda d: jvp(projection_direction(params, key, d, k)).astype(jnp.float32),
                     jnp.arange(k), batch_size=math.gcd(k, DIRECTIONS_PER_PASS))
  return cols.T


def per_item_loss_fn(graphdef: nnx.GraphDef, algo, temperature: float, top_k: int = 0,
                     top_p: float = 1.0) -> Callable:
  """``loss_vec(params, items, ages) -> [n] float32``: each item's own policy loss ℓ_i.

  ℓ_i is ``objective.policy_loss`` on the one-item batch (item i, weight 1, its staleness
  for the staleness-adaptive trust region), so ∇ℓ_i is the paper's G(θ, z_i) (§4) under
  the configured loss; for ``seq_mean_*`` aggregations the batch loss is their mean. Log-probs
  are scored at the sampler's distribution (``scoring.token_logprobs``) for all n items in
  one pass.

  Args:
    graphdef: policy graph. algo: ``AlgoSpec`` or mapping. temperature, top_k, top_p: the
      sampler's.

  Returns:
    The function (traceable). items: ``Rollout`` of n rows; ages: [n] int32.

  Raises:
    ValueError: an ``algo`` with a value head or a KL reference (``policy_loss``).
  """
  spec = AlgoSpec.from_config(algo)
  if spec.uses_value_head or spec.uses_reference:
    raise ValueError("noise estimation takes the policy loss alone: algo.advantage='gae' and "
                     "algo.kl_coef > 0 are not supported")

  def loss_vec(params, items, ages):
    logp, _ = token_logprobs(graphdef, params, items.tokens, items.attention_mask,
                             temperature, top_k, top_p, spec.logprob_chunk)

    def one(logp_t, item, age):
      row = jax.tree.map(lambda x: x[None], item)
      return policy_loss(logp_t[None], row, jnp.ones((1,), jnp.float32), spec,
                         age[None].astype(jnp.int32))[0]

    return jax.vmap(one)(logp, items, ages).astype(jnp.float32)

  return loss_vec


def projected_item_grads(loss_vec_fn: Callable, params, items, ages, key, k: int,
                         rows: int = 0) -> jax.Array:
  """``projected_grads`` of ``loss_vec_fn(params, items, ages)``, ``rows`` items at a time.

  Every chunk is projected on the same k directions (they depend on ``key`` and d only), so
  the result equals the one-pass value; only one chunk's linearisation residuals are live
  (memory of a forward pass over ``rows`` items). The item count is padded up to a multiple
  of ``rows`` with copies of item 0, dropped from the output.

  Args:
    loss_vec_fn: (params, items, ages) -> [m] float32 per-item losses.
    params: pytree. items: pytree of [n, ...] leaves (a ``Rollout``). ages: [n] int32.
    key: PRNG key. k: >= 1 directions. rows: >= 0 items per chunk (0 or >= n: one pass).

  Returns:
    [n, k] float32.
  """
  n = ages.shape[0]
  if not rows or rows >= n:
    return projected_grads(lambda p: loss_vec_fn(p, items, ages), params, key, k)
  pad = -n % rows
  take = jnp.concatenate([jnp.arange(n), jnp.zeros((pad,), jnp.int32)])
  chunk = lambda x: x[take].reshape((-1, rows) + x.shape[1:])
  xs = jax.tree.map(chunk, (items, ages))
  out = jax.lax.map(lambda c: projected_grads(lambda p: loss_vec_fn(p, *c), params, key, k), xs)
  return out.reshape(-1, k)[:n]


def make_noise_fn(graphdef: nnx.GraphDef, algo, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, *, num_projections: int = 128, edges=DEFAULT_EDGES,
                  center: str = "mean", jackknife: int = 8, min_count: int = 2,
                  iters: int = 3, rows: int = 0) -> Callable:
  """Builds the jitted ``noise(params, items, ages, valid, key, num_items) -> NoiseEstimate``.

  Per call: the items' policy losses (``per_item_loss_fn``), their gradients projected on
  k = ``num_projections`` Gaussian directions drawn from ``key`` (``projected_grads``; cost
  ≈ one linearised forward pass over the items plus k tangent passes), then
  ``estimate_noise``. Compiles once per item count.

  Args:
    graphdef, algo, temperature, top_k, top_p: as ``per_item_loss_fn``.
    num_projections: k >= 1 (64–256: squared norms to ≈ √(2/k) per item).
    edges, center, jackknife, min_count, iters: as ``estimate_noise`` (``center`` may not
      be ``'reference'`` here).
    rows: >= 0 items linearised at a time (``projected_item_grads``; 0 = all at once):
      memory of a forward pass over ``rows`` items instead of n.

  Returns:
    The jitted function. params: the policy's nnx.State; items: ``Rollout`` [n rows];
    ages: [n] int32 staleness (version_now − policy_version); valid: [n] bool; key: PRNG
    key; num_items: the buffer's N (scalar).

  Raises:
    ValueError: as ``per_item_loss_fn``; bad ``edges``/``center``/``num_projections``.
  """
  edges = diagnostics._check_edges(edges)
  if center not in ("mean", "fresh"):
    raise ValueError(f"center={center!r} must be 'mean' or 'fresh' here")
  if num_projections < 1:
    raise ValueError(f"num_projections={num_projections} must be >= 1")
  loss_vec = per_item_loss_fn(graphdef, algo, temperature, top_k, top_p)

  @jax.jit
  def noise(params, items, ages, valid, key, num_items):
    g = projected_item_grads(loss_vec, params, items, ages, key, num_projections, rows)
    return estimate_noise(g, ages, valid, num_items=num_items, edges=edges, center=center,
                          iters=iters, jackknife=jackknife, min_count=min_count,
                          groups=items.group_id)

  return noise


def make_buffer_noise_fn(graphdef: nnx.GraphDef, algo, temperature: float, top_k: int = 0,
                         top_p: float = 1.0, *, num_samples: int = 256, **kwargs) -> Callable:
  """``noise(params, buffer, key, version_now) -> NoiseEstimate`` on a buffer sample (jitted).

  Draws ``num_samples`` distinct valid slots uniformly (``train.drift.sample_slots``, one
  key split for the draw, one for the projection), ages = version_now − policy_version,
  N = the buffer's valid count, then ``make_noise_fn``'s estimate.

  Args:
    graphdef, algo, temperature, top_k, top_p, **kwargs: as ``make_noise_fn``.
    num_samples: S items scored (clipped to the capacity).

  Returns:
    The function; ``buffer`` is a ``replay.BufferState`` of ``Rollout`` items.
  """
  from jaxreplay.train.drift import sample_slots
  noise = make_noise_fn(graphdef, algo, temperature, top_k, top_p, **kwargs)

  @jax.jit
  def buffer_noise(params, buffer, key, version_now):
    k_draw, k_proj = jax.random.split(key)
    idx, ok = sample_slots(buffer.valid, k_draw, min(num_samples, buffer.valid.shape[0]))
    items = jax.tree.map(lambda a: a[idx], buffer.items)
    ages = jnp.maximum(version_now - buffer.policy_version[idx], 0)
    return noise(params, items, ages, ok, k_proj, buffer.valid.sum())

  return buffer_noise
