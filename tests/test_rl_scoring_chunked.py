"""Chunked log-probs over the vocabulary (``algo.logprob_chunk``): the values of a NumPy
reference and of the unchunked path (with and without top-k/top-p), the same gradients, the
value head's path, and a program that never holds [B, T, V] at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_terms, logprob_tol, reorder_tol
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl import scoring, value

B, T, V = 3, 9, 64
CFG = TransformerConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=8, d_ff=32, tie_embeddings=False)
# Chunking reorders the forward chain (conftest.reorder_tol); a gradient runs it back too and
# sums every position.
N_FWD = forward_terms(CFG, T)
N_GRAD = 2 * N_FWD + B * T


@pytest.fixture(scope="module")
def policy():
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
  mask = jnp.ones((B, T), bool).at[0, :2].set(False)  # a left-padded row
  return graphdef, params, tokens, mask


@pytest.fixture(scope="module")
def logp_atol(policy):
  """conftest.logprob_tol of this model's logits."""
  graphdef, params, tokens, mask = policy
  return logprob_tol(CFG, nnx.merge(graphdef, params)(tokens, mask))


def numpy_scores(logits, tokens, temperature):
  """log_softmax(logits / T) of the next token and its entropy, float64, column 0 = 0."""
  z = np.asarray(logits, np.float64)[:, :-1] / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  nxt = np.asarray(tokens)[:, 1:]
  logp = np.take_along_axis(logp_all, nxt[..., None], -1)[..., 0]
  ent = -(np.exp(logp_all) * logp_all).sum(-1)
  pad = np.zeros((tokens.shape[0], 1))
  return np.concatenate([pad, logp], 1), np.concatenate([pad, ent], 1)


@pytest.mark.numerics
@pytest.mark.parametrize("chunk", [1, 3, 20])  # one position, padding, longer than T
def test_chunked_log_probs_match_numpy(policy, logp_atol, chunk):
  graphdef, params, tokens, mask = policy
  logits = nnx.merge(graphdef, params)(tokens, mask)
  want_logp, want_ent = numpy_scores(logits, tokens, 0.7)
  logp, ent = jax.jit(scoring.token_logprobs, static_argnums=(0, 4, 5, 6, 7))(
      graphdef, params, tokens, mask, 0.7, 0, 1.0, chunk)
  assert logp.shape == ent.shape == (B, T) and logp.dtype == jnp.float32
  # the jitted forward; temperature 0.7 scales the logits' rounding by 1/0.7
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=logp_atol / 0.7)
  np.testing.assert_allclose(ent, want_ent, rtol=0, atol=logp_atol / 0.7)


@pytest.mark.numerics
def test_chunked_equals_unchunked_with_truncation_and_in_gradients(policy, logp_atol):
  graphdef, params, tokens, mask = policy
  weights_bt = jax.random.normal(jax.random.key(3), (B, T))

  def f(p, chunk):
    logp, ent = scoring.token_logprobs(graphdef, p, tokens, mask, 1.0, 5, 0.9, chunk)
    return jnp.sum(weights_bt * logp) + 0.1 * jnp.sum(ent), (logp, ent)

  (l0, (logp0, ent0)), g0 = jax.jit(jax.value_and_grad(lambda p: f(p, 0), has_aux=True))(params)
  (l4, (logp4, ent4)), g4 = jax.jit(jax.value_and_grad(lambda p: f(p, 4), has_aux=True))(params)
  np.testing.assert_allclose(logp4, logp0, rtol=0, atol=logp_atol)
  np.testing.assert_allclose(ent4, ent0, rtol=0, atol=logp_atol)
  assert float(logp0.min()) == scoring.LOGP_FLOOR  # truncation is live
  # each log-prob and entropy within logp_atol, then B·T terms of both signs summed
  terms = float(jnp.sum(jnp.abs(weights_bt * logp0)) + 0.1 * jnp.sum(ent0))
  l_atol = (float(jnp.sum(jnp.abs(weights_bt))) + 0.1 * B * T) * logp_atol + reorder_tol(
      B * T, scale=terms)
  np.testing.assert_allclose(l4, l0, rtol=0, atol=l_atol)
  g_max = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
  for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g0)):
    # entries near 0 are sums of per-position terms up to about the largest entry's size
    np.testing.assert_allclose(a, b, rtol=reorder_tol(N_GRAD),
                               atol=reorder_tol(N_GRAD, scale=g_max))


@pytest.mark.numerics
def test_chunked_policy_and_values_match(policy, logp_atol):
  graphdef, params, tokens, mask = policy
  head = value.ValueHead(CFG.d_model)
  head.w[...] = jnp.linspace(-1, 1, CFG.d_model)
  vp = nnx.state(head)
  out0 = scoring.policy_and_values(graphdef, params, vp, tokens, mask, 1.0)
  out3 = scoring.policy_and_values(graphdef, params, vp, tokens, mask, 1.0, chunk=3)
  logp3, ent3, values3 = out3
  logp0, ent0, values0 = out0
  np.testing.assert_allclose(logp3, logp0, rtol=0, atol=logp_atol)
  np.testing.assert_allclose(ent3, ent0, rtol=0, atol=logp_atol)
  # the chain to the final norm, then the head's d_model terms of size ≤ |w| = 1
  np.testing.assert_allclose(values3, values0, rtol=0, atol=reorder_tol(N_FWD, scale=CFG.d_model))


def _avals(jaxpr):
  """Every output aval of ``jaxpr``'s equations, sub-jaxprs (scan, remat, cond) included."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield v.aval
    stack = list(eqn.params.values())
    while stack:
      p = stack.pop()
      if isinstance(p, (list, tuple)):
        stack.extend(p)
      elif hasattr(p, "eqns"):
        yield from _avals(p)
      elif hasattr(getattr(p, "jaxpr", None), "eqns"):
        yield from _avals(p.jaxpr)


def test_the_chunked_gradient_never_holds_the_whole_logits(policy):
  graphdef, params, tokens, mask = policy

  def biggest(chunk):
    loss = lambda p: scoring.token_logprobs(graphdef, p, tokens, mask, 1.0, 0, 1.0, chunk)[0].sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    # vocabulary-wide activations: rank >= 3 with a trailing V (parameters are rank 2)
    return max(int(np.prod(a.shape)) for a in _avals(jaxpr)
               if len(getattr(a, "shape", ())) >= 3 and a.shape[-1] == V)

  assert biggest(0) >= B * (T - 1) * V
  assert biggest(2) == B * 2 * V


def test_chunk_must_be_positive():
  with pytest.raises(ValueError, match="chunk=0 must be > 0"):
    scoring.chunked_scores(None, jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32), 0)


@pytest.mark.numerics
@pytest.mark.parametrize("rows", [1, 2])  # one row at a time; 2 rows of B = 3: padded
def test_scoring_by_rows_equals_the_whole_batch(policy, logp_atol, rows):
  graphdef, params, tokens, mask = policy
  want = scoring.token_logprobs(graphdef, params, tokens, mask, 0.7, 0, 1.0, 4)
  got = jax.jit(scoring.token_logprobs_by_rows, static_argnums=(0, 4, 5, 6, 7, 8))(
      graphdef, params, tokens, mask, 0.7, 0, 1.0, 4, rows)
  for g, w in zip(got, want):
    assert g.shape == (B, T)
    np.testing.assert_allclose(g, w, rtol=0, atol=logp_atol / 0.7)  # other shapes; T = 0.7


def test_micro_batch_rows_follow_the_learners_split():
  assert scoring.micro_batch_rows(64, {"num_minibatches": 1, "grad_accum_steps": 4}) == 16
  assert scoring.micro_batch_rows(64, {"num_minibatches": 2, "grad_accum_steps": 4}) == 8
  assert scoring.micro_batch_rows(64, {"num_minibatches": 2, "grad_accum_steps": 1}) == 0
