"""Drift monitor: per-bucket k3 KL, importance-weight ESS and reward against NumPy, and one
compile for repeated calls on the buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import logprob_tol
from jaxreplay import replay
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rollout import empty_rollout
from jaxreplay.train.drift import drift_stats, make_drift_fn, sample_slots

EDGES = (0, 1, 2, 4)


def _numpy_stats(logp, mu, mask, reward, stale, valid):
  def block(rows):
    m = mask & rows[:, None]
    x = np.where(m, logp - mu, 0.0)
    w_seq = np.exp(x.sum(-1))[rows]
    w_tok = np.exp(x)[m]
    n = rows.sum()
    ess = lambda w: (w.sum() ** 2 / (len(w) * (w ** 2).sum())) if len(w) else 0.0
    return {"kl": (np.expm1(x) - x)[m].mean() if m.any() else 0.0, "ess_seq": ess(w_seq),
            "ess_token": ess(w_tok), "reward": reward[rows].mean() if n else 0.0, "count": n}
  out = {f"drift/{k}": v for k, v in block(valid).items()}
  for name, lo, hi in (("s0", 0, 1), ("s1", 1, 2), ("s2-3", 2, 4), ("s4+", 4, 10**9)):
    out.update({f"drift/{name}/{k}": v
                for k, v in block(valid & (stale >= lo) & (stale < hi)).items()})
  return out


@pytest.mark.parametrize("jit", [False, True])
def test_drift_stats_match_numpy(jit):
  rng = np.random.default_rng(0)
  s, t = 12, 5
  logp = rng.normal(-1.0, 0.3, (s, t)).astype(np.float32)
  mu = rng.normal(-1.0, 0.3, (s, t)).astype(np.float32)
  mask = rng.random((s, t)) < 0.7
  reward = rng.choice([0.0, 1.0], s).astype(np.float32)
  stale = np.array([0, 0, 1, 2, 3, 3, 5, 9, 0, 1, 2, 7], np.int32)  # no row in some buckets
  valid = np.ones(s, bool)
  valid[[1, 3]] = False  # rows beyond the buffer's size must not count
  fn = jax.jit(drift_stats, static_argnames="edges") if jit else drift_stats
  got = fn(jnp.asarray(logp), jnp.asarray(mu), jnp.asarray(mask), jnp.asarray(reward),
           jnp.asarray(stale), jnp.asarray(valid), edges=EDGES)
  want = _numpy_stats(logp.astype(np.float64), mu, mask, reward, stale, valid)
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
  assert want["drift/count"] == 10 and want["drift/s1/count"] == 2
  assert 0 < want["drift/kl"] and 0 < want["drift/ess_seq"] < 1
  # identical policies: KL 0, every ESS 1
  same = drift_stats(jnp.asarray(mu), jnp.asarray(mu), jnp.asarray(mask), jnp.asarray(reward),
                     jnp.asarray(stale), jnp.asarray(valid), EDGES)
  assert float(same["drift/kl"]) == 0.0 and float(same["drift/ess_seq"]) == pytest.approx(1.0)


def test_sample_slots_never_picks_invalid_and_marks_the_short_fall():
  valid = jnp.array([True, False, True, True, False, False])
  idx, ok = sample_slots(valid, jax.random.key(0), 4)
  assert len(set(np.asarray(idx).tolist())) == 4
  np.testing.assert_array_equal(np.asarray(ok), np.asarray(valid)[np.asarray(idx)])
  assert sorted(np.asarray(idx)[np.asarray(ok)].tolist()) == [0, 2, 3]


@pytest.mark.slow
@pytest.mark.numerics
def test_drift_fn_on_a_buffer_matches_numpy_and_compiles_once():
  cfg = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(1)
  n, t = 6, 5
  toks = jnp.asarray(rng.integers(3, 16, (n, t)), jnp.int32)
  comp = jnp.asarray(np.arange(t)[None] >= 2).repeat(n, 0)
  mu = jnp.where(comp, jnp.asarray(rng.normal(-2.5, 0.2, (n, t)), jnp.float32), 0.0)
  r = empty_rollout(n, t).replace(tokens=toks, attention_mask=jnp.ones((n, t), bool),
                                  completion_mask=comp, behaviour_logprobs=mu,
                                  rewards=jnp.asarray(rng.random(n), jnp.float32))
  buf = replay.add(replay.init(empty_rollout(1, t), 8), r, jnp.array([0, 0, 1, 1, 2, 3]), 0)
  drift = make_drift_fn(graphdef, 1.0, 8, EDGES)
  got = drift(params, buf, jax.random.key(3), jnp.int32(3))
  logp, _ = token_logprobs(graphdef, params, toks, jnp.ones((n, t), bool), 1.0)
  stale = 3 - np.array([0, 0, 1, 1, 2, 3])
  want = _numpy_stats(np.asarray(logp, np.float64), np.asarray(mu), np.asarray(comp),
                      np.asarray(r.rewards), stale, np.ones(n, bool))
  # The drift fn scores the sampled slots, another batch than token_logprobs': each log-ratio
  # x moves by δ = conftest.logprob_tol, so k3(x) by |e^x − 1|·δ; a sequence weight exp(Σx)
  # over 3 tokens by 3δ relatively, and the ESS, a ratio of its squares, by 12δ.
  delta = logprob_tol(cfg, nnx.merge(graphdef, params)(toks, jnp.ones((n, t), bool)))
  x = (np.asarray(logp) - np.asarray(mu))[np.asarray(comp)]
  k3_atol = delta * float(np.abs(np.expm1(x)).max())
  for k, v in want.items():  # all 6 valid items are scored (S = C = 8 covers them)
    np.testing.assert_allclose(float(got[k]), v, rtol=12 * delta, atol=k3_atol, err_msg=k)
  drift(params, buf, jax.random.key(4), jnp.int32(4))
  assert drift._cache_size() == 1
