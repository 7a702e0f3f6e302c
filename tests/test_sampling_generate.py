"""Sampler tests: top-k/top-p (CASES 7), stop ids (CASES 2), left padding (CASES 1),
behaviour log-probs against the trainer's recomputation, and sharded generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import logprob_tol, reorder_tol
from jaxreplay.models import Transformer, TransformerConfig, init_cache, positions_from_mask
from jaxreplay.models.logit_processing import (nucleus_keep, process_logits,
                                               token_logprobs_from_logits)
from jaxreplay.parallel import make_mesh, spec_for
from jaxreplay.rl.scoring import token_logprobs
from jaxreplay.sampling import generate, postprocess_stops
from jaxreplay.sampling.generate import categorical, sample_token

PAD = 0
# A tiny model with every family feature switched on (GQA, biases, QK-norm, untied head).
CFG = TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128, qkv_bias=True, qk_norm=True,
                        tie_embeddings=False, scale_tied_logits=False)


@pytest.fixture(scope="module")
def policy():
  model = Transformer(CFG, nnx.Rngs(3))
  return nnx.split(model, nnx.Param)


def left_pad(rows, width):
  toks = np.full((len(rows), width), PAD, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, r in enumerate(rows):
    toks[i, width - len(r):] = r
    mask[i, width - len(r):] = True
  return jnp.asarray(toks), jnp.asarray(mask)


def sampling_probs(logits, **kw):
  return np.asarray(jax.nn.softmax(process_logits(jnp.asarray(logits, jnp.float32), 1.0, **kw)))


# ---------------------------------------------------------------- CASES 7: top-p / top-k
def test_top_p_keeps_the_token_that_crosses_the_threshold():
  probs = sampling_probs(np.log([0.5, 0.35, 0.10, 0.05]), top_p=0.9)
  np.testing.assert_allclose(probs, [0.5263158, 0.3684211, 0.1052632, 0.0], atol=1e-6)
  assert probs[3] == 0.0  # exactly dropped, not merely small


def test_top_p_second_case_and_top_p_one():
  probs = sampling_probs(np.log([0.5, 0.41, 0.09]), top_p=0.9)
  assert (probs > 0).tolist() == [True, True, False]
  probs = sampling_probs(np.log([0.5, 0.35, 0.10, 0.05]), top_p=1.0)
  np.testing.assert_allclose(probs, [0.5, 0.35, 0.10, 0.05], atol=1e-6)


@pytest.mark.parametrize("top_p", [0.0, 1e-9])
def test_top_p_zero_is_greedy(top_p):
  logits = jnp.tile(jnp.asarray([[0.1, 3.0, 1.0]]), (1000, 1))
  tok, lp, _ = sample_token(jax.random.key(0), logits, 1.0, 0, top_p)
  assert (np.asarray(tok) == 1).all()
  np.testing.assert_allclose(np.asarray(lp), 0.0, atol=1e-6)  # the whole mass is on it


def test_top_p_exact_tie_excludes_token_reached_at_exactly_p():
  sorted_probs = jnp.asarray([0.5, 0.3, 0.1, 0.1], jnp.float32)  # [3, 0, 1, 2] of [.3,.1,.1,.5]
  assert float(jnp.cumsum(sorted_probs)[1]) == np.float32(0.8)  # the tie is exact in float32
  assert np.asarray(nucleus_keep(sorted_probs, 0.8)).tolist() == [True, True, False, False]
  probs = sampling_probs(np.log([0.3, 0.1, 0.1, 0.5]), top_p=0.8)
  assert (probs > 0).tolist() == [True, False, False, True]


def test_top_k_then_top_p_on_the_renormalised_top_k():
  logits = np.log([0.4, 0.3, 0.2, 0.1])
  assert (sampling_probs(logits, top_k=3) > 0).tolist() == [True, True, True, False]
  np.testing.assert_allclose(sampling_probs(logits, top_k=2), [4 / 7, 3 / 7, 0, 0], atol=1e-6)
  # top-p alone at 0.5 keeps {0, 1}; after top-k=2 the renormalised mass of token 0 is 4/7.
  assert (sampling_probs(logits, top_p=0.5) > 0).tolist() == [True, True, False, False]
  assert (sampling_probs(logits, top_k=2, top_p=0.5) > 0).tolist() == [True, False, False, False]


def test_sampled_frequencies_follow_the_truncated_distribution():
  logits = jnp.tile(jnp.log(jnp.asarray([[0.5, 0.35, 0.10, 0.05]])), (20000, 1))
  tok, lp, flp = sample_token(jax.random.key(1), logits, 1.0, 0, 0.9)
  freq = np.bincount(np.asarray(tok), minlength=4) / 20000
  np.testing.assert_allclose(freq, [0.5263158, 0.3684211, 0.1052632, 0.0], atol=0.01)
  # Stored mu is log(p/S); the full softmax differs by log S, S = 0.95.
  np.testing.assert_allclose(np.asarray(flp - lp), np.log(0.95), atol=1e-6)


@pytest.mark.numerics
def test_inverse_cdf_categorical_matches_softmax_with_padding_blocks_and_minus_inf():
  v = 300  # 10 blocks of 32 slots: the last block is padded
  logits = np.asarray(jax.random.normal(jax.random.key(2), (v,))) * 2.0
  logits[::3] = -np.inf  # a third of the vocabulary is impossible
  n = 40000
  tok, lp = categorical(jax.random.key(3), jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)))
  tok = np.asarray(tok)
  assert not np.isin(tok, np.arange(0, v, 3)).any()
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  # log-softmax of the same logits, two ways: the vocabulary's same-signed sum
  np.testing.assert_allclose(np.exp(np.asarray(lp)), p[tok], rtol=reorder_tol(v))
  freq = np.bincount(tok, minlength=v) / n
  assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n)  # ~4 standard errors
  # A row with a single finite logit always draws it.
  one = jnp.full((5, v), -jnp.inf).at[:, v - 1].set(0.0)
  assert (np.asarray(categorical(jax.random.key(4), one)[0]) == v - 1).all()


# ---------------------------------------------------------------- shared generation
# One compiled sampler serves most tests: 8 left-padded prompts of mixed lengths (P = 6),
# stop ids {2, 7}, temperature 1.2, M = 12. Row 1 is CASES 1's row B prompt [31].
PROMPTS = [[11, 12, 13], [31], [4, 8], [10, 12, 13, 14], [6, 6, 6, 6, 6, 6], [30, 1],
           [5, 9, 11, 17, 20, 21], [9]]
P_WIDTH, M, TEMP, STOPS = 6, 12, 1.2, (2, 7)
tlp = jax.jit(token_logprobs, static_argnums=(0, 4))


@pytest.fixture(scope="module")
def sampled(policy):
  graphdef, params = policy
  toks, mask = left_pad(PROMPTS, P_WIDTH)
  # The first seed whose batch has a row stopped by the secondary id 7 and a truncated
  # row, so that CASES 2 is exercised (same compiled program for every seed).
  for seed in range(50):
    key = jax.random.key(seed)
    g = generate(graphdef, params, toks, mask, key, max_new_tokens=M, temperature=TEMP,
                 eos_ids=STOPS, pad_id=PAD)
    last = np.asarray(g.tokens)[np.arange(len(PROMPTS)), np.asarray(g.length) - 1]
    if (last == 7).any() and np.asarray(g.truncated).any():
      return toks, mask, g, key
  raise AssertionError("no seed exercised stop id 7")


@pytest.fixture(scope="module")
def shared_logits(policy, sampled):
  """[B, P + M, V] logits of the shared sequences (temperatures ≥ 1 only shrink them)."""
  graphdef, params = policy
  toks, mask, g, _ = sampled
  return nnx.merge(graphdef, params)(jnp.concatenate([toks, g.tokens], 1),
                                     jnp.concatenate([mask, g.mask], 1))


@pytest.fixture(scope="module")
def logp_atol(shared_logits):
  """conftest.logprob_tol: the sampler, the trainer, other shapes and the mesh reorder the
  forward chain."""
  return logprob_tol(CFG, shared_logits)


# ---------------------------------------------------------------- CASES 2: several stop ids
def test_postprocess_stops_cases2():
  raw = jnp.asarray([[5, 7, 9, 9, 9], [5, 6, 8, 9, 4], [2, 0, 0, 0, 0]])
  tokens, mask, length, truncated = postprocess_stops(raw, (2, 7), PAD)
  assert np.asarray(mask).astype(int).tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
  assert np.asarray(length).tolist() == [2, 5, 1]
  assert np.asarray(truncated).tolist() == [False, True, False]
  assert np.asarray(tokens).tolist() == [[5, 7, 0, 0, 0], [5, 6, 8, 9, 4], [2, 0, 0, 0, 0]]
  np.testing.assert_allclose(float(jnp.mean(truncated.astype(jnp.float32))), 0.3333333, atol=1e-6)


def test_sampler_honours_every_stop_id(sampled):
  _, _, g, _ = sampled
  t, m, lp = np.asarray(g.tokens), np.asarray(g.mask), np.asarray(g.logprobs)
  stopped_on_7 = truncated = 0
  for r in range(t.shape[0]):
    hits = np.flatnonzero(np.isin(t[r], STOPS))
    if hits.size == 0:
      assert g.truncated[r] and m[r].all() and g.length[r] == M
      truncated += 1
      continue
    s = hits[0]
    stopped_on_7 += t[r, s] == 7
    assert not g.truncated[r] and g.length[r] == s + 1
    assert m[r, :s + 1].all() and not m[r, s + 1:].any()
    assert (t[r, s + 1:] == PAD).all() and (lp[r, s + 1:] == 0).all()
    assert (lp[r, :s + 1] < 0).all()
  assert stopped_on_7 >= 1 and truncated >= 1  # the secondary stop id was exercised


# ---------------------------------------------------------------- CASES 1: left padding
@pytest.mark.slow
@pytest.mark.numerics
def test_left_padding_positions_and_logprobs_cases1(policy, sampled, logp_atol):
  graphdef, params = policy
  batch = jnp.asarray([[11, 12, 13, 21, 22], [PAD, PAD, 31, 41, 42]])
  mask = jnp.asarray([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], bool)
  pos = np.asarray(positions_from_mask(mask))
  assert pos[0].tolist() == [0, 1, 2, 3, 4]
  assert pos[1, 2:].tolist() == [0, 1, 2]
  logp, _ = tlp(graphdef, params, batch, mask, 1.0)
  alone, _ = tlp(graphdef, params, jnp.asarray([[31, 41, 42]]), jnp.ones((1, 3), bool), 1.0)
  np.testing.assert_allclose(np.asarray(logp)[1, 3:], np.asarray(alone)[0, 1:], rtol=0,
                             atol=logp_atol)
  # Shifted positions (what the bug did) change the log-probs by more than the tolerance.
  model = nnx.merge(graphdef, params)
  logits = model.step(batch[1:], jnp.arange(5)[None], jnp.ones((1, 5), bool),
                      init_cache(CFG, 1, 5), jnp.int32(0))[0]
  buggy = jax.nn.log_softmax(logits[0, 2:4])[jnp.arange(2), jnp.asarray([41, 42])]
  assert np.abs(np.asarray(buggy) - np.asarray(alone)[0, 1:]).max() > logp_atol

  # The KV-cache sampler's stored log-probs for row B (prompt [31], left-padded to
  # width 6) equal a clean forward pass of [31, completion] alone.
  _, _, g, _ = sampled
  n = int(g.length[1])
  seq = jnp.concatenate([jnp.asarray([31]), g.tokens[1, :n]])[None]
  clean, _ = token_logprobs(graphdef, params, seq, jnp.ones_like(seq, bool), TEMP)
  np.testing.assert_allclose(np.asarray(g.logprobs)[1, :n], np.asarray(clean)[0, 1:], rtol=0,
                             atol=logp_atol)


# ---------------------------------------------------------------- sampler vs trainer
@pytest.mark.numerics
def test_sampler_logprobs_equal_trainer_logprobs(policy, sampled, shared_logits, logp_atol):
  graphdef, params = policy
  toks, mask, g, _ = sampled
  full = jnp.concatenate([toks, g.tokens], 1)
  attn = jnp.concatenate([mask, g.mask], 1)
  logp, _ = tlp(graphdef, params, full, attn, TEMP)
  comp = np.asarray(g.mask)
  np.testing.assert_allclose(np.asarray(logp)[:, P_WIDTH:][comp], np.asarray(g.logprobs)[comp],
                             rtol=0, atol=logp_atol)
  # the same logits' log-softmax, two ways: the vocabulary's sum
  vocab_atol = 2 * reorder_tol(CFG.vocab_size, scale=float(jnp.abs(shared_logits).max()))
  np.testing.assert_allclose(np.asarray(g.full_logprobs), np.asarray(g.logprobs), rtol=0,
                             atol=vocab_atol)
  assert comp.sum() > 30


@pytest.mark.numerics
def test_truncated_sampling_behaviour_logprob_convention(policy, logp_atol):
  """mu = log(p/S): ratio exactly 1 through process_logits; S against the full softmax."""
  graphdef, params = policy
  toks, mask = left_pad(PROMPTS, P_WIDTH)
  t, k, p = TEMP, 12, 0.8
  g = generate(graphdef, params, toks, mask, jax.random.key(5), max_new_tokens=M,
               temperature=t, top_k=k, top_p=p, eos_ids=STOPS, pad_id=PAD)
  full = jnp.concatenate([toks, g.tokens], 1)
  attn = jnp.concatenate([mask, g.mask], 1)
  logits = jax.jit(lambda p_, x, a: nnx.merge(graphdef, p_)(x, a))(params, full, attn)
  logits = logits[:, P_WIDTH - 1:-1]  # predicts the completion
  comp = np.asarray(g.mask)
  mu = np.asarray(g.logprobs)[comp]
  same = np.asarray(token_logprobs_from_logits(logits, g.tokens, t, k, p))[comp]
  np.testing.assert_allclose(np.exp(same - mu), 1.0, rtol=0, atol=logp_atol)  # ratio == 1
  # The trainer's full-softmax log-prob gives ratio S = surviving mass (< 1 somewhere).
  logp_full, _ = tlp(graphdef, params, full, attn, t)
  ratio = np.exp(np.asarray(logp_full)[:, P_WIDTH:][comp] - mu)
  kept = np.asarray(jax.nn.softmax(logits / t) * (process_logits(logits, t, k, p) > -jnp.inf))
  np.testing.assert_allclose(ratio, kept.sum(-1)[comp], rtol=0, atol=logp_atol)
  assert ratio.min() < 0.99
  np.testing.assert_allclose(np.asarray(g.full_logprobs)[comp],
                             np.asarray(logp_full)[:, P_WIDTH:][comp], rtol=0, atol=logp_atol)
  # Every sampled token lies inside its step's top-k set.
  assert ((kept > 0).sum(-1)[comp] <= k).all()


def test_generate_rejects_bad_settings(policy):
  graphdef, params = policy
  toks, mask = left_pad(PROMPTS, P_WIDTH)
  for bad in (dict(top_p=1.5), dict(top_k=-1), dict(temperature=-1.0), dict(max_new_tokens=0)):
    kw = dict(max_new_tokens=M, temperature=1.0, eos_ids=STOPS, pad_id=PAD) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
      generate(graphdef, params, toks, mask, jax.random.key(0), **kw)


# ---------------------------------------------------------------- sharding
@pytest.mark.numerics
def test_sharded_generation_matches_one_device(policy, sampled, logp_atol):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  graphdef, params = policy
  toks, mask, g1, key = sampled  # generated on one device (mesh=None)
  mesh8 = make_mesh(data=2, fsdp=2, tensor=2)
  g8 = generate(graphdef, params, toks, mask, key, max_new_tokens=M,
                temperature=TEMP, eos_ids=STOPS, pad_id=PAD, mesh=mesh8)
  assert np.array_equal(np.asarray(g1.tokens), np.asarray(g8.tokens))
  np.testing.assert_allclose(np.asarray(g1.logprobs), np.asarray(g8.logprobs), rtol=0,
                             atol=logp_atol)
  assert len(g8.tokens.sharding.device_set) == 8
  assert g8.tokens.sharding.spec[0] is not None  # rows are really spread over the mesh
  # Partition rules: q is column-parallel, o row-parallel; dims that do not divide replicate.
  PS = jax.sharding.PartitionSpec
  assert spec_for("blocks/0/attn/q/kernel", (64, 64), mesh8) == PS("fsdp", "tensor")
  assert spec_for("blocks/0/attn/o/kernel", (64, 64), mesh8) == PS("tensor", "fsdp")
  assert spec_for("blocks/0/attn/q/bias", (3,), mesh8) == PS(None)


@pytest.fixture(scope="module")
def full_softmax_step(policy):
  """(optimizer, spec, train step without truncation): compiled once for the cases below."""
  import optax
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import make_train_step
  opt, spec = optax.sgd(0.0), AlgoSpec()
  return opt, spec, make_train_step(policy[0], opt, spec, TEMP)


# the numerics tier takes the case with both truncations: the others compile the same comparison
@pytest.mark.slow
@pytest.mark.parametrize("top_k,top_p", [(12, 1.0), (0, 0.8),
                                         pytest.param(12, 0.8, marks=pytest.mark.numerics)])
def test_train_step_ratio_is_one_under_truncation(policy, full_softmax_step, logp_atol, top_k,
                                                  top_p):
  """The learner recomputes log-probs through the sampler's top-k/top-p: at the sampling
  parameters every importance ratio is 1 (the full softmax would give the kept mass S)."""
  from jaxreplay.rl.train_step import init_train_state, make_train_step
  from jaxreplay.rollout import Rollout
  graphdef, params = policy
  opt, spec, step_full = full_softmax_step
  toks, mask = left_pad(PROMPTS, P_WIDTH)
  g = generate(graphdef, params, toks, mask, jax.random.key(5), max_new_tokens=M,
               temperature=TEMP, top_k=top_k, top_p=top_p, eos_ids=STOPS, pad_id=PAD)
  full = jnp.concatenate([toks, g.tokens], 1)
  attn = jnp.concatenate([mask, g.mask], 1)
  logp, ent = jax.jit(token_logprobs, static_argnums=(0, 4, 5, 6))(
      graphdef, params, full, attn, TEMP, top_k, top_p)
  comp = np.asarray(g.mask)
  np.testing.assert_allclose(np.asarray(logp)[:, P_WIDTH:][comp], np.asarray(g.logprobs)[comp],
                             rtol=0, atol=logp_atol)
  # Entropy of the truncated distribution: at most log(top_k) when top-k is on, finite.
  e = np.asarray(ent)[:, P_WIDTH:][comp]
  assert np.isfinite(e).all() and (e >= 0).all()
  if top_k:
    assert e.max() <= np.log(top_k) + 1e-5
  n = len(PROMPTS)
  batch = Rollout(tokens=full, attention_mask=attn,
                  completion_mask=jnp.concatenate([jnp.zeros_like(mask), g.mask], 1),
                  behaviour_logprobs=jnp.concatenate([jnp.zeros(mask.shape), g.logprobs], 1),
                  rewards=jnp.zeros((n,)), advantages=jnp.linspace(-1.0, 1.0, n),
                  group_id=jnp.zeros((n,), jnp.int32), policy_version=jnp.zeros((n,), jnp.int32), newest_version=jnp.zeros((n,), jnp.int32),
                  truncated=g.truncated)
  step = make_train_step(graphdef, opt, spec, TEMP, top_k, top_p)
  state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
  _, metrics = step(state, batch, jnp.ones((n,)))
  assert float(metrics["clip_frac"]) == 0.0
  assert float(metrics["skipped_update"]) == 0.0
  # Without the truncation the same batch has ratios S < 1: some tokens get clipped.
  state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
  _, m_full = step_full(state, batch, jnp.ones((n,)))
  assert float(m_full["ratio_mean"]) < float(metrics["ratio_mean"])
  np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, rtol=0, atol=logp_atol)
