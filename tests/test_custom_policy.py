"""Your own model: a policy that implements only ``__call__`` trains through
``make_train_step`` with the default ``algo.pack_sequences=True`` — unpacked, after one line
at build time naming what packing needs — and ``algo.logprob_chunk > 0``, which cannot fall
back, stops at build time with one line naming what is missing."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.rl import train_step as ts
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout

V, D, B, T = 16, 8, 4, 6


class CallOnly(nnx.Module):
  """A bigram policy: ``__call__(tokens [B, T] int32, mask [B, T] bool) -> [B, T, V]
  float32`` logits, and nothing else."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.out = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, attention_mask):
    return self.out(self.embed(tokens))


class HiddenOnly(CallOnly):
  """Has ``hidden`` but no ``project_logits``."""

  def hidden(self, tokens, attention_mask):
    return self.embed(tokens)


def _batch():
  attn = np.ones((B, T), bool)
  comp = np.zeros((B, T), bool)
  comp[:, 2:] = True
  tokens = jax.random.randint(jax.random.key(1), (B, T), 1, V)
  return Rollout(tokens=tokens, attention_mask=jnp.asarray(attn),
                 completion_mask=jnp.asarray(comp),
                 behaviour_logprobs=jnp.where(comp, -2.0, 0.0).astype(jnp.float32),
                 rewards=jnp.asarray([1.0, 0.0, 1.0, 0.0]),
                 advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5]),
                 group_id=jnp.arange(B, dtype=jnp.int32) // 2,
                 policy_version=jnp.zeros(B, jnp.int32), newest_version=jnp.zeros(B, jnp.int32),
                 truncated=jnp.zeros(B, bool))


def _one_step(module, **algo):
  graphdef, params = nnx.split(module, nnx.Param)
  spec = AlgoSpec(warmup_steps=0, **algo)  # the first step moves the parameters
  opt = ts.make_optimizer(spec, 100)
  state = ts.init_train_state(graphdef, params, opt, spec)
  before = jax.tree.map(np.asarray, state.params)
  step = ts.make_train_step(graphdef, opt, spec, temperature=1.0)
  state, metrics = step(state, _batch())
  return before, state, metrics, step


def _notices(caplog):
  return [r.getMessage() for r in caplog.records if "pack_sequences" in r.getMessage()]


def test_a_policy_with_only_call_trains_unpacked_after_a_one_line_notice(caplog):
  assert AlgoSpec().pack_sequences  # the default packs
  assert ts.missing_methods(nnx.graphdef(CallOnly(nnx.Rngs(0)))) == ("hidden",
                                                                     "project_logits")
  with caplog.at_level(logging.WARNING):
    before, state, metrics, step = _one_step(CallOnly(nnx.Rngs(0)))
  assert _notices(caplog) == ["the policy CallOnly lacks hidden and project_logits, which "
                              "algo.pack_sequences needs: training unpacked "
                              "(algo.pack_sequences=False)"]
  assert not hasattr(step, "plan_batch")  # the unpacked jitted step
  assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before)
  assert max(jax.tree.leaves(moved)) > 0  # the update reached the parameters
  # the same update as asking for the unpacked learner, which logs nothing
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    _, unpacked, _, _ = _one_step(CallOnly(nnx.Rngs(0)), pack_sequences=False)
  assert _notices(caplog) == []
  jax.tree.map(np.testing.assert_array_equal, state.params, unpacked.params)


def test_chunked_log_probs_without_hidden_states_stop_at_build_time_in_one_line():
  module = HiddenOnly(nnx.Rngs(0))
  graphdef, params = nnx.split(module, nnx.Param)
  assert ts.missing_methods(graphdef) == ("project_logits",)
  spec = AlgoSpec(logprob_chunk=4)
  with pytest.raises(ValueError) as e:
    ts.make_train_step(graphdef, ts.make_optimizer(spec, 100), spec, temperature=1.0)
  assert str(e.value) == ("algo.logprob_chunk=4 needs the policy methods hidden and "
                          "project_logits; HiddenOnly lacks project_logits: implement them as "
                          "models.Transformer does, or set algo.logprob_chunk=0")


def test_the_transformer_stays_packed_without_a_notice(caplog):
  cfg = TransformerConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32)
  graphdef = nnx.graphdef(Transformer(cfg, nnx.Rngs(0)))
  assert ts.missing_methods(graphdef) == ()
  spec = AlgoSpec()
  with caplog.at_level(logging.WARNING):
    step = ts.make_train_step(graphdef, ts.make_optimizer(spec, 100), spec, temperature=1.0)
  assert hasattr(step, "plan_batch") and _notices(caplog) == []


class Packable(CallOnly):
  """Packs (``hidden`` with segments and positions, ``project_logits``) but has no
  ``prefix_ids``: it cannot share prompts."""

  def hidden(self, tokens, attention_mask, segment_ids=None, positions=None):
    return self.embed(tokens)

  def project_logits(self, h):
    return self.out(h)


def test_share_prompts_without_prefix_ids_packs_each_prompt_after_one_line(caplog):
  with caplog.at_level(logging.WARNING):
    _, state, metrics, step = _one_step(Packable(nnx.Rngs(0)), share_prompts=True)
  notes = [r.getMessage() for r in caplog.records if "share_prompts" in r.getMessage()]
  assert notes == ["the policy Packable's hidden() takes no prefix_ids, which "
                   "algo.share_prompts needs: packing each prompt with its rollout "
                   "(algo.share_prompts=False)"]
  assert not step.plan_batch.shares_prompts and int(state.step) == 1
  b = _batch()
  plan = step.plan_batch(np.asarray(b.attention_mask), completion=np.asarray(b.completion_mask))
  assert plan.prefix_ids is None and plan.score_slot is not None
  # a policy with only __call__ falls back to the unpacked learner, sharing off as well
  with caplog.at_level(logging.WARNING):
    _, state, _, step = _one_step(CallOnly(nnx.Rngs(0)), share_prompts=True)
  assert not hasattr(step, "plan_batch") and int(state.step) == 1
