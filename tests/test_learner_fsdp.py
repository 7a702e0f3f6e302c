"""The learner's compiled update on 8 fake devices is FSDP, read from its HLO.

A tiny scanned, rematerialised, packed and chunked model on a (1, 8, 1) mesh: each
layer's weights are all-gathered inside the layer scan once per layer and micro-batch
(forward and rematerialised backward); no activation wider than one log-prob chunk's
hidden states is all-reduced; no logits are; and all collective bytes stay within 1.5×
the FSDP analytic. ``jaxreplay.parallel.hlo`` reads the HLO; its own parsing is pinned on
a hand-written module.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay import replay
from jaxreplay.models import TransformerConfig
from jaxreplay.models import hf
from jaxreplay.parallel import hlo
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
from jaxreplay.rollout import empty_rollout
from jaxreplay.train.learner import make_learner_step

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

B, T, CHUNK, ACC = 32, 48, 8, 2
MODEL = TransformerConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=16, d_ff=256, tie_embeddings=False, dtype="bfloat16",
                          scan_layers=True, remat="full")
ALGO = dict(lr=1e-5, warmup_steps=0, lr_schedule="constant", grad_accum_steps=ACC, logprob_chunk=CHUNK, pack_sequences=True,
            num_minibatches=1)


def _ragged_mask(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(4, T, B)
  return np.arange(T)[None, :] < lengths[:, None]


def _placed(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _compiled_update(model=MODEL):
  """(optimized HLO text, abstract params) of the packed learner update on (1, 8, 1)."""
  mesh = sharding_lib.make_mesh(1, 8, 1)
  graphdef, params = hf.abstract_model(model)
  optimizer = make_optimizer(ALGO, 10)
  state = jax.eval_shape(lambda p: init_train_state(graphdef, p, optimizer, ALGO), params)
  state_sh = sharding_lib.param_shardings(state, mesh)
  state = _placed(state, state_sh)
  sample = jax.eval_shape(lambda: replay.SampleResult(
      items=empty_rollout(B, T), per_item=jnp.zeros((B, 4), jnp.int32),
      sampling=jnp.zeros((B, 2), jnp.float32)))
  sample = _placed(sample, jax.tree.map(
      lambda x: sharding_lib.batch_sharding(mesh, x.ndim, B), sample))
  train_step = make_train_step(graphdef, optimizer, ALGO, 1.0)
  rb = replay.make_replay_buffer(64, B, replay.SamplerConfig())
  step = make_learner_step(train_step, rb, mesh=mesh, state_sharding=state_sh)
  plan = sharding_lib.place_rows(train_step.plan_batch(_ragged_mask(), multiple=8), mesh)
  plan = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      plan)
  return step.lower_update(state, sample, plan).compile().as_text(), params


@pytest.fixture(scope="module")
def update_hlo():
  return _compiled_update()


def _layer_kernel_shapes(params):
  shapes = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if "blocks" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path):
      shapes.append(tuple(x.shape[1:]))
  return shapes


@needs_8
def test_each_layer_gathers_its_weights_in_the_scan(update_hlo):
  text, params = update_hlo
  gathered = {}
  for op in hlo.collectives(text):
    if op.kind == "all-gather":
      for _, dims in op.shapes:
        gathered[dims] = gathered.get(dims, 0) + op.count
  for dims in _layer_kernel_shapes(params):
    # forward and the rematerialised backward, every layer of every micro-batch
    n = gathered.get(dims, 0) + gathered.get(dims[::-1], 0)
    assert n >= 2 * MODEL.n_layers * ACC, (dims, n, sorted(gathered))


@needs_8
def test_no_activation_wider_than_a_chunk_is_all_reduced(update_hlo):
  text, params = update_hlo
  traffic = hlo.learner_traffic(text, hlo.param_sizes(params))
  # the hidden states of one log-prob chunk (the vocabulary-parallel head's input
  # gradient) are the widest activation a step may sum over devices
  assert traffic["largest_activation_allreduce"] <= B * CHUNK * MODEL.d_model
  assert traffic["param_allgather"] > 0


@needs_8
def test_logits_are_never_all_reduced(update_hlo):
  text, params = update_hlo
  sizes = hlo.param_sizes(params)  # the embedding's gradient has a V axis too
  for op in hlo.collectives(text):
    if op.kind == "all-reduce":
      assert all(MODEL.vocab_size not in dims for _, dims in op.shapes
                 if int(np.prod(dims)) not in sizes), op


@needs_8
def test_collective_bytes_within_the_fsdp_analytic(update_hlo):
  text, params = update_hlo
  param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
  fsdp = 3 * param_bytes * ACC  # gathered twice, reduce-scattered once, per micro-batch
  assert hlo.learner_traffic(text, hlo.param_sizes(params))["total"] <= 1.5 * fsdp


HAND_HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %ar = (f32[4,8], bf16[2]) all-reduce(%x, %x), replica_groups={{0,1}}, to_apply=%add
  %rs = f32[2,8] reduce-scatter(%x), replica_groups=[1,2]<=[2], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %x)
}

ENTRY %main (a: f32[4,8]) -> f32[8,8] {
  %a = f32[4,8] parameter(0)
  %w = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body
  ROOT %ag = f32[8,8] all-gather(%a), replica_groups={{0,1}}, dimensions={0}
}
"""


def test_collectives_count_loop_trips_and_bytes():
  ops = {op.kind: op for op in hlo.collectives(HAND_HLO)}
  assert ops["all-reduce"].count == 5  # the condition's bound: no known_trip_count here
  assert ops["all-reduce"].nbytes == 4 * 8 * 4 + 2 * 2
  assert ops["reduce-scatter"].nbytes == 2 * 8 * 4 * 2  # the whole input: output × group
  assert ops["all-gather"].count == 1 and ops["all-gather"].nbytes == 8 * 8 * 4
  assert hlo.bytes_by_kind(list(ops.values()))["all-reduce"] == 5 * (128 + 4)


def test_learner_traffic_splits_parameters_from_activations():
  traffic = hlo.learner_traffic(HAND_HLO, {64})  # an [8, 8] parameter
  assert traffic["param_allgather"] == 256
  assert traffic["activation_allreduce"] == 5 * (128 + 4)
  assert traffic["largest_activation_allreduce"] == 32


def _loss_and_grads(mesh):
  """(loss, gradient) of one packed, accumulated minibatch of a tiny scanned float32
  policy, on ``mesh`` (parameters by PARAM_RULES, rows over the batch axes, the model's
  FSDP constraints on) or on one device without a mesh."""
  from flax import nnx

  from jaxreplay.models import Transformer
  from jaxreplay.rl import packing, train_step
  from jaxreplay.rollout import Rollout
  from jaxreplay.train.learner import under_mesh
  cfg = dataclasses.replace(MODEL, vocab_size=128, d_model=32, d_ff=64, head_dim=8,
                            dtype="float32")
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  b, t = 16, 24
  rng = np.random.default_rng(1)
  attn = np.arange(t)[None] < rng.integers(3, t, b)[:, None]
  comp = attn & (np.arange(t)[None] >= 2)
  batch = Rollout(tokens=jnp.asarray(rng.integers(1, 128, (b, t)) * attn, jnp.int32),
                  attention_mask=jnp.asarray(attn), completion_mask=jnp.asarray(comp),
                  behaviour_logprobs=jnp.asarray(-rng.random((b, t)) * comp, jnp.float32),
                  rewards=jnp.zeros(b), advantages=jnp.linspace(-1.0, 1.0, b),
                  group_id=jnp.arange(b, dtype=jnp.int32), policy_version=jnp.zeros(b, jnp.int32),
                  newest_version=jnp.zeros(b, jnp.int32), truncated=jnp.zeros(b, bool))
  plan = jax.tree.map(lambda x: x[0], packing.plan_batch(attn, 1, ACC, multiple=8))
  grad_fn = train_step.make_grad_fn(graphdef, ALGO, 1.0)
  fn = jax.jit(lambda p, bt, pl: grad_fn(p, bt, jnp.ones(b), jnp.zeros(b, jnp.int32), None,
                                         None, None, pl))
  if mesh is not None:
    params = sharding_lib.shard_params(params, mesh)
    batch = sharding_lib.shard_batch(batch, mesh)
    plan = sharding_lib.place_rows(plan, mesh)
    fn = under_mesh(fn, mesh)
  (loss, _), grads = fn(params, batch, plan)
  return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
@needs_8
@pytest.mark.numerics
def test_fsdp_gradient_equals_one_device():
  loss_1, g_1 = _loss_and_grads(None)
  loss_8, g_8 = _loss_and_grads(sharding_lib.make_mesh(1, 8, 1))
  np.testing.assert_allclose(loss_8, loss_1, rtol=1e-5)
  # the same sums in another order over devices: float32 rounding of each entry's terms
  jax.tree.map(lambda a, c: np.testing.assert_allclose(
      a, c, rtol=1e-4, atol=1e-5 * float(np.abs(c).max())), g_8, g_1)
