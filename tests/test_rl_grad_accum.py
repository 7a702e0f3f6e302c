"""Gradient accumulation (``algo.grad_accum_steps``): the gradient summed over 1, 2 and 3
micro-batches of unequal token counts is the whole batch's, in every aggregation mode, with a
value head (GAE whitened over the whole batch) and with a KL reference; one train step with
accumulation takes the whole batch's optimizer step; bad settings fail naming the field."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import abs_terms, forward_terms, logprob_tol, reorder_tol
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl import losses, train_step
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rl.spec import AGGREGATIONS, AlgoSpec
from jaxreplay.rollout import Rollout

B, T = 6, 7
CFG = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=8, d_ff=32)
# Completion lengths per row, one fully masked: every split below has unequal token counts.
LENGTHS = np.array([4, 1, 3, 0, 2, 4])
# Micro-batching reorders each token's forward chain (conftest.logprob_tol), then a loss or
# token mean sums the 14 loss tokens and up to 3 parts; a gradient runs the forward chain
# back as well and sums all B·T positions (conftest.reorder_tol).
N_SUM = int(LENGTHS.sum()) + 3
N_GRAD = 2 * forward_terms(CFG, T) + B * T + 3


@pytest.fixture(scope="module")
def setup():
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 1, 16)
  attn = jnp.ones((B, T), bool)
  cols = np.arange(T)[None, :]
  comp = jnp.asarray((cols >= 3) & (cols < 3 + LENGTHS[:, None]))
  logp, _ = jax.jit(token_logprobs, static_argnums=0)(graphdef, params, tokens, attn)
  # behaviour log-probs off the current policy, so ratios differ from 1 and clip
  mu = jnp.where(comp, logp + 0.3 * jax.random.normal(jax.random.key(2), (B, T)), 0.0)
  batch = Rollout(tokens=tokens, attention_mask=attn, completion_mask=comp,
                  behaviour_logprobs=mu,
                  rewards=jnp.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]),
                  advantages=jnp.array([1.0, -1.0, 0.5, -0.5, 0.7, -0.2]),
                  group_id=jnp.zeros(B, jnp.int32), policy_version=jnp.zeros(B, jnp.int32), newest_version=jnp.zeros(B, jnp.int32),
                  truncated=jnp.zeros(B, bool))
  weights = jnp.array([1.0, 0.5, 2.0, 1.0, 0.8, 1.2])
  stale = jnp.array([0, 1, 2, 0, 3, 1], jnp.int32)
  return graphdef, params, batch, weights, stale


@pytest.fixture(scope="module")
def logp_atol(setup):
  """conftest.logprob_tol of this model's logits."""
  graphdef, params, batch, _, _ = setup
  return logprob_tol(CFG, nnx.merge(graphdef, params)(batch.tokens, batch.attention_mask))


def algo_for(aggregation, n):
  # one staleness bucket keeps the compiled metrics (and the test's compile time) small
  return dict(aggregation=aggregation, horizon=5, staleness_target="weight", entropy_coef=0.01,
              staleness_buckets=(0,), grad_accum_steps=n)


@pytest.fixture(scope="module")
def grads_by_mode(setup):
  """{n: [((loss, metrics), grads) per mode in AGGREGATIONS]}, one compile per n; under
  "abs", the whole batch's [(loss, metrics)] with |term| aggregated (``abs_terms``)."""
  graphdef, params, batch, weights, stale = setup

  def all_modes(n):
    fns = [train_step.make_grad_fn(graphdef, algo_for(m, n), temperature=1.0)
           for m in AGGREGATIONS]
    return jax.jit(lambda p: [f(p, batch, weights, stale, None, None, None) for f in fns])

  out = {n: all_modes(n)(params) for n in (1, 2, 3)}
  with abs_terms():
    out["abs"] = [loss for loss, _ in all_modes(1)(params)]
  return out


def test_micro_batches_are_strided_and_merge_back():
  x = jnp.arange(12).reshape(6, 2)
  mb = train_step.micro_batches(x, 3)
  np.testing.assert_array_equal(mb[:, :, 0], [[0, 6], [2, 8], [4, 10]])
  np.testing.assert_array_equal(train_step.merge_micro_batches(mb), x)
  with pytest.raises(ValueError, match="6 rows do not split into 4 micro-batches"):
    train_step.micro_batches(x, 4)


@pytest.mark.slow
@pytest.mark.numerics
def test_accumulated_gradient_is_the_whole_batch_gradient_in_every_mode(setup, grads_by_mode,
                                                                       logp_atol):
  _, _, batch, _, _ = setup
  for n in (2, 3):
    counts = np.asarray(train_step.micro_batches(batch.completion_mask, n).sum((1, 2)))
    assert len(set(counts.tolist())) == n, counts  # unequal token counts
  for k, mode in enumerate(AGGREGATIONS):
    (loss1, m1), g1 = grads_by_mode[1][k]
    abs_loss, abs_m = grads_by_mode["abs"][k]
    flat1 = jax.tree.leaves(g1)
    g_max = max(float(jnp.abs(g).max()) for g in flat1)
    assert g_max > 1e-3, mode  # a real gradient
    for n in (2, 3):
      (loss_n, m_n), g_n = grads_by_mode[n][k]
      msg = f"{mode}, {n} micro-batches"
      # each term moves by its size × logp_atol, then N_SUM are summed: scale Σ|term|
      loss_atol = float(abs_loss) * (logp_atol + reorder_tol(N_SUM))
      np.testing.assert_allclose(loss_n, loss1, rtol=0, atol=loss_atol, err_msg=msg)
      for a, b in zip(jax.tree.leaves(g_n), flat1):
        # entries near 0 are sums of per-token terms up to about the largest entry's size
        np.testing.assert_allclose(a, b, rtol=reorder_tol(N_GRAD),
                                   atol=reorder_tol(N_GRAD, scale=g_max), err_msg=msg)
      # token means of terms within logp_atol (entropy) or that fraction (ratio, k3 ≤ its
      # ratio) of their size; a clipped fraction counts the same tokens; pg_loss as the loss
      for key in ("entropy", "ratio_mean", "clip_frac", "kl_behaviour", "tokens"):
        np.testing.assert_allclose(m_n[key], m1[key], rtol=logp_atol + reorder_tol(N_SUM),
                                   atol=logp_atol, err_msg=f"{msg}: {key}")
      pg_atol = float(abs_m["pg_loss"]) * (logp_atol + reorder_tol(N_SUM))
      np.testing.assert_allclose(m_n["pg_loss"], m1["pg_loss"], rtol=0, atol=pg_atol,
                                 err_msg=f"{msg}: pg_loss")


@pytest.mark.slow
@pytest.mark.numerics
def test_accumulated_gradient_with_value_head_and_reference(setup, logp_atol):
  graphdef, params, batch, weights, stale = setup
  algo = dict(advantage="gae", gae_whiten=True, kl_coef=0.1, kl_mode="reward",
              aggregation="seq_mean_token_mean", staleness_buckets=(0,))
  state = train_step.init_train_state(graphdef, params, optax.sgd(1.0), algo)
  # a value head and a reference that differ from the policy, so every term is live
  vp = jax.tree.map(lambda x: x + 0.1 * jnp.ones_like(x), state.value_params)
  ref_params = jax.tree.map(lambda x: x * 1.05, params)

  def grads(*ns):
    @jax.jit
    def f(trainable):
      ref, _ = token_logprobs(graphdef, ref_params, batch.tokens, batch.attention_mask)
      return [train_step.make_grad_fn(graphdef, dict(algo, grad_accum_steps=n), 1.0)(
          trainable, batch, weights, stale, None, ref, None) for n in ns]
    return f((params, vp))

  ((l1, _), g1), ((l3, _), g3) = grads(1, 3)
  with abs_terms():
    [((abs_loss, _), _)] = grads(1)
  # as in the test above, with GAE over T and whitening (mean, variance) over the 14 tokens
  n_sum = N_SUM + T + 2 * int(LENGTHS.sum())
  np.testing.assert_allclose(l3, l1, rtol=0,
                             atol=float(abs_loss) * (logp_atol + reorder_tol(n_sum)))
  assert float(jnp.abs(g1[1]["w"][...]).max()) > 1e-3  # the value head learns
  g_max = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1))
  for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g1)):
    # as in the test above, with the advantages' chain
    np.testing.assert_allclose(a, b, rtol=reorder_tol(N_GRAD + n_sum - N_SUM),
                               atol=reorder_tol(N_GRAD + n_sum - N_SUM, scale=g_max))


@pytest.mark.slow  # compiles every aggregation mode at 1, 2 and 3 micro-batches (grads_by_mode)
@pytest.mark.numerics
def test_train_step_with_accumulation_takes_the_whole_batch_step(setup, grads_by_mode,
                                                                  logp_atol):
  graphdef, params, batch, weights, stale = setup
  k = AGGREGATIONS.index("token_mean")
  (loss1, _), g1 = grads_by_mode[1][k]
  opt = optax.sgd(0.5)
  spec = AlgoSpec.from_config(algo_for("token_mean", 2))
  state = train_step.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
  state, metrics = train_step.make_train_step(graphdef, opt, spec, temperature=1.0)(
      state, batch, weights, stale)
  want = jax.tree.map(lambda p, g: p - 0.5 * g, params, g1)
  g_max = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1))
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    # p − 0.5·g: one rounding of p each, and half the gradients' difference (test above)
    np.testing.assert_allclose(a, b, rtol=reorder_tol(2),
                               atol=0.5 * reorder_tol(N_GRAD, scale=g_max))
  abs_loss = float(grads_by_mode["abs"][k][0])
  np.testing.assert_allclose(metrics["loss"], loss1, rtol=0,  # as in the first test
                             atol=abs_loss * (logp_atol + reorder_tol(N_SUM)))
  # a norm sums P same-signed squares of entries each within (N_GRAD − 1)·eps
  n_params = sum(g.size for g in jax.tree.leaves(g1))
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(g1),
                             rtol=reorder_tol(N_GRAD + n_params))
  assert int(state.step) == 1


@pytest.mark.numerics
def test_aggregate_with_the_whole_batch_normaliser_sums_to_the_aggregate():
  rng = np.random.default_rng(0)
  loss = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
  mask = jnp.asarray(np.arange(4)[None] < np.array([2, 0, 4, 1, 3])[:, None])
  for mode in AGGREGATIONS:
    whole = losses.aggregate(loss, mask, mode, horizon=3)
    norm = losses.aggregate_normaliser(mask, mode)
    parts = sum(losses.aggregate(loss[np.array(r)], mask[np.array(r)], mode, 3, norm)
                for r in ([0, 1], [2], [3, 4]))
    # 10 tokens and 3 parts, terms of both signs: scale Σ|x| over the normaliser
    abs_whole = float(losses.aggregate(jnp.abs(loss), mask, mode, horizon=3))
    np.testing.assert_allclose(parts, whole, rtol=0, atol=reorder_tol(13, scale=abs_whole),
                               err_msg=mode)


@pytest.mark.parametrize("field,value,match", [
    ("grad_accum_steps", 0, r"algo\.grad_accum_steps=0 is invalid: must be >= 1"),
    ("grad_accum_steps", 2.0, r"algo\.grad_accum_steps=2\.0 is invalid: must be an int"),
    ("logprob_chunk", -1, r"algo\.logprob_chunk=-1 is invalid: must be >= 0"),
])
def test_bad_settings_fail_naming_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    AlgoSpec.from_config({field: value})


def test_config_rejects_a_minibatch_that_does_not_split():
  from jaxreplay.config import ConfigError, load_config, validate
  cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "default.py"))
  cfg.algo.update(num_minibatches=2, grad_accum_steps=3)  # minibatch 128 rows
  with pytest.raises(ConfigError, match=r"algo\.grad_accum_steps=3 .*256 / 2"):
    validate(cfg, device_count=1)
