"""bfloat16 and the importance ratio at identical parameters (``bench/bf16_ratio.py``).

The sampler's cached decode and the learner's full forward round differently in bfloat16:
fresh rollouts get ratios ≠ 1 with no parameter change, while float32 agrees to rounding.
``rollout.behaviour_logprobs='learner'`` rescores the rollouts with the learner's own function
(same chunking and micro-batch rows as the train step), and the train step's first update
then sees ratio exactly 1."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward_terms, load_bench, reorder_tol
from flax import nnx

from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl.scoring import micro_batch_rows
from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
from jaxreplay.rollout import Rollout
from jaxreplay.sampling import generate
from jaxreplay.train.generation import learner_behaviour_logprobs

CFG = TransformerConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128)
B, P, M = 8, 6, 10


def _bench():
  return load_bench("bf16_ratio")


@pytest.fixture(scope="module")
def policy():
  graphdef, params = nnx.split(Transformer(CFG, nnx.Rngs(0)), nnx.Param)
  prompts = np.asarray(jax.random.randint(jax.random.key(1), (B, P), 1, CFG.vocab_size),
                       np.int32)
  mask = np.ones((B, P), bool)
  mask[0, :2] = False  # a left-padded row
  return graphdef, params, prompts, mask


def test_ratio_stats_by_hand():
  x = np.array([[0.0, np.log(1.5), 0.1], [np.log(0.5), 0.0, 9.0]])
  mask = np.array([[False, True, True], [True, True, False]])
  s = _bench().ratio_stats(x, mask)
  xs = np.array([np.log(1.5), 0.1, np.log(0.5), 0.0])
  assert s["tokens"] == 4
  assert s["std"] == pytest.approx(xs.std())
  assert s["max_abs"] == pytest.approx(np.log(2))
  assert s["out_of_clip"] == 0.5  # 1.5 and 0.5 leave [0.8, 1.2]; e^0.1 = 1.105 does not
  assert s["kl_k3"] == pytest.approx(np.mean(np.expm1(xs) - xs))
  assert s["seq_std"] == pytest.approx(np.std([np.log(1.5) + 0.1, np.log(0.5)]))


@pytest.mark.slow
@pytest.mark.numerics
def test_float32_agrees_bfloat16_does_not_and_recompute_makes_it_exact(policy):
  bench = _bench()
  graphdef, params, prompts, mask = policy
  out = {}
  for name, recompute in (("float32", False), ("bf16", False), ("bf16", True)):
    g, p = bench.with_numerics(graphdef, params, *bench.SETTINGS[name])
    out[name, recompute] = bench.measure(g, p, prompts, mask, jax.random.key(2),
                                         max_new_tokens=M, temperature=1.0, eos_ids=(0,),
                                         pad_id=0, recompute=recompute)
  f32, bf16, exact = out["float32", False], out["bf16", False], out["bf16", True]
  assert f32["tokens"] == bf16["tokens"] > 0
  # float32: the cache and the full forward reorder the chain (conftest.logprob_tol, with the
  # largest |logit| over the prompts); bfloat16 differs by more than that
  logits = nnx.merge(graphdef, params)(jnp.asarray(prompts), jnp.asarray(mask))
  f32_tol = 2 * reorder_tol(forward_terms(CFG, P + M), scale=float(jnp.abs(logits).max()))
  assert f32["max_abs"] < f32_tol
  assert bf16["std"] > 30 * f32["std"] and bf16["max_abs"] > f32_tol
  assert exact["std"] == exact["max_abs"] == 0.0


@pytest.mark.slow
def test_learner_rescoring_gives_the_train_step_ratio_one_in_bfloat16(policy):
  graphdef, params, prompts, mask = policy
  cfg = dataclasses.replace(nnx.merge(graphdef, params).cfg, dtype="bfloat16")
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)[0]
  gen = generate(graphdef, params, prompts, mask, jax.random.key(3), max_new_tokens=M,
                 temperature=1.0, eos_ids=(0,), pad_id=0)
  comp = jnp.concatenate([jnp.zeros((B, P), bool), gen.mask], 1)
  rollout = Rollout(
      tokens=jnp.concatenate([jnp.asarray(prompts), gen.tokens], 1),
      attention_mask=jnp.concatenate([jnp.asarray(mask), gen.mask], 1), completion_mask=comp,
      behaviour_logprobs=jnp.concatenate([jnp.zeros((B, P)), gen.logprobs], 1),
      rewards=jnp.arange(B, dtype=jnp.float32) % 2,
      advantages=jnp.where(jnp.arange(B) % 2 == 1, 1.0, -1.0),
      group_id=jnp.zeros((B,), jnp.int32), policy_version=jnp.zeros((B,), jnp.int32), newest_version=jnp.zeros((B,), jnp.int32),
      truncated=gen.truncated)
  algo = dict(grad_accum_steps=2, logprob_chunk=3, warmup_steps=0, lr_schedule="constant")
  rows = micro_batch_rows(B, algo)
  assert rows == B // 2
  logp, numerics = learner_behaviour_logprobs(graphdef, params, rollout, temperature=1.0,
                                              chunk=3, rows=rows)
  x = np.asarray(jnp.where(comp, logp - rollout.behaviour_logprobs, 0.0))
  assert numerics["behaviour_max_abs_log_ratio"] == pytest.approx(np.abs(x).max())
  assert numerics["behaviour_max_abs_log_ratio"] > 1e-4 and numerics["behaviour_kl_sampler"] > 0
  assert np.all(np.asarray(logp)[~np.asarray(comp)] == 0)

  opt = make_optimizer(algo, 10)
  step = make_train_step(graphdef, opt, algo, 1.0)
  ratio = {}
  for name, r in (("sampler", rollout), ("learner", rollout.replace(behaviour_logprobs=logp))):
    state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, algo)
    _, m = step(state, r)
    ratio[name] = float(m["ratio_min"]), float(m["ratio_max"])
  assert ratio["learner"] == (1.0, 1.0)
  assert ratio["sampler"][0] < 1.0 < ratio["sampler"][1]
