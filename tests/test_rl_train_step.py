"""The jitted train step on a tiny transformer: call-site compatibility, metrics,
staleness, non-finite skips, GAE value head, KL reference, decoupled epochs, and equal
parameter gradients at ratio 1."""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_terms, logprob_tol, reorder_tol
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl import train_step, value
from jaxreplay.rl.objective import objective
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout

B, T = 4, 6
CFG = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=8, d_ff=32)
# A gradient runs the forward chain there and back and sums every position
# (conftest.reorder_tol).
N_GRAD = 2 * forward_terms(CFG, T) + B * T
REQUIRED = ("loss", "grad_norm", "skipped_update", "entropy", "clip_frac", "clip_frac_low",
            "clip_frac_high", "ratio_mean", "kl_behaviour")


def default_algo():
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "default.py")
  spec = importlib.util.spec_from_file_location("_default_cfg_for_rl_tests", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config().algo


@pytest.fixture(scope="module")
def model_and_batch():
  graphdef, params = nnx.split(nnx.jit(lambda: Transformer(CFG, nnx.Rngs(0)))())
  model = nnx.merge(graphdef, params)
  tokens = jax.random.randint(jax.random.key(1), (B, T), 1, 16)
  attn = jnp.ones((B, T), bool)
  comp = jnp.zeros((B, T), bool).at[:, 3:].set(True).at[3, 5].set(False)
  logp, _ = jax.jit(token_logprobs, static_argnums=0)(graphdef, params, tokens, attn)
  batch = Rollout(tokens=tokens, attention_mask=attn, completion_mask=comp,
                  behaviour_logprobs=jnp.where(comp, logp, 0.0),
                  rewards=jnp.array([1.0, 0.0, 1.0, 0.0]),
                  advantages=jnp.array([1.0, -1.0, 0.5, -0.5]),
                  group_id=jnp.zeros(B, jnp.int32), policy_version=jnp.array([0, 0, -1, -3]), newest_version=jnp.array([0, 0, -1, -3]),
                  truncated=jnp.zeros(B, bool))
  return model, graphdef, params, batch


@pytest.fixture(scope="module")
def logp_atol(model_and_batch):
  """conftest.logprob_tol of this model's logits."""
  model, _, _, batch = model_and_batch
  return logprob_tol(CFG, model(batch.tokens, batch.attention_mask))


def fresh(params):
  return jax.tree.map(jnp.copy, params)


@pytest.mark.numerics
def test_forward_with_hidden_matches_model(model_and_batch):
  model, _, _, batch = model_and_batch
  norm = model.final_norm
  logits, hidden = value.forward_with_hidden(model, batch.tokens, batch.attention_mask)
  np.testing.assert_array_equal(logits, model(batch.tokens, batch.attention_mask))
  assert hidden.shape == (B, T, CFG.d_model) and model.final_norm is norm
  head = value.ValueHead(CFG.d_model)
  head.w[...] = jnp.arange(CFG.d_model, dtype=jnp.float32)
  v = value.token_values(head, hidden)
  w = jnp.arange(CFG.d_model, dtype=jnp.float32)
  # one dot of d_model terms in another order: scale Σ|h·w|
  np.testing.assert_allclose(v[:, 1:], hidden[:, :-1] @ w, rtol=0, atol=reorder_tol(
      CFG.d_model, scale=float((jnp.abs(hidden[:, :-1]) @ w).max())))
  assert float(jnp.abs(v[:, 0]).max()) == 0.0
  assert nnx.graphdef(value.ValueHead(3)) == value.value_graphdef()


@pytest.mark.numerics
def test_equal_parameter_gradients_at_ratio_one(model_and_batch):
  _, graphdef, params, batch = model_and_batch
  names = ("ppo_clip", "tis", "decoupled", "reinforce")
  specs = [AlgoSpec.from_config({"loss": n}) for n in names]
  zero = jnp.zeros(B, jnp.int32)

  @jax.jit
  def grads(p):
    def f(p, sp):
      logp, ent = token_logprobs(graphdef, p, batch.tokens, batch.attention_mask)
      return objective(sp, logp, ent, batch, jnp.ones(B), zero)[0]
    return [jax.grad(f)(p, sp) for sp in specs]

  gs = grads(params)
  flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in gs]
  assert np.linalg.norm(flat[0]) > 1e-3
  for name, g in zip(names[1:], flat[1:]):
    # entries near 0 are sums of per-position terms up to about the largest entry's size
    np.testing.assert_allclose(g, flat[0], rtol=reorder_tol(N_GRAD), err_msg=name,
                               atol=reorder_tol(N_GRAD, scale=float(np.abs(flat[0]).max())))


@pytest.mark.numerics
def test_train_step_default_config_metrics_staleness_and_skips(model_and_batch, logp_atol):
  _, graphdef, params, batch = model_and_batch
  algo = default_algo()
  opt = train_step.scheduled_adamw(1e-2, 0, 1.0)
  p0 = fresh(params)
  state = train_step.TrainState(params=p0, opt_state=opt.init(p0), step=jnp.int32(0),
                            skipped=jnp.int32(0))
  step = train_step.make_train_step(graphdef, opt, algo, 1.0)
  before = fresh(p0)
  state, m = step(state, batch, jnp.ones(B))
  for k in REQUIRED:
    assert k in m and m[k].shape == (), k
  assert int(state.step) == 1 and int(state.skipped) == 0 and float(m["skipped_update"]) == 0
  # fresh data: ratio 1, up to the log-probs' difference between two programs
  assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=logp_atol)
  # Staleness = step − policy_version = [0, 0, 1, 3]: completion tokens per bucket.
  assert float(m["stale/s0/tokens"]) == 6 and float(m["stale/s1/tokens"]) == 3
  assert float(m["stale/s2-3/tokens"]) == 2 and float(m["stale/s8+/tokens"]) == 0
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params, before)
  assert max(jax.tree.leaves(moved)) > 0
  # A non-finite behaviour log-prob: the update is skipped and counted.
  kept = fresh(state.params)
  bad = batch.replace(behaviour_logprobs=batch.behaviour_logprobs.at[0, 4].set(jnp.nan))
  state, m = step(state, bad, jnp.ones(B))  # same signature: no recompilation
  assert float(m["skipped_update"]) == 1.0 and int(state.skipped) == 1 and int(state.step) == 2
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.params, kept)
  assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("skip", [False, True])
def test_zero_advantage_step_moves_weights_only_by_momentum_unless_skipped(model_and_batch,
                                                                          skip):
  # An informative step, then a batch whose advantages are all zero (gradient exactly 0).
  # Adam steps along its momentum anyway: after one gradient g (clipped) at step 1, step 2
  # has m_hat = 0.9 * 0.1 g / (1 - 0.9^2) = 0.4737 g and v_hat = 0.999 * 0.001 g^2 /
  # (1 - 0.999^2) = 0.49975 g^2, so every coordinate whose g is well above Adam's eps moves
  # by 0.4737 / sqrt(0.49975) = 0.6701 lr. skip_zero_gradient keeps the weights and the
  # optimizer state as they were.
  _, graphdef, params, batch = model_and_batch
  algo = dict(default_algo(), skip_zero_gradient=skip)
  lr = 1e-2
  opt = train_step.scheduled_adamw(lr, 0, 1.0)
  p0 = fresh(params)
  state = train_step.TrainState(params=p0, opt_state=opt.init(p0), step=jnp.int32(0),
                                skipped=jnp.int32(0))
  step = train_step.make_train_step(graphdef, opt, algo, 1.0)
  state, m = step(state, batch, jnp.ones(B))
  assert float(m["grad_norm"]) > 0 and float(m["zero_gradient_skipped"]) == 0.0
  after_one = fresh(state.params)
  opt_one = jax.tree.map(jnp.copy, state.opt_state)
  state, m = step(state, batch.replace(advantages=jnp.zeros(B)), jnp.ones(B))
  assert float(m["grad_norm"]) == 0.0 and float(m["skipped_update"]) == 0.0
  assert int(state.step) == 2 and int(state.skipped) == 0
  assert float(m["zero_gradient_skipped"]) == float(skip)
  moved = max(float(jnp.abs(a - b).max())
              for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(after_one)))
  if skip:
    assert moved == 0.0
    assert all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_one)))
  else:
    assert moved == pytest.approx(0.6701 * lr, rel=1e-3)


def test_drop_zero_advantage_leaves_rows_out_and_changes_only_the_normaliser(model_and_batch):
  # Rows 1 and 3 have advantage 0: their PPO-clip gradient is 0, so leaving them out of the
  # learner changes the token-mean normaliser alone, from 11 completion tokens (3 + 3 + 3 +
  # 2) to 6 (rows 0 and 2): loss and gradient norm scale by 11 / 6, and the packed plan
  # holds rows 0 and 2 alone (2 x 6 attended tokens against 4 x 6).
  _, graphdef, params, batch = model_and_batch
  batch = batch.replace(advantages=jnp.array([1.0, 0.0, 0.5, 0.0]))
  opt = train_step.scheduled_adamw(1e-2, 0, 1.0)
  out = {}
  for drop in (False, True):
    step = train_step.make_train_step(graphdef, opt, dict(default_algo(),
                                                          drop_zero_advantage=drop), 1.0)
    p0 = fresh(params)
    state = train_step.TrainState(params=p0, opt_state=opt.init(p0), step=jnp.int32(0),
                                  skipped=jnp.int32(0))
    plan = step.plan_batch(np.asarray(batch.attention_mask),
                           advantages=np.asarray(batch.advantages))
    _, m = step(state, batch, jnp.ones(B), plan=plan)
    out[drop] = (float(m["loss"]), float(m["grad_norm"]), int((plan.segment_ids > 0).sum()),
                 float(m.get("dropped_zero_advantage", -1.0)))
  (loss, gnorm, packed, _), (loss_d, gnorm_d, packed_d, dropped) = out[False], out[True]
  assert (packed, packed_d, dropped) == (4 * T, 2 * T, 0.5)
  assert loss_d == pytest.approx(loss * 11 / 6, rel=1e-5)
  assert gnorm_d == pytest.approx(gnorm * 11 / 6, rel=1e-4)
  # every advantage 0: one row keeps the plan's shapes; nothing moves, nothing is NaN
  step = train_step.make_train_step(
      graphdef, opt, dict(default_algo(), drop_zero_advantage=True, skip_zero_gradient=True),
      1.0)
  p0 = fresh(params)
  state = train_step.TrainState(params=p0, opt_state=opt.init(p0), step=jnp.int32(0),
                                skipped=jnp.int32(0))
  zero = batch.replace(advantages=jnp.zeros(B))
  state, m = step(state, zero, jnp.ones(B))
  assert (float(m["loss"]), float(m["grad_norm"]), float(m["dropped_zero_advantage"]),
          float(m["zero_gradient_skipped"])) == (0.0, 0.0, 1.0, 1.0)
  assert all(bool(jnp.array_equal(a, b)) for a, b in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))


@pytest.mark.parametrize("field,value,why", [
    ("kl_coef", 0.1, "algo.kl_coef > 0 with algo.kl_mode='loss'"),
    ("entropy_coef", 0.01, "algo.entropy_coef > 0"),
    ("advantage", "gae", "algo.advantage='gae'"),
])
def test_drop_zero_advantage_refuses_a_loss_with_zero_advantage_gradients(field, value, why):
  from jaxreplay.spec import ConfigError
  with pytest.raises(ConfigError, match=r"algo\.drop_zero_advantage=True.*" + re.escape(why)):
    AlgoSpec.from_config({"drop_zero_advantage": True, field: value})


def test_gae_kl_decoupled_epochs(model_and_batch):
  _, graphdef, params, batch = model_and_batch
  algo = dict(advantage="gae", loss="decoupled", kl_coef=0.05, kl_estimator="k3",
              update_epochs=2, num_minibatches=2, gae_gamma=1.0, gae_lambda=0.9, vf_coef=0.5)
  opt = train_step.scheduled_adamw(3e-2, 0, 1.0)
  state = train_step.init_train_state(graphdef, fresh(params), opt, algo)
  assert state.value_params is not None and state.ref_params is not None
  ref0 = fresh(state.ref_params)
  step = train_step.make_train_step(graphdef, opt, algo, 1.0)
  state, m = step(state, batch, jnp.ones(B))
  assert np.isfinite(float(m["loss"])) and float(m["skipped_update"]) == 0
  assert float(jnp.abs(state.value_params["w"][...]).max()) > 0  # the critic learned
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.ref_params, ref0)
  assert all(jax.tree.leaves(same))  # the reference is frozen
  for k in ("value_loss", "kl_ref", "return_mean"):
    assert k in m
  # π_prox is the policy at the start of the learner step: the first minibatch update
  # sees ratio π/π_prox = 1 exactly, later ones do not.
  assert float(m["ratio_min"]) < 1.0 or float(m["ratio_max"]) > 1.0


def test_missing_reference_or_value_head_raises(model_and_batch):
  _, graphdef, params, batch = model_and_batch
  opt = train_step.scheduled_adamw(1e-3, 0, 1.0)
  plain = train_step.TrainState(params=params, opt_state=opt.init(params), step=jnp.int32(0),
                            skipped=jnp.int32(0))
  make = lambda algo: train_step.make_train_step(graphdef, opt, algo, 1.0)
  with pytest.raises(ValueError, match="ref_params"):
    make({"kl_coef": 0.1})(plain, batch, jnp.ones(B))
  with pytest.raises(ValueError, match="value_params"):
    make({"advantage": "gae"})(plain, batch, jnp.ones(B))
  with pytest.raises(ValueError, match="num_minibatches"):
    make({"num_minibatches": 3})(plain, batch, jnp.ones(B))
  with pytest.raises(ValueError, match=r"algo\.loss='ppo2'"):
    make({"loss": "ppo2"})


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation,epochs", [("token_mean", 1), ("seq_mean_token_mean", 2)])
def test_loss_metric_is_the_whole_batch_loss_over_minibatches(model_and_batch, logp_atol,
                                                              aggregation, epochs):
  """``loss`` and ``pg_loss`` with two minibatches of 1 and 6 loss tokens equal the loss of
  the whole batch under the configured aggregation (not the plain mean of the two).

  A learning rate of 0 evaluates both minibatches at the same parameters, and behaviour
  log-probs equal to the current ones give ratio 1, so ppo_clip's token loss is −A.
  Rows: 0 has 1 token (A = 1), 1 has none, 2 and 3 have 3 each (A = −0.5, 0.2).
    token_mean: minibatches −1 (1 token) and 0.15 (6 tokens); whole batch −0.1/7
      (the plain mean would be −0.425).
    seq_mean_token_mean: −1 (1 row) and mean(0.5, −0.2) = 0.15 (2 rows); whole batch
      (−1 + 0.5 − 0.2)/3 = −0.7/3.
  """
  import optax
  _, graphdef, params, batch = model_and_batch
  comp = np.zeros((B, T), bool)
  comp[0, 5] = True
  comp[2:, 3:] = True
  logp, _ = jax.jit(token_logprobs, static_argnums=0)(graphdef, params, batch.tokens,
                                                            batch.attention_mask)
  batch = batch.replace(completion_mask=jnp.asarray(comp),
                        behaviour_logprobs=jnp.where(comp, logp, 0.0),
                        advantages=jnp.array([1.0, 0.3, -0.5, 0.2]),
                        policy_version=jnp.zeros(B, jnp.int32))
  opt = optax.sgd(0.0)
  got = {}
  for nm in (1, 2):
    algo = dict(aggregation=aggregation, num_minibatches=nm, update_epochs=epochs)
    step = train_step.make_train_step(graphdef, opt, algo, 1.0)
    p = fresh(params)
    state = train_step.TrainState(params=p, opt_state=opt.init(p), step=jnp.int32(0),
                              skipped=jnp.int32(0))
    _, got[nm] = step(state, batch, jnp.ones(B))
  want = {"token_mean": -0.1 / 7, "seq_mean_token_mean": -0.7 / 3}[aggregation]
  # Σ|A·r| over the normaliser; each r moves by logp_atol, then 7 tokens and 2 parts sum
  terms = {"token_mean": 3.1 / 7, "seq_mean_token_mean": 1.7 / 3}[aggregation]
  tol = terms * (logp_atol + reorder_tol(7 + 2))
  for key in ("loss", "pg_loss"):
    assert float(got[1][key]) == pytest.approx(want, rel=0, abs=tol), key
    assert float(got[2][key]) == pytest.approx(float(got[1][key]), rel=0, abs=tol), key
  assert float(got[2]["tokens"]) == float(got[1]["tokens"]) == 7.0


@pytest.mark.slow
@pytest.mark.numerics
def test_per_token_metrics_are_the_whole_batch_statistic_over_minibatches(model_and_batch,
                                                                          logp_atol):
  """With two minibatches of 1 and 6 loss tokens (lr 0: both see the same parameters),
  the token means ``value_loss``, ``value_mean``, ``return_mean``, ``kl_ref``,
  ``ratio_masked_frac`` (and ``entropy``) equal their value over the whole batch, as does
  the per-sequence ``ess_sample_weights``; the plain mean of the two minibatches' values
  differs from it for each (checked on the halves run as batches of their own).

  Row 0 (1 token) has μ = π − 1, so ratio e ∉ [1/2, 2] masks it: ratio_masked_frac is 1/7
  over the batch, 1 and 0 on the halves. The reference and the critic differ from the
  policy's initialisation, so kl_ref, value_mean, return_mean and value_loss are not 0.
  Weights [1, 0.5, 2, 1]: ESS 0.81 over the batch, 0.9 on each half.
  """
  import optax
  _, graphdef, params, batch = model_and_batch
  comp = np.zeros((B, T), bool)
  comp[0, 5] = True
  comp[2:, 3:] = True
  logp, _ = jax.jit(token_logprobs, static_argnums=0)(graphdef, params, batch.tokens,
                                                     batch.attention_mask)
  shift = np.zeros((B, T), np.float32)
  shift[0] = 1.0
  batch = batch.replace(completion_mask=jnp.asarray(comp),
                        behaviour_logprobs=jnp.where(comp, logp - shift, 0.0),
                        rewards=jnp.array([1.0, 0.0, 0.3, -0.6]),
                        policy_version=jnp.zeros(B, jnp.int32))
  weights = jnp.array([1.0, 0.5, 2.0, 1.0])
  ref = nnx.split(nnx.jit(lambda: Transformer(CFG, nnx.Rngs(7)))())[1]
  head = value.init_value_params(CFG.d_model)
  head["w"][...] = jax.random.normal(jax.random.key(3), (CFG.d_model,))
  head["b"][...] = jnp.float32(0.4)
  opt = optax.sgd(0.0)

  def run(nm, rows):
    algo = dict(advantage="gae", kl_coef=0.1, ratio_mask_c=2.0, gae_whiten=False,
                num_minibatches=nm, update_epochs=nm)
    state = train_step.init_train_state(graphdef, fresh(params), opt, algo)
    state = state.replace(ref_params=fresh(ref), value_params=fresh(head))
    state = state.replace(opt_state=opt.init((state.params, state.value_params)))
    sub = jax.tree.map(lambda x: x[rows], batch)
    return train_step.make_train_step(graphdef, opt, algo, 1.0)(state, sub, weights[rows])[1]

  whole, split = run(1, slice(None)), run(2, slice(None))
  halves = [run(1, slice(0, 2)), run(1, slice(2, 4))]
  assert [float(h["tokens"]) for h in halves] == [1.0, 6.0]
  assert float(whole["ratio_masked_frac"]) == pytest.approx(1 / 7, abs=1e-6)
  assert float(whole["ess_sample_weights"]) == pytest.approx(0.81, abs=1e-6)
  for key in ("value_loss", "value_mean", "return_mean", "kl_ref", "ratio_masked_frac",
              "entropy", "ess_sample_weights"):
    want = float(whole[key])
    plain = (float(halves[0][key]) + float(halves[1][key])) / 2
    assert abs(plain - want) > 1e-3, key  # the plain mean is a different number
    # each token's term within logp_atol (the forward chain), then 7 tokens and 2 parts sum
    assert float(split[key]) == pytest.approx(want, rel=reorder_tol(7 + 2), abs=logp_atol), key


def test_make_optimizer_reads_the_algo_section():
  """``make_optimizer(algo, train.steps)`` is ``scheduled_adamw`` with the ``algo`` fields; the
  cosine schedule spans steps × update_epochs × num_minibatches optimizer steps, and with
  no learner steps planned the schedule is warmup-then-constant."""
  import optax
  algo = dict(lr=1e-2, warmup_steps=2, lr_schedule="cosine", final_lr_fraction=0.1,
              max_grad_norm=0.5, weight_decay=0.01, update_epochs=2, num_minibatches=2)
  x = {"w": jnp.array([1.0, -2.0, 3.0])}

  def run(opt):
    state, p, out = opt.init(x), x, []
    for i in range(8):
      u, state = opt.update(jax.tree.map(lambda a: a * (i + 1), p), state, p)
      p = optax.apply_updates(p, u)
      out.append(np.asarray(p["w"]))
    return np.stack(out)

  flat = dict(weight_decay=0.01, final_lr_fraction=0.1)
  cosine = run(train_step.scheduled_adamw(1e-2, 2, 0.5, schedule="cosine", total_steps=12, **flat))
  np.testing.assert_array_equal(run(train_step.make_optimizer(algo, 3)), cosine)
  np.testing.assert_array_equal(run(train_step.make_optimizer(AlgoSpec(**algo), 0)),
                                run(train_step.scheduled_adamw(1e-2, 2, 0.5, **flat)))
  assert not np.array_equal(run(train_step.make_optimizer(algo, 4)), cosine)
  with pytest.raises(ValueError, match=r"algo\.lr_schedule='cosine'.*algo\.warmup_steps=2"):
    train_step.make_optimizer(dict(algo, update_epochs=1, num_minibatches=1), 2)
  with pytest.raises(ValueError, match=r"schedule='linear' is not one of"):
    train_step.scheduled_adamw(1e-2, 0, 1.0, schedule="linear")


def test_one_extreme_token_does_not_cost_the_batch(model_and_batch):
  """A behaviour log-prob 100 nats below the current one on one token: before the bound,
  exp overflowed, the gradient was NaN and the whole update was skipped. Now the update is
  applied, and equals the update with that token's log-ratio at 25 (also past the ±20
  bound: the same finite term, no gradient through it)."""
  _, graphdef, params, batch = model_and_batch
  algo = default_algo()
  opt = train_step.scheduled_adamw(1e-2, 0, 1.0)
  step = train_step.make_train_step(graphdef, opt, algo, 1.0)
  results = []
  for gap in (100.0, 25.0):  # row 1 has A = −1: PPO does not clip a large ratio there
    b = batch.replace(behaviour_logprobs=batch.behaviour_logprobs.at[1, 4].add(-gap))
    p0 = fresh(params)
    state = train_step.TrainState(params=p0, opt_state=opt.init(p0), step=jnp.int32(0),
                                  skipped=jnp.int32(0))
    state, m = step(state, b, jnp.ones(B))
    assert float(m["skipped_update"]) == 0.0 and int(state.skipped) == 0, gap
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"])), gap
    results.append((float(m["loss"]), float(m["grad_norm"]), state.params))
  (l100, g100, p100), (l25, g25, p25) = results
  assert l100 == l25 and g100 == g25 and g100 > 0
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), p100, p25)
  assert all(jax.tree.leaves(same))
