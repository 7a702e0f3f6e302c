"""Policy losses, KL estimators, entropy and aggregation against hand/numpy values.

The shared 2 × 4 example (float32):
  logp = [[-1.0, -0.5, -2.0, -1.5], [-0.3, -1.2, -0.8, -9.0]]
  mu   = [[-1.1, -0.9, -1.8, +1.0], [-0.3, -1.0, +1.0, +1.0]]   (+1.0: sentinels off-mask)
  mask = [[1, 1, 1, 0], [1, 1, 0, 0]],  A = [0.8, -1.2]
so the on-mask ratios are r = [[e^0.1, e^0.4, e^-0.2], [1, e^-0.2]]
                            = [[1.1052, 1.4918, 0.8187], [1.0, 0.8187]].
With ε_low = 0.1, ε_high = 0.3 the token (0, 1) is clipped from above (A > 0, r > 1.3)
and the token (1, 1) from below (A < 0, r < 0.9); both lose their gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxreplay.rl import losses
from jaxreplay.rl.losses import LossParams

LOGP = np.array([[-1.0, -0.5, -2.0, -1.5], [-0.3, -1.2, -0.8, -9.0]], np.float32)
MU = np.array([[-1.1, -0.9, -1.8, 1.0], [-0.3, -1.0, 1.0, 1.0]], np.float32)
PROX = np.array([[-1.05, -0.6, -1.9, 0.0], [-0.4, -1.1, 0.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
ADV = np.array([0.8, -1.2], np.float32)
REWARDS = np.array([1.0, 0.0], np.float32)
BASELINE = np.array([0.5, 0.5], np.float32)
EL, EH, CAP = 0.1, 0.3, 1.2
N_TOK = MASK.sum()  # 5
CLIP = LossParams(eps_low=EL, eps_high=EH)
TRUNC = LossParams(cap=CAP)
DEC = LossParams(eps_low=EL, eps_high=EH, cap=CAP, prox_logp_bt=PROX)
ASYM = LossParams(delta_v=-0.1, rewards_b=REWARDS)  # adv = r − V̂ below

VARIANTS = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


# --- plain-numpy references: (per-token loss, d loss_t / d logp_t) ---------------------


def np_ppo(logp, mu, adv, el, eh):
  r = np.exp(logp - mu)
  a = np.broadcast_to(adv[:, None], r.shape)
  active = ((a > 0) & (r > 1 + eh)) | ((a < 0) & (r < 1 - el))  # the clipped branch is min
  loss = np.where(active, -np.clip(r, 1 - el, 1 + eh) * a, -r * a)
  return loss, np.where(active, 0.0, -r * a)


def np_tis(logp, mu, adv, cap):
  w = np.minimum(np.exp(logp - mu), cap)
  return -w * adv[:, None] * logp, -w * adv[:, None] * np.ones_like(logp)


def np_decoupled(logp, mu, prox, adv, el, eh, cap):
  w = np.minimum(np.exp(prox - mu), cap)
  loss, grad = np_ppo(logp, prox, adv, el, eh)
  return w * loss, w * grad


def np_reinforce(logp, adv):
  return -adv[:, None] * logp, -adv[:, None] * np.ones_like(logp)


def np_asymre(logp, rewards, baseline, dv):
  c = (rewards - (baseline + dv))[:, None]
  return -c * logp, -c * np.ones_like(logp)


CASES = {
    "ppo_clip": (lambda lp: losses.ppo_clip_loss(lp, MU, ADV, MASK, CLIP)[0],
                 lambda: np_ppo(LOGP, MU, ADV, EL, EH)),
    "tis": (lambda lp: losses.tis_loss(lp, MU, ADV, MASK, TRUNC)[0],
            lambda: np_tis(LOGP, MU, ADV, CAP)),
    "decoupled": (lambda lp: losses.decoupled_loss(lp, MU, ADV, MASK, DEC)[0],
                  lambda: np_decoupled(LOGP, MU, PROX, ADV, EL, EH, CAP)),
    "reinforce": (lambda lp: losses.reinforce_loss(lp, MU, ADV, MASK)[0],
                  lambda: np_reinforce(LOGP, ADV)),
    "asymre": (lambda lp: losses.asymre_loss(lp, MU, REWARDS - BASELINE, MASK, ASYM)[0],
               lambda: np_asymre(LOGP, REWARDS, BASELINE, -0.1)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_token_loss_and_gradient_match_numpy(name, variant):
  fn, ref = CASES[name]
  np_loss, np_grad = ref()
  total = lambda lp: losses.aggregate(fn(lp), MASK, "token_mean")
  value, grad = variant(jax.value_and_grad(total))(jnp.asarray(LOGP))
  np.testing.assert_allclose(value, np.where(MASK, np_loss, 0).sum() / N_TOK, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad, np.where(MASK, np_grad, 0) / N_TOK, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", losses.LOSSES)
def test_one_contract_for_every_policy_loss(name, variant):
  """Every policy loss takes (logp, μ, adv, mask, LossParams) and returns
  (loss [B, T] float32, LossInfo of [B, T] arrays); the table holds exactly ``LOSSES``."""
  assert tuple(losses.POLICY_LOSSES) == losses.LOSSES
  params = LossParams(eps_low=EL, eps_high=EH, cap=CAP, delta_v=-0.1, prox_logp_bt=PROX,
                      rewards_b=REWARDS)
  loss, info = variant(losses.POLICY_LOSSES[name])(jnp.asarray(LOGP), MU, ADV, MASK, params)
  assert loss.shape == LOGP.shape and loss.dtype == jnp.float32
  assert isinstance(info, losses.LossInfo)
  assert info.ratio.shape == LOGP.shape and info.ratio.dtype == jnp.float32
  for flag in (info.clipped_low, info.clipped_high):
    assert flag.shape == LOGP.shape and flag.dtype == jnp.bool_


def test_asymre_needs_rewards():
  with pytest.raises(ValueError, match=r"asymre_loss needs params\.rewards_b"):
    losses.asymre_loss(jnp.asarray(LOGP), MU, ADV, MASK, LossParams())


def test_ppo_clip_hand_values_and_flags():
  loss, info = losses.ppo_clip_loss(jnp.asarray(LOGP), MU, ADV, MASK, CLIP)
  e = np.exp
  # Hand: row 0 (A = 0.8): −r·A, except token 1 clipped at 1.3; row 1 (A = −1.2): token 0
  # r = 1 → +1.2, token 1 r = e^-0.2 < 0.9 → −0.9·(−1.2) = 1.08.
  np.testing.assert_allclose(loss[0, :3], [-e(0.1) * 0.8, -1.3 * 0.8, -e(-0.2) * 0.8], rtol=1e-6)
  np.testing.assert_allclose(loss[1, :2], [1.2, 1.08], rtol=1e-6)
  assert np.argwhere(np.asarray(info.clipped_high) & MASK).tolist() == [[0, 1]]
  assert np.argwhere(np.asarray(info.clipped_low) & MASK).tolist() == [[1, 1]]


def test_ppo_clip_per_token_advantages_and_per_sample_eps():
  adv_bt = np.broadcast_to(ADV[:, None], LOGP.shape)
  a, _ = losses.ppo_clip_loss(jnp.asarray(LOGP), MU, adv_bt, MASK, CLIP)
  b, _ = losses.ppo_clip_loss(jnp.asarray(LOGP), MU, ADV, MASK,
                              LossParams(eps_low=jnp.full((2,), EL), eps_high=jnp.full((2,), EH)))
  c, _ = losses.ppo_clip_loss(jnp.asarray(LOGP), MU, ADV, MASK, CLIP)
  np.testing.assert_array_equal(a, c)
  np.testing.assert_array_equal(b, c)
  # A per-sample ε_high of 0.6 for row 0 un-clips token (0, 1): 1.4918 < 1.6.
  d, info = losses.ppo_clip_loss(jnp.asarray(LOGP), MU, ADV, MASK,
                                 LossParams(eps_low=EL, eps_high=jnp.array([0.6, EH])))
  np.testing.assert_allclose(d[0, 1], -np.exp(0.4) * 0.8, rtol=1e-6)
  assert not bool(info.clipped_high[0, 1])


def test_gspo_sequence_ratio_loss_and_gradient():
  # s_0 = exp(mean(0.1, 0.4, −0.2)) = e^0.1; s_1 = exp(mean(0, −0.2)) = e^-0.1.
  # ε_low = 0.2, ε_high = 0.05: row 0 (A > 0, s > 1.05) is clipped → ℓ_0 = −1.05·0.8, no
  # gradient; row 1 (A < 0, s = 0.905 ∈ [0.8, 1.05]) → ℓ_1 = −s·A, dℓ_1/dlogp_t = −s·A/2.
  fn = lambda lp: losses.gspo_loss(lp, MU, ADV, MASK, LossParams(eps_low=0.2, eps_high=0.05))
  total = lambda lp: losses.aggregate(fn(lp)[0], MASK, "seq_mean_token_mean")
  value, grad = jax.value_and_grad(total)(jnp.asarray(LOGP))
  s1 = np.exp(-0.1)
  np.testing.assert_allclose(value, 0.5 * (-1.05 * 0.8 + s1 * 1.2), rtol=1e-6)
  want = np.zeros((2, 4), np.float32)
  want[1, :2] = 0.5 * (s1 * 1.2) / 2
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
  _, info = fn(jnp.asarray(LOGP))
  np.testing.assert_allclose(info.ratio[:, 0], [np.exp(0.1), s1], rtol=1e-6)
  assert info.clipped_high[0, :3].all() and not info.clipped_high[0, 3]


# --- gradient checks (points away from the clip/truncation kinks) ----------------------

GRAD_FNS = {
    "ppo_clip": lambda lp: losses.ppo_clip_loss(lp, MU, ADV, MASK, CLIP)[0],
    # Shifting μ with logp keeps the (stopped) truncated weight constant, so the finite
    # difference sees exactly the function whose gradient the estimator uses.
    "tis": lambda lp: losses.tis_loss(lp, lp - (LOGP - MU), ADV, MASK, TRUNC)[0],
    "decoupled": lambda lp: losses.decoupled_loss(lp, MU, ADV, MASK, DEC)[0],
    "gspo": lambda lp: losses.gspo_loss(lp, MU, ADV, MASK,
                                        LossParams(eps_low=0.2, eps_high=0.05))[0],
    "asymre": lambda lp: losses.asymre_loss(lp, MU, REWARDS - BASELINE, MASK, ASYM)[0],
    "reinforce": lambda lp: losses.reinforce_loss(lp, MU, ADV, MASK)[0],
    "kl_k1": lambda lp: losses.kl_estimate(lp, PROX, "k1"),
    "kl_k2": lambda lp: losses.kl_estimate(lp, PROX, "k2"),
    "kl_k3": lambda lp: losses.kl_estimate(lp, PROX, "k3"),
}


@pytest.mark.parametrize("name", sorted(GRAD_FNS))
def test_check_grads(name):
  f = lambda lp: losses.aggregate(GRAD_FNS[name](lp), MASK, "seq_mean_token_mean")
  check_grads(f, (jnp.asarray(LOGP),), order=1, modes=("rev",), eps=1e-3, atol=2e-3, rtol=2e-3)


def test_tis_gradient_uses_truncated_weight_not_its_derivative():
  # Token (0, 1) has r = 1.4918 > cap: its gradient is −cap·A, not −(r·A)' of anything.
  g = jax.grad(lambda lp: losses.tis_loss(lp, MU, ADV, MASK, TRUNC)[0].sum())(jnp.asarray(LOGP))
  np.testing.assert_allclose(g[0, 1], -CAP * 0.8, rtol=1e-6)
  np.testing.assert_allclose(g[0, 0], -np.exp(0.1) * 0.8, rtol=1e-6)


# --- ratio 1: fresh data ----------------------------------------------------------------


@pytest.mark.parametrize("adv", [ADV, np.broadcast_to(ADV[:, None], LOGP.shape)])
def test_equal_gradients_at_ratio_one(adv):
  lp = jnp.asarray(LOGP)
  fns = {
      "ppo_clip": lambda x: losses.ppo_clip_loss(x, LOGP, adv, MASK, CLIP)[0],
      "tis": lambda x: losses.tis_loss(x, LOGP, adv, MASK, TRUNC)[0],
      "decoupled": lambda x: losses.decoupled_loss(x, LOGP, adv, MASK, DEC._replace(
          prox_logp_bt=x))[0],
      "reinforce": lambda x: losses.reinforce_loss(x, LOGP, adv, MASK)[0],
  }
  grads = {k: jax.grad(lambda x, f=f: losses.aggregate(f(x), MASK, "token_mean"))(lp)
           for k, f in fns.items()}
  want = np.where(MASK, -np.broadcast_to(ADV[:, None], LOGP.shape), 0) / N_TOK
  for k, g in grads.items():
    np.testing.assert_allclose(g, want, rtol=1e-6, err_msg=k)


# --- aggregation (CASES.md case 4 and the 2 × 4 example) -------------------------------

CASE4_LOSS = np.array([[2, 0, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32)
CASE4_MASK = np.array([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], bool)
CASE4 = {"token_mean": 1.25, "seq_mean_token_mean": 1.5, "seq_mean_token_sum": 2.5,
         "seq_mean_token_sum_norm": 0.5}


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_case4_aggregation_values_and_batch_invariance(mode):
  got = losses.aggregate(jnp.asarray(CASE4_LOSS), CASE4_MASK, mode, horizon=5)
  assert float(got) == pytest.approx(CASE4[mode], abs=1e-6)
  x4 = np.concatenate([CASE4_LOSS, CASE4_LOSS]), np.concatenate([CASE4_MASK, CASE4_MASK])
  got4 = losses.aggregate(jnp.asarray(x4[0][[0, 2, 1, 3]]), x4[1][[0, 2, 1, 3]], mode, horizon=5)
  assert float(got4) == float(got)
  assert mode != "seq_mean_token_sum_norm" or float(got) != 1.0  # the bug's 5/5


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregation_2x4_value_and_gradient(mode):
  x = np.array([[0.5, -1.0, 2.0, 7.0], [3.0, 1.5, -4.0, 9.0]], np.float32)  # 7, −4, 9 masked
  n_i = MASK.sum(1)  # [3, 2]
  h = 4
  want_val = {"token_mean": (1.5 + 4.5) / 5, "seq_mean_token_mean": (1.5 / 3 + 4.5 / 2) / 2,
              "seq_mean_token_sum": (1.5 + 4.5) / 2,
              "seq_mean_token_sum_norm": (1.5 + 4.5) / 2 / h}[mode]
  scale = {"token_mean": np.full(2, 1 / 5), "seq_mean_token_mean": 1 / (2 * n_i),
           "seq_mean_token_sum": np.full(2, 1 / 2), "seq_mean_token_sum_norm": np.full(2, 1 / 8)}
  val, g = jax.value_and_grad(lambda l: losses.aggregate(l, MASK, mode, h))(jnp.asarray(x))
  assert float(val) == pytest.approx(want_val, rel=1e-6)
  np.testing.assert_allclose(g, MASK * scale[mode][:, None], rtol=1e-6)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregation_empty_mask_is_zero(mode):
  assert float(losses.aggregate(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), mode, 3)) == 0.0


def test_aggregation_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"mode='tok_mean' is not one of .*token_mean"):
    losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2), bool), "tok_mean")
  with pytest.raises(ValueError, match=r"horizon=0 must be > 0"):
    losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2), bool), "seq_mean_token_sum_norm", 0)


# --- KL (CASES.md case 10) ---------------------------------------------------------------

E = np.e


@pytest.mark.parametrize("logp,ref,vals,grads", [
    (-1.0, -2.0, (1.0, 0.5, np.exp(-1)), (1.0, 1.0, 1 - np.exp(-1))),
    (-2.0, -1.0, (-1.0, 0.5, E - 2), (1.0, -1.0, 1 - E)),
])
def test_case10_kl_values_and_gradients(logp, ref, vals, grads):
  for est, v, g in zip(losses.KL_ESTIMATORS, vals, grads):
    f = lambda x: losses.kl_estimate(x, jnp.float32(ref), est)
    assert float(f(jnp.float32(logp))) == pytest.approx(v, abs=1e-6)
    assert float(jax.grad(f)(jnp.float32(logp))) == pytest.approx(g, abs=1e-6)
  # One gradient-descent step on β·k3 moves logp toward ref.
  step = float(jax.grad(lambda x: 0.1 * losses.kl_estimate(x, jnp.float32(ref), "k3"))(
      jnp.float32(logp)))
  assert abs(logp - 0.5 * step - ref) < abs(logp - ref)


def test_kl_nonnegative_and_zero_at_reference():
  x = jnp.linspace(-6.0, 6.0, 241)
  ref = jnp.zeros_like(x) - 1.0
  for est in ("k2", "k3"):
    assert float(losses.kl_estimate(x - 1.0, ref, est).min()) >= 0.0
  # Case 10 says "every estimator and its gradient are 0" at logp == ref, but also gives
  # d k1/dlogp = 1 everywhere; the consistent reading (tested): all values are 0, the
  # gradients of k2 and k3 are 0, and k1's is 1 (zero only in expectation under π).
  for est in losses.KL_ESTIMATORS:
    f = lambda lp: losses.kl_estimate(lp, ref, est).sum()
    assert float(jnp.abs(losses.kl_estimate(ref, ref, est)).max()) == 0.0
    want = 1.0 if est == "k1" else 0.0
    np.testing.assert_array_equal(jax.grad(f)(ref), np.full(ref.shape, want, np.float32))
  with pytest.raises(ValueError, match=r"estimator='k4' is not one of \('k1', 'k2', 'k3'\)"):
    losses.kl_estimate(x, ref, "k4")


def test_kl_penalised_rewards():
  # Row 0 on-mask k1 = logp − ref = (−1 + 1.05) + (−0.5 + 0.6) + (−2 + 1.9) = 0.05.
  r = losses.kl_penalised_rewards(REWARDS, LOGP, PROX, MASK, 0.5, "k1")
  k1_1 = (-0.3 + 0.4) + (-1.2 + 1.1)
  np.testing.assert_allclose(r, [1.0 - 0.5 * 0.05, 0.0 - 0.5 * k1_1], rtol=1e-5, atol=1e-6)


# --- entropy (CASES.md case 6) -------------------------------------------------------------


def test_case6a_sampled_entropy_ignores_sentinels():
  lp = jnp.array([[-0.5, -1.0, 1.0, 1.0]])
  m = jnp.array([[1, 1, 0, 0]], bool)
  assert float(losses.sampled_entropy(lp, m)[0]) == pytest.approx(1.5, abs=1e-6)


def test_case6b_full_entropy_masked_mean():
  mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], bool)
  logits = np.where(mask[..., None], 0.0, np.array([10.0, 0, 0, 0]))
  ent = losses.token_entropy(jnp.asarray(logits, jnp.float32))
  np.testing.assert_allclose(ent[0, 0], np.log(4), atol=1e-6)
  np.testing.assert_allclose(ent[0, 3], 0.0014980, atol=1e-6)
  assert float(losses.masked_mean(ent, mask)) == pytest.approx(1.3862944, abs=1e-6)
  assert float(ent.mean()) == pytest.approx(0.5207966, abs=1e-6)  # what the bug reports


# --- masks ---------------------------------------------------------------------------------


def test_ratio_in_range():
  r = jnp.array([[0.4, 0.5, 1.0, 2.0, 2.1]])
  assert losses.ratio_in_range(r, 2.0).tolist() == [[False, True, True, True, False]]
  assert bool(losses.ratio_in_range(r, 0.0).all())
  with pytest.raises(ValueError, match=r"c=0\.5 must be > 1"):
    losses.ratio_in_range(r, 0.5)


def test_shape_errors():
  with pytest.raises(AssertionError):
    losses.ppo_clip_loss(jnp.zeros((2, 4)), jnp.zeros((2, 3)), jnp.zeros(2),
                         jnp.ones((2, 4), bool))
  with pytest.raises(AssertionError):
    losses.reinforce_loss(jnp.zeros(4), jnp.zeros(4), jnp.zeros(4), jnp.ones(4, bool))


def test_an_extreme_log_ratio_gives_a_finite_bounded_term_with_zero_gradient():
  """log π − log μ = 100 (exp overflows float32 past ~88): the term is bounded at e^20, as
  verl clamps the log-ratio, and its gradient is 0 instead of NaN."""
  from jaxreplay.rl.losses import LOG_RATIO_BOUND, POLICY_LOSSES
  assert LOG_RATIO_BOUND == 20.0
  behaviour = jnp.array([[-100.5, -1.0]])
  mask = jnp.ones((1, 2), bool)
  for name in ("ppo_clip", "tis", "decoupled", "reinforce"):
    fn = POLICY_LOSSES[name]

    def total(logp, fn=fn):
      loss, info = fn(logp, behaviour, jnp.array([-1.0]), mask)
      return loss.sum(), info

    logp = jnp.array([[-0.5, -1.0]])
    (value, info), grad = jax.value_and_grad(total, has_aux=True)(logp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad))), name
    if name != "decoupled":  # its info.ratio is π/π_prox (1 here); π_prox/μ is capped
      assert float(info.ratio[0, 0]) == pytest.approx(np.exp(20.0), rel=1e-6), name
    if name == "ppo_clip":  # A < 0: −min(r·A, clip(r)·A) = r·|A| = e^20 at the bound, then
      assert float(value) == pytest.approx(np.exp(20.0) + 1.0, rel=1e-6)  # + the ratio-1 token
      assert float(grad[0, 0]) == 0.0  # flat past the bound, as on PPO's clipped side
