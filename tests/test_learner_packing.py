"""Sequence packing (``rl.packing``, ``algo.pack_sequences``): plans place every real token
once and unpack restores it; packed attention equals each sequence scored alone; the packed
learner's loss and gradient equal the full-width ones for every policy loss, with gradient
accumulation, minibatches, a value head, a KL reference and chunked log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import abs_terms, forward_terms, logprob_tol, reorder_tol
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl import losses, packing, train_step
from jaxreplay.rl.scoring import (packed_scores, plan_rows, token_logprobs,
                                  token_logprobs_by_rows)
from jaxreplay.train.generation import learner_behaviour_logprobs
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout

CFG = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=32)
B, P, M = 8, 4, 6
T = P + M
PROMPT_LENS = np.array([4, 2, 3, 1, 4, 2, 3, 4])
COMP_LENS = np.array([6, 1, 3, 0, 2, 5, 4, 1])  # one empty completion, one at the cap
# Packing reorders each token's forward chain (conftest.logprob_tol), then a loss sums the
# loss tokens; a gradient runs the forward chain back as well and sums every position
# (conftest.reorder_tol).
N_FWD = forward_terms(CFG, T)
N_TOK = int(COMP_LENS.sum())
N_GRAD = 2 * N_FWD + B * T


def layout(prompt_lens, comp_lens, p, m):
  """[B, P + M] attention and completion masks: prompts left-padded, completions right-padded."""
  cols = np.arange(p + m)[None, :]
  prompt = (cols < p) & (cols >= p - prompt_lens[:, None])
  comp = (cols >= p) & (cols < p + comp_lens[:, None])
  return prompt | comp, comp


@pytest.fixture(scope="module")
def setup():
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  attn, comp = layout(PROMPT_LENS, COMP_LENS, P, M)
  tokens = jnp.asarray(jax.random.randint(jax.random.key(1), (B, T), 1, CFG.vocab_size)
                       * attn, jnp.int32)
  logp, _ = token_logprobs(graphdef, params, tokens, jnp.asarray(attn))
  mu = jnp.where(comp, logp + 0.3 * jax.random.normal(jax.random.key(2), (B, T)), 0.0)
  batch = Rollout(tokens=tokens, attention_mask=jnp.asarray(attn),
                  completion_mask=jnp.asarray(comp), behaviour_logprobs=mu,
                  rewards=jnp.asarray(np.arange(B) % 2, jnp.float32),
                  advantages=jnp.linspace(-1.0, 1.0, B),
                  group_id=jnp.arange(B, dtype=jnp.int32) // 2,
                  policy_version=jnp.zeros(B, jnp.int32), newest_version=jnp.zeros(B, jnp.int32),
                  truncated=jnp.asarray(COMP_LENS == M))
  return graphdef, params, batch


@pytest.fixture(scope="module")
def logp_atol(setup):
  """conftest.logprob_tol of this model's logits."""
  graphdef, params, batch = setup
  return logprob_tol(CFG, nnx.merge(graphdef, params)(batch.tokens, batch.attention_mask))


def test_bucket_rows_by_hand():
  assert [packing.bucket_rows(n, 100) for n in (0, 1, 5, 16, 17, 18, 33, 36, 37)] == [
      1, 1, 5, 16, 18, 18, 36, 36, 40]
  assert packing.bucket_rows(61, 62) == 62  # the bucket (64) capped at the batch
  with pytest.raises(ValueError, match="9 packed rows exceed the cap 8"):
    packing.bucket_rows(9, 8)


def test_first_fit_decreasing_by_hand():
  # longest first: 5 -> bin 0; 4 does not fit bin 0 -> bin 1; 3 fits bin 1 (7); 2 fits bin 0
  np.testing.assert_array_equal(packing.first_fit_decreasing([5, 3, 4, 2, 0], 7),
                                [0, 1, 1, 0, -1])
  with pytest.raises(ValueError, match=r"lengths must be in \[0, 7\]"):
    packing.first_fit_decreasing([8], 7)


def test_plan_by_hand_and_round_trip():
  mask = np.array([[0, 1, 1, 1, 0],   # 3 real tokens, left- and right-padded
                   [1, 1, 1, 1, 1],   # 5: a row of its own
                   [0, 0, 1, 1, 0]],  # 2: fits after row 0
                  bool)
  tokens = jnp.arange(1, 16, dtype=jnp.int32).reshape(3, 5)
  plan = packing.plan_packing(mask)
  assert plan.src.shape == (2, 5) and plan.dst.shape == (3, 5)
  packed = np.asarray(packing.pack(tokens, plan))
  np.testing.assert_array_equal(packed, [[6, 7, 8, 9, 10], [2, 3, 4, 13, 14]])
  np.testing.assert_array_equal(plan.segment_ids, [[1, 1, 1, 1, 1], [1, 1, 1, 2, 2]])
  np.testing.assert_array_equal(plan.positions, [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]])
  np.testing.assert_array_equal(plan.keep, mask & (np.cumsum(mask, 1) > 1))
  back = np.asarray(packing.unpack(packing.pack(tokens, plan), plan, fill=-1))
  np.testing.assert_array_equal(back, np.where(plan.keep, np.asarray(tokens), -1))
  with pytest.raises(ValueError, match="rows=1 is fewer than the 2 packed rows"):
    packing.plan_packing(mask, rows=1)


def test_random_plans_place_every_real_token_once():
  rng = np.random.default_rng(0)
  for _ in range(20):
    b, t = rng.integers(1, 12), rng.integers(1, 20)
    mask = rng.random((b, t)) < rng.random()
    plan = packing.plan_packing(mask)
    src, seg = np.asarray(plan.src), np.asarray(plan.segment_ids)
    assert sorted(src[seg > 0].tolist()) == np.flatnonzero(mask.reshape(-1)).tolist()
    flat_tokens = np.arange(b * t)
    packed = flat_tokens[src]  # packing.pack's gather, in numpy
    np.testing.assert_array_equal(packed.reshape(-1)[np.asarray(plan.dst)[mask]],
                                  flat_tokens.reshape(b, t)[mask])
    needed = packing.first_fit_decreasing(mask.sum(1), t).max() + 1
    assert plan.src.shape[0] == packing.bucket_rows(int(needed), b)


def test_groups_follow_the_scoring_passes_micro_batches():
  rows = packing.group_rows(8, 2, 2)
  np.testing.assert_array_equal(rows, [[[0, 2], [1, 3]], [[4, 6], [5, 7]]])
  mb = train_step.micro_batches(jnp.arange(8)[4:], 2)  # minibatch 1's passes
  np.testing.assert_array_equal(mb, rows[1])


def test_batch_plan_by_hand():
  mask = np.array([[1, 1, 1, 1, 1],   # 5 tokens: bin 0
                   [0, 1, 1, 1, 0],   # 3: bin 2, with row 2
                   [0, 0, 0, 1, 1],   # 2: after row 1 (4 + 2 > 5 in bin 1)
                   [1, 1, 1, 1, 0]],  # 4: bin 1
                  bool)
  tokens = jnp.arange(1, 21, dtype=jnp.int32).reshape(4, 5)
  # 2 micro-batches of 2 rows: 3 bins need 2 steps; bins 0, 1 are step 0, bin 2 step 1
  plan = packing.plan_batch(mask, 1, 2)
  assert plan.src.shape == (1, 2, 2, 5) and plan.dst.shape == (1, 2, 4, 5)
  plan = jax.tree.map(lambda x: x[0], plan)
  np.testing.assert_array_equal(packing.step_rows(plan), [[1, 0, 0, 1], [0, 1, 1, 0]])
  packed = np.stack([np.asarray(packing.pack(tokens, jax.tree.map(lambda x: x[s], plan)))
                     for s in range(2)])
  np.testing.assert_array_equal(packed, [[[1, 2, 3, 4, 5], [16, 17, 18, 19, 1]],
                                         [[7, 8, 9, 14, 15], [1, 1, 1, 1, 1]]])
  np.testing.assert_array_equal(plan.segment_ids, [[[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]],
                                                   [[1, 1, 1, 2, 2], [0, 0, 0, 0, 0]]])
  assert packing.padding_fraction(plan) == 6 / 20  # empty slots of 2 steps × 2 rows × 5
  # each step unpacks its own rows; merged, every predicted column comes back once
  out = jax.vmap(lambda p, x: packing.unpack(packing.pack(tokens, p), p, fill=0))(plan, packed)
  np.testing.assert_array_equal(packing.merge_steps(out, plan),
                                np.where(mask & (np.cumsum(mask, 1) > 1), tokens, 0))
  # one micro-batch: the same bins in 3 rows of one step
  one = packing.plan_batch(mask)
  assert one.src.shape == (1, 1, 3, 5) and packing.padding_fraction(one) == 1 / 15


def test_random_batch_plans_pack_whole_sequences_once_in_one_step():
  rng = np.random.default_rng(0)
  for _ in range(60):
    n_mb, n_acc, multiple = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    b, t = n_mb * n_acc * rng.integers(1, 5), rng.integers(1, 20)
    mask = rng.random((b, t)) < rng.random()
    quantum = rng.choice([packing.WIDTH_QUANTUM, 2, 3])  # t < WIDTH_QUANTUM: width T
    plan = packing.plan_batch(mask, n_mb, n_acc, multiple, quantum=quantum)
    _, steps, rows, w = plan.src.shape
    assert steps <= n_acc and rows % multiple == 0
    assert w == t or (w % quantum == 0 and mask.sum(1).max() <= w < t)
    at_t = packing.plan_batch(mask, n_mb, n_acc, multiple, quantum=t)
    assert steps * rows * w <= np.prod(at_t.src.shape[1:])  # never more slots than width T
    assert rows <= packing.round_up(b // (n_mb * n_acc), multiple)
    for m, mb in enumerate(mask.reshape(n_mb, -1, t)):
      src, seg = np.asarray(plan.src[m]), np.asarray(plan.segment_ids[m])
      # every real token once, over the steps
      assert sorted(src[seg > 0].tolist()) == np.flatnonzero(mb.reshape(-1)).tolist()
      # a sequence's tokens in one step and one packed row
      step_of = np.repeat(np.arange(steps), rows * w).reshape(steps, rows, w)
      row_of = np.broadcast_to(np.arange(rows)[:, None], (steps, rows, w))
      for i in range(mb.shape[0]):
        mine = (seg > 0) & (src // t == i)
        assert len(set(zip(step_of[mine], row_of[mine]))) == (1 if mb[i].any() else 0)
      # each step's dst finds its tokens; its keep marks exactly its sequences
      in_step = np.asarray(packing.step_rows(jax.tree.map(lambda x: x[m], plan)))
      predicted = mb & (np.cumsum(mb, 1) > 1)
      np.testing.assert_array_equal(in_step.sum(0), predicted.any(1))
      for s_ in range(steps):
        flat = np.arange(mb.size)[src[s_]].reshape(-1)
        keep = np.asarray(plan.keep[m, s_])
        np.testing.assert_array_equal(keep, predicted & in_step[s_][:, None])
        np.testing.assert_array_equal(flat[np.asarray(plan.dst[m, s_])[keep]],
                                      np.flatnonzero(keep.reshape(-1)))
    if n_acc == 1:  # the one-micro-batch plan at the same width, leaf for leaf
      jax.tree.map(np.testing.assert_array_equal, plan,
                   packing.plan_groups(mask, n_mb, 1, multiple=multiple, width=w))


def test_narrower_rows_when_the_device_multiple_would_add_empty_rows():
  # three 5-token sequences, rows a multiple of 2 devices: at width T = 8 each needs a
  # row (5 + 5 > 8), 3 rows round up to 4: 32 slots; at width 6 the same 4 rows hold
  # them in 24 slots, and a width below 5 cannot hold one
  mask = np.zeros((4, 8), bool)
  mask[:3, 1:6] = True
  plan = packing.plan_batch(mask, 1, 1, multiple=2, quantum=2)
  assert plan.src.shape == (1, 1, 4, 6) and plan.dst.shape == (1, 1, 4, 8)
  assert packing.padding_fraction(plan) == 1 - 15 / 24
  assert packing.padding_fraction(packing.plan_batch(mask, 1, 1, 2, quantum=8)) == 1 - 15 / 32
  np.testing.assert_array_equal(plan.segment_ids[0, 0], [[1] * 5 + [0]] * 3 + [[0] * 6])
  np.testing.assert_array_equal(plan.dst[0, 0, 1, 1:6], 6 + np.arange(5))  # row 1 · W + slot
  # one device: 3 rows of 8 (24 slots) tie with 3 rows of 6 (18)? no: 18 < 24, width 6
  assert packing.plan_batch(mask, quantum=2).src.shape == (1, 1, 3, 6)
  # a tie keeps width T: two 4-token sequences fill one row of 8, or two rows of 4
  mask = np.zeros((2, 8), bool)
  mask[:, :4] = True
  assert packing.plan_batch(mask, quantum=4).src.shape == (1, 1, 1, 8)
  with pytest.raises(ValueError, match="lengths must be in"):
    packing.plan_packing(np.ones((1, 8), bool), width=6)


def test_step_shape_by_hand():
  assert packing.step_shape(25, 8) == (4, 7)  # 4 steps of ⌈25/4⌉ rows
  assert packing.step_shape(25, 8, 8) == (4, 8)  # rows a multiple of the devices
  assert packing.step_shape(7, 8) == (1, 7)  # one step: the one-micro-batch rows
  assert packing.step_shape(0, 8) == (1, 1)
  assert packing.step_shape(97, 32, 8) == (4, 32)  # ⌈97/4⌉ = 25, rounded up to 32
  with pytest.raises(ValueError, match="budget=12 must be a positive multiple of 8"):
    packing.step_shape(5, 12, 8)


@pytest.mark.parametrize("multiple", [1, 8])
def test_accumulation_keeps_the_one_micro_batch_padding(multiple):
  """The learner's plan at 8 micro-batches (the 7B preset's 64 × (384 + 1024) batch,
  bench/compiled_invariants.py's lognormal lengths) pads as the one-micro-batch plan does:
  its S steps hold R rows each, R = ⌈needed / S⌉ (rows below 16 are not bucketed), so at
  most S − 1 empty rows more, (S − 1)/(S·R) of the slots; with R a multiple of 8 devices
  and 8 rows a step, no more rows than the one-micro-batch plan's (both are the needed
  rows rounded up to 8). Over 8 devices, rows narrower than T (``packing.pack_width``)
  take the 25–27 rows these batches need at width 1,408 in 32 rows of 1,216–1,344 tokens
  (padding 0.037–0.133) where 32 rows of 1,408 pad 0.081–0.252."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
  from compiled_invariants import lognormal_mask
  graphdef = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)[0]

  def plan_fn(n_acc):
    spec = AlgoSpec.from_config(dict(grad_accum_steps=n_acc, pack_sequences=True))
    return train_step.make_train_step(graphdef, train_step.scheduled_adamw(1e-3, 0, 1.0),
                                      spec, 1.0).plan_batch

  one, accumulated = plan_fn(1), plan_fn(8)
  for seed in range(4):
    mask = lognormal_mask(64, 384, 1024, seed)
    p1, p8 = one(mask, multiple=multiple), accumulated(mask, multiple=multiple)
    steps, rows = p8.src.shape[1:3]
    bound = 0.0 if multiple == 8 else (steps - 1) / (steps * rows)
    assert packing.padding_fraction(p8) <= packing.padding_fraction(p1) + bound, seed
    assert packing.padding_fraction(p8) <= 0.15, seed
    assert steps < 8, seed  # fewer steps than micro-batches: the batch is mostly short


@pytest.mark.numerics
def test_packed_attention_equals_each_sequence_alone(setup):
  graphdef, params, batch = setup
  model = nnx.merge(graphdef, params)
  attn = np.asarray(batch.attention_mask)
  plan = packing.plan_packing(attn)
  assert plan.src.shape[0] < B
  tok = packing.pack(batch.tokens, plan)
  h_packed = np.asarray(model.hidden(tok, plan.mask, plan.segment_ids, plan.positions))
  # one sequence per row, padded: each row's attention sees that sequence alone
  alone = np.asarray(model.hidden(batch.tokens, batch.attention_mask))
  flat = h_packed.reshape(-1, CFG.d_model)
  # the layers' chain, its terms about the size of the largest |h| (conftest.logprob_tol)
  np.testing.assert_allclose(flat[np.asarray(plan.dst)[attn]], alone[attn], rtol=0,
                             atol=reorder_tol(N_FWD, scale=float(np.abs(alone[attn]).max())))
  assert np.asarray(plan.segment_ids).max() > 1  # some rows hold several sequences


@pytest.mark.numerics
@pytest.mark.parametrize("chunk, width", [(0, None), (3, None), (3, 7)])
def test_packed_scores_equal_full_width_on_predicted_columns(setup, logp_atol, chunk, width):
  graphdef, params, batch = setup
  mask = np.asarray(batch.attention_mask)
  if width:  # rows of width 7 < T: the sequences that fit (all but row 0's 10 tokens)
    mask = mask & (mask.sum(1) <= width)[:, None]
  plan = packing.plan_packing(mask, width=width)
  assert plan.src.shape[1] == (width or T) and np.asarray(plan.keep).sum() > 20
  logp, ent, _ = packed_scores(graphdef, params, batch.tokens, plan, 0.9, chunk=chunk)
  ref_logp, ref_ent = token_logprobs(graphdef, params, batch.tokens, batch.attention_mask,
                                     0.9, chunk=chunk)
  keep = np.asarray(plan.keep)
  tol = logp_atol / 0.9  # temperature 0.9 scales the logits' rounding by 1/0.9
  np.testing.assert_allclose(np.asarray(logp)[keep], np.asarray(ref_logp)[keep], rtol=0, atol=tol)
  np.testing.assert_allclose(np.asarray(ent)[keep], np.asarray(ref_ent)[keep], rtol=0, atol=tol)
  assert np.all(np.asarray(logp)[~keep] == 0)


@pytest.mark.numerics
@pytest.mark.parametrize("rows", [0, 3])
def test_scoring_passes_packed_equal_full_width(setup, logp_atol, rows):
  graphdef, params, batch = setup
  attn = np.asarray(batch.attention_mask)
  plan = plan_rows(attn, rows)
  assert plan.dst.shape[:3] == ((1, 3, 3) if rows else (1, 1, B))  # 8 rows padded to 9
  keep = attn & (np.cumsum(attn, 1) > 1)
  got = token_logprobs_by_rows(graphdef, params, batch.tokens, batch.attention_mask, 0.9,
                               chunk=4, rows=rows, plan=plan)
  want = token_logprobs_by_rows(graphdef, params, batch.tokens, batch.attention_mask, 0.9,
                                chunk=4, rows=rows)
  for g, w in zip(got, want):
    # temperature 0.9 scales the logits' rounding by 1/0.9
    np.testing.assert_allclose(np.asarray(g)[keep], np.asarray(w)[keep], rtol=0,
                               atol=logp_atol / 0.9)
  logp_p, m_p = learner_behaviour_logprobs(graphdef, params, batch, temperature=1.0, rows=rows,
                                           plan=plan)
  logp_f, m_f = learner_behaviour_logprobs(graphdef, params, batch, temperature=1.0, rows=rows)
  np.testing.assert_allclose(logp_p, logp_f, rtol=0, atol=logp_atol)
  # k3(x) = e^x − 1 − x moves by |e^x − 1|·δ when a log-prob moves by δ; then a token mean
  x = np.asarray(logp_f - batch.behaviour_logprobs)[np.asarray(batch.completion_mask)]
  np.testing.assert_allclose(m_p["behaviour_kl_sampler"], m_f["behaviour_kl_sampler"],
                             rtol=reorder_tol(x.size),
                             atol=logp_atol * float(np.abs(np.expm1(x)).max()))


def _algo(loss, **kw):
  algo = dict(loss=loss, entropy_coef=0.01, staleness_buckets=(0,), **kw)
  if loss == "asymre":
    algo["advantage"] = "dr_grpo"
  return algo


@pytest.mark.slow  # the packed and full-width gradients of every loss: the file's longest compile
@pytest.mark.numerics
@pytest.mark.parametrize("n_acc, aggregation", [(1, "token_mean"), (4, "seq_mean_token_mean")])
def test_packed_gradient_equals_full_width_for_every_loss(setup, logp_atol, n_acc, aggregation):
  """With 4 micro-batches the plan packs the 8 sequences in 3 steps of 2 rows, each step's
  loss divided by the whole batch's normaliser: the sum is the whole batch's loss and
  gradient, GSPO's sequence ratio and the sequence means included."""
  graphdef, params, batch = setup
  stale = jnp.arange(B, dtype=jnp.int32) % 3
  weights = jnp.linspace(0.5, 1.5, B)
  prox = batch.behaviour_logprobs * 0.9
  plan = jax.tree.map(lambda x: x[0], packing.plan_batch(np.asarray(batch.attention_mask), 1,
                                                         n_acc))
  assert plan.src.shape[:2] == ((1, 6) if n_acc == 1 else (3, 2))  # (S, R)
  make_fns = lambda n: [train_step.make_grad_fn(  # noqa: E731
      graphdef, _algo(name, aggregation=aggregation, grad_accum_steps=n), 1.0)
      for name in losses.POLICY_LOSSES]
  fns, packed_fns = make_fns(1), make_fns(n_acc)

  def all_losses(fns, p, plan):
    return [f(p, batch, weights, stale, prox, None, None, plan) for f in fns]

  full = jax.jit(lambda p: all_losses(fns, p, None))(params)
  packed = jax.jit(lambda p, pl: all_losses(packed_fns, p, pl))(params, plan)
  with abs_terms():
    abs_fns = make_fns(1)
    abs_full = jax.jit(lambda p: [f(p, batch, weights, stale, prox, None, None)[0][0]
                                  for f in abs_fns])(params)
  # the S parts' losses and gradients add S - 1 <= n_acc terms to each sum
  n_tok, n_grad = N_TOK + n_acc - 1, N_GRAD + n_acc - 1
  for name, ((l_f, m_f), g_f), ((l_p, m_p), g_p), abs_loss in zip(
      losses.POLICY_LOSSES, full, packed, abs_full):
    assert abs(float(l_f)) > 1e-4, name
    # each term moves by its size × logp_atol, then n_tok are summed: scale Σ|term|
    np.testing.assert_allclose(float(l_p), float(l_f), rtol=0, err_msg=name,
                               atol=float(abs_loss) * (logp_atol + reorder_tol(n_tok)))
    # each token's entropy within logp_atol, then a mean of same-signed terms
    np.testing.assert_allclose(float(m_p["entropy"]), float(m_f["entropy"]),
                               rtol=reorder_tol(n_tok), atol=logp_atol, err_msg=name)
    g_max = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_f))
    # entries near 0 are sums of per-position terms up to about the largest entry's size
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=reorder_tol(n_grad), atol=reorder_tol(n_grad, scale=g_max), err_msg=name),
        g_p, g_f)


@pytest.mark.numerics
@pytest.mark.parametrize("algo", [
    dict(advantage="gae", kl_coef=0.1, num_minibatches=2, grad_accum_steps=2,
         logprob_chunk=3),
    dict(loss="decoupled", kl_coef=0.05, kl_mode="loss", update_epochs=2, grad_accum_steps=2),
], ids=["gae_kl_minibatches_accum_chunk", "decoupled_prox_ref"])
@pytest.mark.slow
def test_packed_train_step_equals_full_width(setup, logp_atol, algo):
  graphdef, params, batch = setup
  algo = dict(algo, warmup_steps=0, lr_schedule="constant", lr=1e-2, staleness_buckets=(0,))

  def run(pack):
    spec = AlgoSpec.from_config(dict(algo, pack_sequences=pack))
    opt = train_step.make_optimizer(spec, 10)
    step = train_step.make_train_step(graphdef, opt, spec, 1.0)
    assert hasattr(step, "plan_batch") == pack
    state = train_step.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
    return step(state, batch)

  (s_f, m_f), (s_p, m_p) = run(False), run(True)
  with abs_terms():
    _, m_abs = run(False)
  for key in ("loss", "pg_loss"):
    # each term (log-probs, values) moves by its size × logp_atol, then N_TOK are summed
    atol = float(m_abs[key]) * (logp_atol + reorder_tol(N_TOK))
    np.testing.assert_allclose(float(m_p[key]), float(m_f[key]), rtol=0, atol=atol, err_msg=key)
  # token means of terms within logp_atol; k3(x) of two log-probs, |x| ≪ 1, within twice it
  np.testing.assert_allclose(float(m_p["entropy"]), float(m_f["entropy"]),
                             rtol=reorder_tol(N_TOK), atol=logp_atol)
  np.testing.assert_allclose(float(m_p["kl_ref"]), float(m_f["kl_ref"]),
                             rtol=reorder_tol(N_TOK), atol=2 * logp_atol)
  # a norm sums P same-signed squares of entries each within (N_GRAD − 1)·eps
  trained = (s_f.params, s_f.value_params)
  n_params = sum(x.size for x in jax.tree.leaves(trained))
  np.testing.assert_allclose(float(m_p["grad_norm"]), float(m_f["grad_norm"]),
                             rtol=reorder_tol(N_GRAD + n_params))
  # Two Adam steps lr·m̂/(√v̂ + ε): each moves by at most twice the gradients' relative
  # difference (entries ≫ ε) and rounds p once
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=2 * reorder_tol(2), atol=2 * algo["lr"] * 2 * reorder_tol(N_GRAD)),
      (s_p.params, s_p.value_params), trained)


def test_pack_sequences_must_be_a_bool():
  with pytest.raises(ValueError, match=r"^algo\.pack_sequences=1 is invalid: must be a bool$"):
    AlgoSpec.from_config({"pack_sequences": 1})


@pytest.mark.slow
def test_packed_rows_split_over_the_batch_devices():
  """With the plan's rows placed over data × fsdp (``sharding.place_rows``, rows a multiple
  of the devices), each of 8 devices holds about an eighth of the packed step's
  temporaries; a replicated plan makes every device run the whole packed forward."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  from jaxreplay.parallel import sharding
  cfg = TransformerConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          head_dim=8, d_ff=64)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  algo = AlgoSpec.from_config({"loss": "ppo_clip", "pack_sequences": True})
  opt = train_step.scheduled_adamw(1e-3, 0, 1.0)
  b, t = 64, 128
  rng = np.random.default_rng(0)
  attn = np.arange(t)[None] < rng.integers(8, t, b)[:, None]
  batch = Rollout(tokens=jnp.asarray(rng.integers(0, 256, (b, t)) * attn, jnp.int32),
                  attention_mask=jnp.asarray(attn), completion_mask=jnp.asarray(attn),
                  behaviour_logprobs=jnp.zeros((b, t)), rewards=jnp.zeros(b),
                  advantages=jnp.ones(b), group_id=jnp.arange(b, dtype=jnp.int32),
                  policy_version=jnp.zeros(b, jnp.int32), newest_version=jnp.zeros(b, jnp.int32), truncated=jnp.zeros(b, bool))
  step = train_step.make_train_step(graphdef, opt, algo, 1.0)
  temp = {}
  for n, place in ((1, True), (8, True), (8, False)):
    mesh = sharding.make_mesh(data=n, fsdp=1, tensor=1, devices=jax.devices()[:n])
    state = train_step.init_train_state(graphdef, sharding.shard_params(params, mesh), opt, algo)
    placed = sharding.shard_batch(batch, mesh)
    plan = step.plan_batch(attn, multiple=sharding.batch_shards(mesh))
    plan = sharding.place_rows(plan, mesh) if place else jax.tree.map(jnp.asarray, plan)
    w, s = jnp.ones(b), jnp.zeros(b, jnp.int32)
    compiled = jax.jit(lambda st, bt, pl: step(st, bt, w, s, plan=pl)).lower(
        state, placed, plan).compile()
    temp[n, place] = compiled.memory_analysis().temp_size_in_bytes
  assert temp[8, True] < temp[1, True] / 4, temp
  assert temp[8, False] > 2 * temp[8, True], temp


# --- shared prompts (algo.share_prompts) and scored slots ------------------------------------

def _grouped_batch(graphdef, params, g=3):
  """B = 8 rows in groups sharing a prompt (rows 0-2, 3-5, 6-7 when g = 3), as a rollout."""
  group = np.arange(B) // g
  prompt_lens = np.array([3, 2, 4])[group]
  comp_lens = np.array([5, 1, 3, 6, 0, 2, 4, 6])
  attn, comp = layout(prompt_lens, comp_lens, P, M)
  rand = np.asarray(jax.random.randint(jax.random.key(3), (B, T), 1, CFG.vocab_size))
  tokens = np.where(np.arange(T) < P, rand[group * g], rand) * attn  # equal prompts per group
  tokens = jnp.asarray(tokens, jnp.int32)
  logp, _ = token_logprobs(graphdef, params, tokens, jnp.asarray(attn))
  mu = jnp.where(comp, logp + 0.3 * jax.random.normal(jax.random.key(4), (B, T)), 0.0)
  return Rollout(tokens=tokens, attention_mask=jnp.asarray(attn),
                 completion_mask=jnp.asarray(comp), behaviour_logprobs=mu,
                 rewards=jnp.asarray(np.arange(B) % 2, jnp.float32),
                 advantages=jnp.linspace(-1.0, 1.0, B), group_id=jnp.asarray(group, jnp.int32),
                 policy_version=jnp.zeros(B, jnp.int32), newest_version=jnp.zeros(B, jnp.int32),
                 truncated=jnp.asarray(comp_lens == M))


def test_shared_prompt_plan_by_hand():
  """Two rows with the prompt [5, 6] and completions [7, 8] and [9]: one copy of the prompt
  (segment 1), then each completion (segments 2, 3) whose prefix is segment 1; positions
  continue from the prompt; the second completion's first token is predicted from the
  prompt's last slot, and both rows' prompt columns unpack from the shared slots."""
  tokens = np.array([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0]])
  attn = tokens > 0
  comp = attn & (np.arange(5) >= 3)
  plan = jax.tree.map(lambda x: x[0, 0], packing.plan_batch(
      attn, completion_bt=comp, tokens_bt=tokens, share_prompts=True, quantum=8))
  assert plan.src.shape == (1, 5)  # R = 1 row of W = T = 5: 2 + 2 + 1 tokens
  np.testing.assert_array_equal(tokens.reshape(-1)[plan.src[0]], [5, 6, 7, 8, 9])
  np.testing.assert_array_equal(plan.segment_ids[0], [1, 1, 2, 2, 3])
  np.testing.assert_array_equal(plan.prefix_ids[0], [1, 1, 1, 1, 1])
  np.testing.assert_array_equal(plan.positions[0], [0, 1, 2, 3, 2])
  np.testing.assert_array_equal(plan.dst, [[0, 0, 1, 2, 3], [0, 0, 1, 4, 0]])
  np.testing.assert_array_equal(plan.keep, [[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]])
  # scored: the completion tokens at slots 2, 3, 4, predicted from slots 1, 2 and 1
  np.testing.assert_array_equal(plan.score_slot, [[2, 3, 4]])
  np.testing.assert_array_equal(plan.score_pred, [[1, 2, 1]])
  # without sharing: the two sequences end to end, each completion predicted by its own past
  flat = jax.tree.map(lambda x: x[0, 0], packing.plan_batch(attn, completion_bt=comp,
                                                            quantum=8))
  assert flat.prefix_ids is None
  np.testing.assert_array_equal(tokens.reshape(-1)[flat.src] * flat.mask,
                                [[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])  # two rows: 4 + 3 > 5
  # one block of both rows (flat slots r · 5 + s): 2, 3 in row 0, 2 in row 1; N rounded up
  # to a multiple of 10 / 8 -> 2 slots
  np.testing.assert_array_equal(flat.score_slot, [[2, 3, 7, 0]])
  np.testing.assert_array_equal(flat.score_pred, [[1, 2, 6, 0]])
  np.testing.assert_array_equal(flat.score_valid, [[True, True, True, False]])
  # two blocks (two batch devices): one row each, the shorter block padded
  two = jax.tree.map(lambda x: x[0, 0], packing.plan_batch(attn, completion_bt=comp,
                                                           multiple=2, quantum=8))
  np.testing.assert_array_equal(two.score_slot, [[2, 3], [2, 0]])
  np.testing.assert_array_equal(two.score_valid, [[True, True], [True, False]])


def test_shared_units_split_to_fit_the_width():
  """Four samples of a 3-token prompt with 4-token completions: 3 + 4·4 = 19 tokens do not
  fit a width of 12, so the group splits in row order into units of 3 + 2·4 = 11."""
  attn = np.ones((4, 7), bool)
  comp = np.arange(7) >= 3
  comp = np.broadcast_to(comp, (4, 7))
  tokens = np.tile(np.array([1, 2, 3, 4, 5, 6, 7]), (4, 1))
  units, lengths = packing.shared_units(attn, comp, tokens, 12)
  assert units == [(0, 1), (2, 3)]
  np.testing.assert_array_equal(lengths, [11, 11])
  # a different prompt token makes its own unit; a row without completion is alone
  tokens[3, 0] = 9
  comp = comp.copy()
  comp[2] = False
  units, lengths = packing.shared_units(attn, comp, tokens, 12)
  assert units == [(0, 1), (2,), (3,)]
  np.testing.assert_array_equal(lengths, [11, 7, 7])


@pytest.mark.numerics
@pytest.mark.parametrize("algo", [
    dict(),
    dict(aggregation="seq_mean_token_mean", grad_accum_steps=2, logprob_chunk=3,
         kl_coef=0.05),
], ids=["token_mean", "seq_mean_accum_chunk_kl"])
def test_shared_prompts_train_step_equals_full_width(logp_atol, algo):
  """Packing a group's prompt once changes only the float rounding: loss, entropy, gradient
  norm and the updated parameters equal the full-width step's, and the packed rows hold
  fewer tokens than packing each sequence whole."""
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  batch = _grouped_batch(graphdef, params)
  algo = dict(algo, warmup_steps=0, lr_schedule="constant", lr=1e-2, staleness_buckets=(0,))
  n_tok = int(np.asarray(batch.completion_mask).sum())
  n_grad = 2 * N_FWD + B * T

  def run(**kw):
    spec = AlgoSpec.from_config(dict(algo, **kw))
    opt = train_step.make_optimizer(spec, 10)
    step = train_step.make_train_step(graphdef, opt, spec, 1.0)
    state = train_step.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
    return step(state, batch), step

  (s_f, m_f), _ = run(pack_sequences=False)
  (s_p, m_p), step = run(share_prompts=True)
  with abs_terms():
    (_, m_abs), _ = run(pack_sequences=False)
  attn, comp = np.asarray(batch.attention_mask), np.asarray(batch.completion_mask)
  shared = step.plan_batch(attn, completion=comp, tokens=np.asarray(batch.tokens))
  # rows 0-1 share their 3-token prompt (3 + 5 + 1 ≤ T = 10; row 2's 3 more would not fit),
  # rows 3 and 5 their 2 tokens (row 4 has no completion); rows 6-7 do not fit one row
  # (4 + 4 + 6 > 10): 3 + 2 tokens fewer
  assert int((shared.segment_ids > 0).sum()) == attn.sum() - 5
  for key in ("loss", "pg_loss"):
    atol = float(m_abs[key]) * (logp_atol + reorder_tol(n_tok))
    np.testing.assert_allclose(float(m_p[key]), float(m_f[key]), rtol=0, atol=atol, err_msg=key)
  np.testing.assert_allclose(float(m_p["entropy"]), float(m_f["entropy"]),
                             rtol=reorder_tol(n_tok), atol=logp_atol)
  n_params = sum(x.size for x in jax.tree.leaves(s_f.params))
  np.testing.assert_allclose(float(m_p["grad_norm"]), float(m_f["grad_norm"]),
                             rtol=reorder_tol(n_grad + n_params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=2 * reorder_tol(2), atol=2 * algo["lr"] * reorder_tol(n_grad)),
      s_p.params, s_f.params)


def test_share_prompts_needs_packing_and_no_value_head():
  with pytest.raises(ValueError, match=r"algo\.share_prompts=True.*pack_sequences=True"):
    AlgoSpec.from_config({"share_prompts": True, "pack_sequences": False})
  with pytest.raises(ValueError, match=r"algo\.share_prompts=True.*advantage='gae'"):
    AlgoSpec.from_config({"share_prompts": True, "advantage": "gae"})


@pytest.mark.numerics
def test_shared_prompts_on_eight_devices_equal_one(logp_atol):
  """The shared-prompt plan with its scored slots in one block per device (``multiple=8``,
  rows placed over the data axis) gives the step one device gives (blocks of one)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices; see tests/conftest.py")
  from jaxreplay.parallel import sharding
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  batch = _grouped_batch(graphdef, params)
  spec = AlgoSpec.from_config(dict(share_prompts=True, warmup_steps=0, lr=1e-2,
                                   lr_schedule="constant", staleness_buckets=(0,)))
  opt = train_step.make_optimizer(spec, 10)
  step = train_step.make_train_step(graphdef, opt, spec, 1.0)
  host = [np.asarray(x) for x in (batch.attention_mask, batch.completion_mask, batch.tokens)]
  out = {}
  for n in (1, 8):
    mesh = sharding.make_mesh(data=n, fsdp=1, tensor=1, devices=jax.devices()[:n])
    plan = step.plan_batch(host[0], multiple=n, completion=host[1], tokens=host[2])
    assert plan.score_slot.shape[-2] == n and plan.prefix_ids is not None
    fresh = jax.tree.map(jnp.copy, params)  # the step donates its state
    state = train_step.init_train_state(graphdef, sharding.shard_params(fresh, mesh), opt, spec)
    with jax.set_mesh(mesh):
      out[n] = step(state, sharding.shard_batch(batch, mesh), None, None,
                    sharding.place_rows(plan, mesh))
  (s1, m1), (s8, m8) = out[1], out[8]
  n_tok = int(host[1].sum())
  np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=reorder_tol(n_tok),
                             atol=logp_atol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=2 * reorder_tol(2),
      atol=2 * 1e-2 * reorder_tol(2 * N_FWD + B * T)), s8.params, s1.params)


def test_plan_into_a_compiled_larger_shape_by_hand(setup):
  """``plan_batch(shape=...)`` packs the batch at a given (S, R, W, N): the same bins over
  its steps and rows, with more empty slots and here an empty step; too small raises."""
  _, _, batch = setup
  attn, comp = np.asarray(batch.attention_mask), np.asarray(batch.completion_mask)
  own = packing.plan_batch(attn, 1, 2, completion_bt=comp)
  # 8 sequences of 10, 3, 6, 1, 6, 7, 7, 5 tokens at W = T = 10: 6 bins {10}, {7, 3},
  # {7, 1}, {6}, {6}, {5}; a step holds 4 rows unpacked, so 2 steps of R = 3. The steps
  # score 6 + 5 + 1 + 4 and 3 + 2 + 1 completion tokens: N = 16 (a multiple of 30 / 8)
  assert packing.plan_shape(own) == packing.PlanShape(2, 3, 10, 16, 1)
  big = packing.PlanShape(steps=3, rows=4, width=10, scored=40)
  plan = packing.plan_batch(attn, 1, 2, completion_bt=comp, shape=big)
  assert packing.plan_shape(plan) == big
  rows = lambda p: sorted(map(tuple, p.src[p.segment_ids.any(-1)].tolist()))  # noqa: E731
  assert rows(plan) == rows(own)  # the same 6 bins: 4 in step 0, 2 in step 1, none in 2
  assert plan.segment_ids[0, 0].any(-1).tolist() == [True] * 4
  assert plan.segment_ids[0, 1].any(-1).tolist() == [True, True, False, False]
  assert not plan.keep[0, 2].any() and not plan.score_valid[0, 2].any()
  assert plan.score_valid[0].sum() == own.score_valid[0].sum() == 22
  with pytest.raises(ValueError, match="needs 6 packed rows of width 10"):
    packing.plan_batch(attn, 1, 2, completion_bt=comp, shape=packing.PlanShape(1, 4, 10, 40))
  with pytest.raises(ValueError, match="lengths must be in"):  # a 10-token sequence
    packing.plan_batch(attn, 1, 2, completion_bt=comp, shape=packing.PlanShape(2, 8, 8, 40))
  with pytest.raises(ValueError, match="scored=8 must hold the 16 scored slots"):
    packing.plan_batch(attn, 1, 2, completion_bt=comp, shape=packing.PlanShape(2, 3, 10, 8))


@pytest.mark.numerics
@pytest.mark.parametrize("share", [False, True], ids=["sequences", "shared_prompts"])
def test_train_step_in_a_larger_shape_equals_its_own(logp_atol, share):
  """A batch run in a compiled larger shape (``train.compile_cost_steps``: a wider row, more
  rows, scored slots and an empty second step) takes the step its own shape takes, up to
  float rounding."""
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  batch = _grouped_batch(graphdef, params)
  spec = AlgoSpec.from_config(dict(share_prompts=share, grad_accum_steps=2, warmup_steps=0,
                                   lr=1e-2, lr_schedule="constant", staleness_buckets=(0,)))
  opt = train_step.make_optimizer(spec, 10)
  step = train_step.make_train_step(graphdef, opt, spec, 1.0)
  host = dict(completion=np.asarray(batch.completion_mask), tokens=np.asarray(batch.tokens))
  attn = np.asarray(batch.attention_mask)
  own = step.plan_batch(attn, **host)
  s, r, w, n, g = packing.plan_shape(own)
  big = packing.PlanShape(s + 1, r + 2, T, 2 * n, g)
  assert (s, w) != (big.steps, big.width)
  out = []
  for plan in (own, step.plan_batch(attn, shape=big, **host)):
    state = train_step.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
    out.append(step(state, batch, None, None, plan))
  (s1, m1), (s2, m2) = out
  n_tok = int(host["completion"].sum())
  for key in ("loss", "pg_loss", "entropy"):
    np.testing.assert_allclose(float(m2[key]), float(m1[key]), rtol=reorder_tol(n_tok),
                               atol=logp_atol, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=2 * reorder_tol(2), atol=2 * 1e-2 * reorder_tol(2 * N_FWD + B * T)),
      s2.params, s1.params)
