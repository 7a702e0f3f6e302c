"""Advantage estimators: CASES.md case 5 and 3, hand-derived groups, GAE over tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.rl import advantages as adv_lib
from jaxreplay.rl import losses

GROUP_EST = adv_lib.GROUP_ESTIMATORS


@pytest.mark.parametrize("est", GROUP_EST)
@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.1] * 6, [0.35] * 12,
                                     [0.7]])
def test_zero_spread_group_is_exactly_zero(est, rewards):
  a = adv_lib.compute_advantages(jnp.asarray([rewards], jnp.float32), est)
  assert not bool(jnp.isnan(a).any())
  np.testing.assert_array_equal(a, np.zeros((1, len(rewards)), np.float32))


def test_case5b_naive_formula_would_fail():
  # The float32 mean of six 0.1s is off by ~7e-9: the naive (r − mean)/(std + 1e-8) is
  # about −0.427, which the max == min test avoids.
  r = jnp.full(6, 0.1, jnp.float32)
  naive = (r - r.mean()) / (r.std() + 1e-8)
  assert float(jnp.abs(naive).max()) > 0.1
  assert float(jnp.abs(adv_lib.grpo(r[None])).max()) <= 1e-6


@pytest.mark.parametrize("est,kw,want", [
    ("grpo", {}, [1.7320508, -0.5773503, -0.5773503, -0.5773503]),
    ("grpo", {"unbiased_std": True}, [1.5, -0.5, -0.5, -0.5]),
    ("dr_grpo", {}, [0.75, -0.25, -0.25, -0.25]),
    ("rloo", {}, [1.0, -0.3333333, -0.3333333, -0.3333333]),
])
def test_case5d_one_winner(est, kw, want):
  # Hand: mean 0.25, population std sqrt(3)/4 → (0.75, −0.25)/0.4330 = (1.732, −0.577);
  # unbiased std 0.5 → (1.5, −0.5); RLOO: 1 − 0 and 0 − 1/3.
  a = adv_lib.compute_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]), est, **kw)
  np.testing.assert_allclose(a[0], want, atol=1e-3)
  if est != "grpo":  # no epsilon involved: exact to float32
    np.testing.assert_allclose(a[0], want, atol=1e-6)


def test_case5e_rloo():
  r = jnp.array([[0.35] * 7 + [0.0]], jnp.float32)
  np.testing.assert_allclose(adv_lib.rloo(r)[0], [0.05] * 7 + [-0.35], atol=1e-6)
  scaled = adv_lib.rloo(r, std_normalize=True)
  assert bool(jnp.isfinite(scaled).all()) and float(jnp.abs(scaled).max()) <= 10.0
  # Hand: population std of the group is 0.35·sqrt(7)/8.
  np.testing.assert_allclose(scaled[0, -1], -0.35 / (0.35 * np.sqrt(7) / 8), rtol=1e-4)


def test_two_groups_at_once_and_estimator_error():
  r = jnp.array([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
  np.testing.assert_allclose(adv_lib.dr_grpo(r), [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0]])
  np.testing.assert_allclose(adv_lib.group_mean(r), [[0.25] * 4, [2.0] * 4])
  np.testing.assert_array_equal(adv_lib.compute_advantages(r, "gae"), np.zeros((2, 4)))
  with pytest.raises(ValueError, match=r"estimator='ppo' is not one of .*'grpo'"):
    adv_lib.compute_advantages(r, "ppo")


def test_case3_group_statistics_use_the_whole_group():
  # Case 3: advantages are computed before truncation masking, on all 3 members.
  r = jnp.array([[1.0, 0.0, 0.5]])  # the third is the truncated one
  np.testing.assert_allclose(adv_lib.dr_grpo(r), [[0.5, -0.5, 0.0]], atol=1e-7)


# --- each estimator through a loss on the 2 × 4 example ----------------------------------

LOGP = np.array([[-1.0, -0.5, -2.0, -1.5], [-0.3, -1.2, -0.8, -9.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)


@pytest.mark.parametrize("est,kw,want_adv", [
    ("grpo", {}, [1.0, -1.0]),          # mean 0.5, population std 0.5
    ("grpo", {"unbiased_std": True}, [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)]),
    ("dr_grpo", {}, [0.5, -0.5]),
    ("rloo", {}, [1.0, -1.0]),          # 1 − 0 and 0 − 1
])
def test_estimator_2x4_loss_and_gradient(est, kw, want_adv):
  # One group of two sequences with rewards [1, 0]; REINFORCE on the 2 × 4 example:
  # loss = −Σ A_i·logp_it / 5 on the mask, gradient −A_i/5.
  a = adv_lib.compute_advantages(jnp.array([[1.0, 0.0]]), est, **kw)[0]
  np.testing.assert_allclose(a, want_adv, rtol=1e-5)
  total = lambda lp: losses.aggregate(losses.reinforce_loss(lp, LOGP, a, MASK)[0], MASK,
                                      "token_mean")
  val, g = jax.value_and_grad(total)(jnp.asarray(LOGP))
  wa = np.asarray(want_adv, np.float32)[:, None]
  np.testing.assert_allclose(val, (-wa * LOGP * MASK).sum() / 5, rtol=1e-5)
  np.testing.assert_allclose(g, -wa * MASK / 5, rtol=1e-5)


# --- GAE ----------------------------------------------------------------------------------


def np_gae_direct(rew, val, mask, gamma, lam):
  """A_t = Σ_l (γλ)^l δ_{t+l} written out as a double sum (no recursion)."""
  b, t = rew.shape
  adv = np.zeros((b, t))
  for i in range(b):
    idx = np.nonzero(mask[i])[0]
    v = np.append(val[i, idx], 0.0)  # V after the last token is 0
    r = rew[i, idx]
    delta = r + gamma * v[1:] - v[:-1]
    for k in range(len(idx)):
      adv[i, idx[k]] = sum((gamma * lam) ** l * delta[k + l] for l in range(len(idx) - k))
  return adv, (adv + val) * mask


def test_terminal_rewards():
  m = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  got = adv_lib.terminal_rewards(jnp.array([2.0, -1.0, 5.0]), m)
  np.testing.assert_array_equal(got, [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]])


def test_gae_2x4_by_hand():
  # Row 0: 3 tokens, reward 1 at the last; values [0.5, 0.2, 0.8]; γ = 0.9, λ = 0.5.
  #   δ = [0 + 0.9·0.2 − 0.5, 0 + 0.9·0.8 − 0.2, 1 − 0.8] = [−0.32, 0.52, 0.2]
  #   A_2 = 0.2, A_1 = 0.52 + 0.45·0.2 = 0.61, A_0 = −0.32 + 0.45·0.61 = −0.0455
  # Row 1: 2 tokens, reward −1; values [0.1, −0.3]:
  #   δ = [0.9·(−0.3) − 0.1, −1 + 0.3] = [−0.37, −0.7]; A = [−0.37 − 0.315, −0.7]
  mask = MASK
  rew = adv_lib.terminal_rewards(jnp.array([1.0, -1.0]), mask)
  val = np.array([[0.5, 0.2, 0.8, 9.0], [0.1, -0.3, 9.0, 9.0]], np.float32)  # 9: off-mask
  adv, ret = adv_lib.gae(rew, val, mask, 0.9, 0.5)
  want = np.array([[-0.0455, 0.61, 0.2, 0], [-0.685, -0.7, 0, 0]], np.float32)
  np.testing.assert_allclose(adv, want, atol=1e-6)
  np.testing.assert_allclose(ret, (want + val) * mask, atol=1e-6)
  d_adv, d_ret = np_gae_direct(np.asarray(rew), val * mask, mask, 0.9, 0.5)
  np.testing.assert_allclose(adv, d_adv, atol=1e-6)
  np.testing.assert_allclose(ret, d_ret, atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.0), (0.99, 0.95)])
def test_gae_matches_direct_sum_on_random_rows(gamma, lam):
  rng = np.random.default_rng(0)
  start = np.array([2, 0, 5, 1])
  length = np.array([4, 7, 1, 0])
  mask = np.zeros((4, 8), bool)
  for i in range(4):
    mask[i, start[i]:start[i] + length[i]] = True
  rew = rng.normal(size=(4, 8)).astype(np.float32) * mask
  val = rng.normal(size=(4, 8)).astype(np.float32)
  adv, ret = adv_lib.gae(jnp.asarray(rew), jnp.asarray(val), mask, gamma, lam)
  d_adv, d_ret = np_gae_direct(rew, val * mask, mask, gamma, lam)
  np.testing.assert_allclose(adv, d_adv, atol=1e-5)
  np.testing.assert_allclose(ret, d_ret, atol=1e-5)
  if gamma == 1.0 and lam == 1.0:  # Monte-Carlo return: the reward-to-go
    togo = np.cumsum(rew[:, ::-1], 1)[:, ::-1] * mask
    np.testing.assert_allclose(ret, togo, atol=1e-5)


def test_gae_objective_2x4_loss_and_gradients():
  """GAE through the learner objective on the 2 × 4 example (no whitening, ratio 1).

  Advantages from ``test_gae_2x4_by_hand``; returns R = A + V. With ``ppo_clip`` at ratio
  1 the policy term is −Σ A_t·r_t / 5 (value −ΣA/5, gradient −A_t/5); the value term is
  vf · ½ Σ (V − R)² / 5 = vf · ½ Σ A² / 5 with gradient vf · (V − R)/5 = −vf·A_t/5.
  """
  from jaxreplay.rl.objective import gae_advantages, objective
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rollout import Rollout
  val = np.array([[0.5, 0.2, 0.8, 9.0], [0.1, -0.3, 9.0, 9.0]], np.float32)
  a = np.array([[-0.0455, 0.61, 0.2, 0], [-0.685, -0.7, 0, 0]], np.float32)
  batch = Rollout(tokens=jnp.zeros((2, 4), jnp.int32), attention_mask=jnp.asarray(MASK),
                  completion_mask=jnp.asarray(MASK), behaviour_logprobs=jnp.asarray(LOGP),
                  rewards=jnp.array([1.0, -1.0]), advantages=jnp.zeros(2),
                  group_id=jnp.zeros(2, jnp.int32), policy_version=jnp.zeros(2, jnp.int32), newest_version=jnp.zeros(2, jnp.int32),
                  truncated=jnp.zeros(2, bool))
  spec = AlgoSpec.from_config(dict(advantage="gae", gae_gamma=0.9, gae_lambda=0.5,
                                   gae_whiten=False, vf_coef=0.5, value_clip=0.2))

  def f(lp, v):
    adv, ret = gae_advantages(spec, batch, v)
    return objective(spec, lp, jnp.zeros_like(lp), batch, jnp.ones(2), jnp.zeros(2, jnp.int32),
                     adv_bt=adv, returns_bt=ret, values_bt=v)

  (loss, m), (g_lp, g_v) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      jnp.asarray(LOGP), jnp.asarray(val))
  want_loss = -a.sum() / 5 + 0.5 * 0.5 * (a ** 2).sum() / 5
  assert float(loss) == pytest.approx(want_loss, abs=1e-6)
  np.testing.assert_allclose(g_lp, -a * MASK / 5, atol=1e-6)
  np.testing.assert_allclose(g_v, -0.5 * a * MASK / 5, atol=1e-6)
  assert float(m["value_loss"]) == pytest.approx(0.5 * (a ** 2).sum() / 5, abs=1e-6)


def test_clipped_value_loss_by_hand_and_check_grads():
  from jax.test_util import check_grads
  from jaxreplay.rl import value
  # V_old = 0, R = 1, ε = 0.2. V = 0.5: unclipped ½·0.25, clipped branch ½·(0.2 − 1)² = 0.32
  # → 0.32 with zero gradient (the clip is active). V = 0.1: both branches ½·0.81 (inside
  # the clip range), gradient V − R = −0.9. V = −0.5: unclipped ½·2.25 = 1.125 dominates.
  v = jnp.array([[0.5, 0.1, -0.5]])
  zero, one = jnp.zeros((1, 3)), jnp.ones((1, 3))
  f = lambda x: value.clipped_value_loss(x, zero, one, 0.2)
  np.testing.assert_allclose(f(v), [[0.32, 0.405, 1.125]], rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(v), [[0.0, -0.9, -1.5]], rtol=1e-6)
  check_grads(lambda x: f(x).sum(), (v,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
              rtol=2e-3)
  np.testing.assert_allclose(value.clipped_value_loss(v, zero, one, 0.0), 0.5 * (v - 1) ** 2)


def test_gae_with_kl_reward_penalty_by_hand():
  """kl_mode='reward': r_t = terminal reward − β·k1_t, no KL gradient.

  k1 = logp − ref = 0.2 on every token, β = 0.5 → penalty 0.1 per token. γ = λ = 1 and
  V = 0 make A_t the reward-to-go: row 0 r = [−0.1, −0.1, 0.9] → A = [0.7, 0.8, 0.9];
  row 1 r = [−0.1, −1.1] → A = [−1.2, −1.1]. At ratio 1 the gradient is −A_t/5.
  """
  from jaxreplay.rl.objective import gae_advantages, objective
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rollout import Rollout
  batch = Rollout(tokens=jnp.zeros((2, 4), jnp.int32), attention_mask=jnp.asarray(MASK),
                  completion_mask=jnp.asarray(MASK), behaviour_logprobs=jnp.asarray(LOGP),
                  rewards=jnp.array([1.0, -1.0]), advantages=jnp.zeros(2),
                  group_id=jnp.zeros(2, jnp.int32), policy_version=jnp.zeros(2, jnp.int32), newest_version=jnp.zeros(2, jnp.int32),
                  truncated=jnp.zeros(2, bool))
  spec = AlgoSpec.from_config(dict(advantage="gae", gae_gamma=1.0, gae_lambda=1.0,
                                   gae_whiten=False, kl_coef=0.5, kl_estimator="k1",
                                   kl_mode="reward"))
  ref, v = jnp.asarray(LOGP) - 0.2, jnp.zeros((2, 4))

  def f(lp):
    adv, ret = gae_advantages(spec, batch, v, logp_bt=lp, ref_logp_bt=ref)
    return objective(spec, lp, jnp.zeros_like(lp), batch, jnp.ones(2), jnp.zeros(2, jnp.int32),
                     adv_bt=adv, returns_bt=ret, ref_logp_bt=ref, values_bt=v)[0]

  g = jax.grad(f)(jnp.asarray(LOGP))
  a = np.array([[0.7, 0.8, 0.9, 0], [-1.2, -1.1, 0, 0]], np.float32)
  np.testing.assert_allclose(g, -a / 5, atol=1e-6)
