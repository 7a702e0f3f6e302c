"""Full-sequence attention through fused kernels (models/attention.py): the TPU splash
kernel run in Pallas interpret mode and cuDNN's fused attention (which this CPU host can
only lower, not run) against the XLA reference, in the model, under a mesh, and as
exported accelerator programs."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxreplay.models import attention
from jaxreplay.models.spec import ModelSpec
from jaxreplay.models.transformer import Transformer, TransformerConfig
from jaxreplay.parallel import sharding
from jaxreplay.sampling import engine
from jaxreplay.train.warmstart import builtin_model_config, model_attention

B, T, H, K, E = 2, 200, 4, 2, 64  # T not a multiple of splash's 128-position block


def _ours(caplog):
  return [r for r in caplog.records if r.name == attention.__name__]


def _qkv(dtype=jnp.float32, b=B, t=T, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, E)), dtype) for n in (H, K, K))
  return q, k, v


def _packed_segments():
  """Row 0: three sequences (80, 70, 40 tokens) then 10 padding; row 1: one of 195."""
  seg = np.full((B, T), -1, np.int32)
  seg[0, :80], seg[0, 80:150], seg[0, 150:190] = 1, 2, 3
  seg[1, :195] = 1
  return jnp.asarray(seg)


def _reference(q, k, v, seg):
  """Dense float64 causal attention within segments, grouped-query (head h reads h // G)."""
  q, k, v, seg = (np.asarray(x, np.float64) for x in (q, k, v, seg))
  out = np.zeros(q.shape)
  g = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for t in range(q.shape[1]):
      vis = (np.arange(q.shape[1]) <= t) & (seg[b] == seg[b, t])
      for h in range(q.shape[2]):
        logits = k[b, vis, h // g] @ q[b, t, h] * E ** -0.5
        w = np.exp(logits - logits.max())
        out[b, t, h] = (w / w.sum()) @ v[b, vis, h // g]
  return out


def test_resolve_picks_the_platform_kernel(caplog):
  assert [attention.resolve("auto", p) for p in ("gpu", "cuda", "tpu", "cpu")] == [
      "cudnn", "cudnn", "splash", "xla"]
  assert attention.resolve("xla", "tpu") == "xla"
  assert attention.resolve("pallas", "tpu") == "splash"
  attention._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    assert attention.resolve("pallas", "cpu") == "xla"
    assert attention.resolve("pallas", "cpu") == "xla"
  assert len(_ours(caplog)) == 1
  with pytest.raises(ValueError, match=r"model\.attention.*'auto', 'xla', 'pallas'.*'flash'"):
    attention.resolve("flash", "gpu")
  # the model section resolves on this process's backend: XLA on the CPU
  assert model_attention(ModelSpec()) == "xla"
  assert builtin_model_config(ModelSpec(attention="pallas")).attention == "xla"
  with pytest.raises(ValueError, match="attention='flash' is invalid"):
    TransformerConfig(vocab_size=8, attention="flash")


@pytest.mark.numerics
@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_packed_segments_match_a_float64_reference(impl, caplog):
  q, k, v = _qkv()
  seg = _packed_segments()
  attention._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    out = np.asarray(jax.jit(lambda *a: attention.causal_attention(*a[:3], impl=impl,
                                                                   segment_ids=a[3]))(q, k, v, seg))
  assert not _ours(caplog)  # the kernel took the shape
  real = np.asarray(seg) >= 0
  ref = _reference(q, k, v, seg)
  # float32 inputs, float32 softmax: both within 1e-5 of the exact value
  np.testing.assert_allclose(out[real], ref[real], atol=1e-5)


@pytest.mark.numerics
def test_splash_matches_xla_in_bfloat16_and_in_gradients():
  q, k, v = _qkv()
  seg = _packed_segments()
  real = (np.asarray(seg) >= 0)[:, :, None, None]

  def loss(impl, q, k, v):
    out = attention.causal_attention(q, k, v, impl=impl, segment_ids=seg)
    return jnp.sum(jnp.where(real, out, 0.0).astype(jnp.float32) ** 2)

  grads = {impl: jax.jit(jax.grad(lambda *a, impl=impl: loss(impl, *a), argnums=(0, 1, 2)))(q, k, v)
           for impl in ("xla", "splash")}
  for gx, gs in zip(grads["xla"], grads["splash"]):
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gx), atol=2e-4, rtol=2e-4)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  outs = {impl: np.asarray(attention.causal_attention(qb, kb, vb, impl=impl, segment_ids=seg),
                           np.float32) for impl in ("xla", "splash")}
  # bfloat16 outputs of values ~1: within a few bfloat16 ulps (2^-8) of each other
  np.testing.assert_allclose(outs["splash"][real[..., 0, 0]], outs["xla"][real[..., 0, 0]],
                             atol=3e-2)


@pytest.mark.numerics
def test_prefill_lengths_path_matches_segments():
  q, k, v = _qkv(seed=1)
  lengths = jnp.asarray([200, 37], jnp.int32)
  ref = attention.causal_attention(q, k, v, impl="xla", lengths=lengths)
  out = attention.causal_attention(q, k, v, impl="splash", lengths=lengths)
  for b, n in enumerate([200, 37]):
    np.testing.assert_allclose(np.asarray(out[b, :n]), np.asarray(ref[b, :n]), atol=1e-5)
  with pytest.raises(ValueError, match="exactly one of segment_ids and lengths"):
    attention.causal_attention(q, k, v, impl="xla")


def test_unsupported_shapes_fall_back_to_xla_once(caplog):
  q, k, v = _qkv()
  seg = _packed_segments()
  ref = attention.causal_attention(q, k, v, impl="xla", segment_ids=seg)
  attention._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    # cuDNN takes no float32; in bfloat16 this host has no cuDNN at all
    out = attention.causal_attention(q, k, v, impl="cudnn", segment_ids=seg)
    attention.causal_attention(q, k, v, impl="cudnn", segment_ids=seg)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    attention.causal_attention(qb, kb, vb, impl="cudnn", segment_ids=seg)
    # splash is used for head sizes that are a multiple of 64
    small = attention.causal_attention(q[..., :32], k[..., :32], v[..., :32], impl="splash",
                                       segment_ids=seg)
  msgs = [r.getMessage() for r in _ours(caplog)]
  assert len(msgs) == 3, msgs
  assert "takes bfloat16/float16, not float32" in msgs[0]
  assert "cuDNN is not detected" in msgs[1]
  assert "multiple of 64, not 32" in msgs[2]
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  np.testing.assert_array_equal(
      np.asarray(small),
      np.asarray(attention.causal_attention(q[..., :32], k[..., :32], v[..., :32], impl="xla",
                                            segment_ids=seg)))


def _tiny(impl: str) -> Transformer:
  cfg = TransformerConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=H, n_kv_heads=K,
                          head_dim=E, d_ff=128, attention=impl)
  return Transformer(cfg, nnx.Rngs(0))


@pytest.mark.numerics
def test_model_hidden_and_prefill_are_the_same_through_splash():
  ref, fused = _tiny("xla"), _tiny("splash")
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(1, 64, (B, 150)), jnp.int32)
  seg = np.zeros((B, 150), np.int32)
  seg[0, :60], seg[0, 60:140] = 1, 2
  seg[1, :150] = 1
  pos = np.concatenate([np.arange(60), np.arange(80), np.zeros(10)]).astype(np.int32)
  positions = jnp.asarray(np.stack([pos, np.arange(150)]), jnp.int32)
  mask, seg = jnp.asarray(seg > 0), jnp.asarray(seg)
  hx = ref.hidden(tokens, mask, seg, positions)
  hs = fused.hidden(tokens, mask, seg, positions)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(hs)[real], np.asarray(hx)[real], atol=1e-4)
  # the learner's gradient through the kernel's backward pass
  def loss(model):
    h = model.hidden(tokens, mask, seg, positions)
    return jnp.sum(jnp.where(mask[..., None], h, 0.0) ** 2) / 1e3
  gx, gs = (nnx.grad(loss)(m) for m in (ref, fused))
  for a, b in zip(jax.tree.leaves(gx), jax.tree.leaves(gs)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-4, rtol=1e-3)
  # the sampler's prefill of right-padded prompts: keys, values and next-token logits
  lengths = jnp.asarray([150, 41], jnp.int32)
  kx, vx, lx = engine.prefill(ref, tokens, lengths)
  ks, vs, ls = engine.prefill(fused, tokens, lengths)
  np.testing.assert_allclose(np.asarray(ls), np.asarray(lx), atol=1e-4)
  np.testing.assert_allclose(np.asarray(ks[:, 1, :, :41]), np.asarray(kx[:, 1, :, :41]), atol=1e-4)
  np.testing.assert_allclose(np.asarray(vs[:, 0]), np.asarray(vx[:, 0]), atol=1e-4)


@pytest.mark.numerics
def test_splash_runs_per_device_under_the_learner_mesh():
  mesh = sharding.make_mesh(data=-1)
  rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
  q, k, v = _qkv(b=8, seed=3)
  seg = jnp.asarray(np.where(np.arange(T) < 170, 1, -1)[None].repeat(8, 0).astype(np.int32))
  f = jax.jit(lambda *a: attention.causal_attention(*a[:3], impl="splash", segment_ids=a[3]))
  with jax.set_mesh(mesh):
    out = f(*jax.device_put((q, k, v, seg), rows))
    hlo = f.lower(*jax.device_put((q, k, v, seg), rows)).as_text()
  ref = attention.causal_attention(q, k, v, impl="xla", segment_ids=seg)
  np.testing.assert_allclose(np.asarray(out)[:, :170], np.asarray(ref)[:, :170], atol=1e-5)
  assert "sdy.manual_computation" in hlo  # the kernel runs inside shard_map: no gather


# The 7B preset's attention widths (Qwen2.5-7B: 28 query heads, 4 KV heads, head size 128)
# at a 4,096-position learner row.
Q7 = dict(b=4, t=4096, h=28, k=4, e=128)


def _score_arrays(mlir: str):
  """Float tensor types holding a T × T block per head: a materialised score array. A
  [B, 1, T, T] bias (cuDNN's segment mask) holds one block per row, not per head."""
  t, b = Q7["t"], Q7["b"]
  out = []
  for dims in re.findall(r"tensor<((?:\d+x)+)(?:f32|bf16|f16)>", mlir):
    d = [int(x) for x in dims.rstrip("x").split("x")]
    if d.count(t) >= 2 and np.prod([x for x in d if x != t]) > b:
      out.append(dims)
  return out


def _export_learner_attention(impl, platform, lengths=False, **kw):
  b, t, h, kh, e = (Q7[x] for x in ("b", "t", "h", "k", "e"))
  sd = jax.ShapeDtypeStruct
  args = [sd((b, t, h, e), jnp.bfloat16), sd((b, t, kh, e), jnp.bfloat16),
          sd((b, t, kh, e), jnp.bfloat16)]
  if lengths:  # the prefill: forward only
    f = lambda q, k, v, n: attention.causal_attention(q, k, v, impl=impl, lengths=n)
    args.append(sd((b,), jnp.int32))
  else:  # the learner: forward and backward
    def f(q, k, v, seg):
      loss = lambda q, k, v: attention.causal_attention(q, k, v, impl=impl, segment_ids=seg
                                                        ).astype(jnp.float32).sum()
      return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    args.append(sd((b, t), jnp.int32))
  return jax.export.export(jax.jit(f), platforms=[platform], **kw)(*args).mlir_module()


def test_exported_programs_hold_the_fused_kernels_and_no_score_array(monkeypatch, caplog):
  # TPU: the Mosaic splash kernels (forward, dq, dkv), no per-head T × T array
  tpu = _export_learner_attention("splash", "tpu")
  assert tpu.count("tpu_custom_call") == 3
  assert _score_arrays(tpu) == []
  # the detector finds XLA's [4, 4, 7, 4096, 4096] scores
  assert "4x4x7x4096x4096x" in _score_arrays(_export_learner_attention("xla", "cpu"))
  # GPU: cuDNN's fused attention lowers from this host once jax's check for an installed
  # cuDNN is bypassed (the kernel itself is chosen on the GPU at compile time)
  import jax._src.cudnn.fused_attention_stablehlo as fused
  monkeypatch.setattr(fused, "check_cudnn_version", lambda: 90800)
  checks = tuple(jax.export.DisabledSafetyCheck.custom_call(c) for c in attention.CUDNN_TARGETS)
  attention._WARNED.clear()
  with caplog.at_level(logging.WARNING, logger=attention.__name__):
    gpu = _export_learner_attention("cudnn", "cuda", disabled_checks=checks)
    prefill = _export_learner_attention("cudnn", "cuda", lengths=True, disabled_checks=checks)
  assert not _ours(caplog)  # no fallback
  assert set(re.findall(r"@(__cudnn\$\w+)", gpu)) == {"__cudnn$fmhaScaleBiasSoftmax",
                                                       "__cudnn$fmhaScaleBiasSoftmaxBackward"}
  assert _score_arrays(gpu) == []
  assert set(re.findall(r"@(__cudnn\$\w+)", prefill)) == {"__cudnn$fmhaSoftmax"}
  assert _score_arrays(prefill) == []
  # export refuses cuDNN's calls without the disabled checks (no compatibility guarantee)
  with pytest.raises(ValueError, match="no compatibility guarantees"):
    _export_learner_attention("cudnn", "cuda", lengths=True)


def test_splash_runs_per_device_in_jits_without_a_context_mesh():
  """The sampler's prefill (engine._insert) and the learner-side scorers run over a mesh
  without ``jax.set_mesh``: given the mesh (``kernel_mesh``), the TPU program splits the
  Mosaic kernel per device; without it XLA refuses to partition the kernel."""
  cfg = TransformerConfig(vocab_size=32, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=64, d_ff=64, attention="splash")
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  mesh = sharding.make_mesh(data=-1)
  rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sd = jax.ShapeDtypeStruct
  args = (jax.tree.map(lambda x: sd(x.shape, x.dtype, sharding=whole), params),
          sd((8, 128), jnp.int32, sharding=rows), sd((8,), jnp.int32, sharding=rows))

  def export(with_mesh):
    f = lambda p, t, n: engine.prefill(nnx.merge(graphdef, p), t, n,
                                       mesh if with_mesh else None)[2]
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()

  tpu = export(True)
  assert "tpu_custom_call" in tpu and "sdy.manual_computation" in tpu
  with pytest.raises(NotImplementedError, match="cannot be automatically partitioned"):
    export(False)
  # a wrapped learner-side function: the same, through with_kernel_mesh
  score = lambda p, t, n: nnx.merge(graphdef, p).hidden(t, jnp.arange(128)[None] < n[:, None])
  wrapped = attention.with_kernel_mesh(
      lambda *a: jax.export.export(jax.jit(score), platforms=["tpu"])(*a).mlir_module(), mesh)
  assert "sdy.manual_computation" in wrapped(*args)
  assert attention.with_kernel_mesh(score, None) is score


@pytest.mark.numerics
def test_splash_splits_heads_over_the_tensor_axis():
  mesh = sharding.make_mesh(data=2, tensor=4)
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((4, 130, 8, E)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((4, 130, 4, E)), jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.where(np.arange(130) < 100, 3, -7)[None].repeat(4, 0).astype(np.int32))
  f = jax.jit(lambda *a: attention.causal_attention(*a[:3], impl="splash", segment_ids=a[3]))
  with jax.set_mesh(mesh):
    out = f(q, k, v, seg)
    hlo = f.lower(q, k, v, seg).as_text()
  ref = attention.causal_attention(q, k, v, impl="xla", segment_ids=seg)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  # each device holds 2 of the 8 query heads and 1 of the 4 KV heads
  assert re.search(r"manual_computation.*tensor<2x130x2x64xf32>", hlo, re.S)


@pytest.mark.numerics
def test_padding_is_a_segment_no_real_token_has():
  """Real tokens with segment id -1 (any id but int32's minimum) never see padding."""
  ref, fused = _tiny("xla"), _tiny("splash")
  tokens = jnp.asarray(np.random.default_rng(5).integers(1, 64, (1, 40)), jnp.int32)
  mask = jnp.asarray(np.arange(40) >= 4)[None]  # 4 left-padding positions
  seg = jnp.full((1, 40), -1, jnp.int32)
  positions = jnp.maximum(jnp.arange(40) - 4, 0)[None].astype(jnp.int32)
  hx = ref.hidden(tokens, mask, seg, positions)
  hs = fused.hidden(tokens, mask, seg, positions)
  np.testing.assert_allclose(np.asarray(hs)[0, 4:], np.asarray(hx)[0, 4:], atol=1e-4)
