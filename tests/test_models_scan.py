"""Scan over layers and rematerialisation (``model.scan_layers``, ``model.remat``): the scan
layout holds the loop layout's parameters stacked, gives the same logits, gradients and
KV-cache decode; the partition rules and the Hugging Face loader handle the stacked layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_terms, reorder_tol
from jaxreplay.models import hf
from jaxreplay.models.transformer import (Transformer, TransformerConfig, init_cache,
                                          stack_blocks, unstack_blocks)
from jaxreplay.parallel import sharding

B, T = 2, 6
LOOP = TransformerConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1,
                         head_dim=8, d_ff=32, qkv_bias=True, tie_embeddings=False,
                         scale_tied_logits=False)
SCAN = dataclasses.replace(LOOP, scan_layers=True)
# Scan, remat and the KV cache may reorder the forward chain (conftest.reorder_tol); a
# gradient runs it back as well and sums every position.
N_FWD = forward_terms(LOOP, T)
N_GRAD = 2 * N_FWD + B * T


@pytest.fixture(scope="module")
def models():
  loop = nnx.split(Transformer(LOOP, nnx.Rngs(0)))
  scan = nnx.split(Transformer(SCAN, nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 32)
  mask = jnp.ones((B, T), bool).at[0, 0].set(False)
  return loop, scan, tokens, mask


def assert_trees_close(a, b, **kw):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_scan_layout_is_the_loop_layout_stacked(models):
  (_, loop_p), (_, scan_p), _, _ = models
  q = scan_p["blocks"]["attn"]["q"]["kernel"][...]
  assert q.shape == (3, 16, 16)
  assert_trees_close(stack_blocks(loop_p, 3), scan_p, rtol=0, atol=0)
  assert_trees_close(unstack_blocks(scan_p), loop_p, rtol=0, atol=0)


def _loss_and_grad(models, cfg):
  (_, loop_p), (_, scan_p), tokens, mask = models
  w = jax.random.normal(jax.random.key(2), (B, T, 32))
  graphdef = nnx.graphdef(Transformer(cfg, nnx.Rngs(0)))

  def loss(params):
    return jnp.sum(w * jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens, mask)))

  return jax.jit(jax.value_and_grad(loss))(scan_p if cfg.scan_layers else loop_p)


def _max_abs(*arrays):
  return max(float(np.abs(np.asarray(a)).max()) for a in arrays)


@pytest.fixture(scope="module")
def loop_reference(models):
  return _loss_and_grad(models, LOOP)


# the presets' scan + full remat; a saving policy on the loop
@pytest.mark.numerics
@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "full"), (False, "dots_saveable")])
def test_scan_and_remat_give_the_loop_logits_and_gradients(models, loop_reference, scan, remat):
  l_ref, g_ref = loop_reference
  l, g = _loss_and_grad(models, dataclasses.replace(LOOP, scan_layers=scan, remat=remat))
  (_, loop_p), _, tokens, mask = models
  logits = nnx.merge(nnx.graphdef(Transformer(LOOP, nnx.Rngs(0))), loop_p)(tokens, mask)
  w = jax.random.normal(jax.random.key(2), (B, T, 32))
  terms = float(jnp.sum(jnp.abs(w * jax.nn.log_softmax(logits))))
  # the forward chain, then B·T·V terms of both signs: scale Σ|term|
  np.testing.assert_allclose(l, l_ref, rtol=0, atol=reorder_tol(N_FWD + B * T * 32, scale=terms))
  # entries near 0 are sums of per-position terms up to about the largest entry's size
  assert_trees_close(g, stack_blocks(g_ref, 3) if scan else g_ref, rtol=reorder_tol(N_GRAD),
                     atol=reorder_tol(N_GRAD, scale=_max_abs(*jax.tree.leaves(g_ref))))


@pytest.mark.numerics
def test_kv_cache_decode_is_the_same_with_scan(models):
  (loop_g, loop_p), (scan_g, scan_p), tokens, mask = models

  @jax.jit
  def prefill_then_decode(params_loop, params_scan):
    outs = []
    for graphdef, params in ((loop_g, params_loop), (scan_g, params_scan)):
      model = nnx.merge(graphdef, params)
      cache = init_cache(model.cfg, B, T + 2)
      pos = jnp.broadcast_to(jnp.arange(T), (B, T))
      logits, cache = model.step(tokens, pos, mask, cache, jnp.int32(0))
      nxt = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
      logits2, cache = model.step(nxt, pos[:, -1:] + 1, jnp.ones((B, 1), bool), cache,
                                  jnp.int32(T))
      outs.append((logits, logits2, cache.k))
    return outs

  (a1, a2, ak), (b1, b2, bk) = prefill_then_decode(loop_p, scan_p)
  # the forward chain, its terms about the size of the largest |value| (conftest.logprob_tol)
  logit_atol = reorder_tol(N_FWD, scale=_max_abs(a1, a2))
  np.testing.assert_allclose(b1, a1, rtol=0, atol=logit_atol)
  np.testing.assert_allclose(b2, a2, rtol=0, atol=logit_atol)
  np.testing.assert_allclose(bk, ak, rtol=0, atol=reorder_tol(N_FWD, scale=_max_abs(ak)))
  full = nnx.merge(loop_g, loop_p)(tokens, mask)
  np.testing.assert_allclose(a1[1], full[1], rtol=0, atol=logit_atol)  # the unpadded row


def test_stacked_parameters_shard_behind_the_layer_axis(models):
  _, (_, scan_p), _, _ = models
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
  assert sharding.spec_for("blocks/attn/q/kernel", (3, 16, 16), mesh) == \
      jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert sharding.spec_for("opt_state/1/0/mu/blocks/attn/q/kernel", (3, 16, 16), mesh) == \
      jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert sharding.spec_for("blocks/0/attn/q/kernel", (16, 16), mesh) == \
      jax.sharding.PartitionSpec("fsdp", "tensor")
  assert sharding.spec_for("blocks/attn_norm/scale", (3, 16), mesh) == \
      jax.sharding.PartitionSpec(None, None)
  placed = sharding.shard_params(scan_p, mesh)
  assert placed["blocks"]["mlp"]["down"]["kernel"][...].sharding.spec == \
      jax.sharding.PartitionSpec(None, "tensor", "fsdp")


def test_hf_checkpoint_loads_stacked_and_exports_per_layer(models, tmp_path):
  (_, loop_p), _, _, _ = models
  hf.save_pretrained(str(tmp_path), LOOP, loop_p)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  cfg, _, params = hf.from_pretrained(str(tmp_path), mesh=mesh, scan_layers=True, remat="full")
  assert cfg.scan_layers and cfg.remat == "full"
  assert_trees_close(params, stack_blocks(loop_p, 3), rtol=0, atol=0)
  k = params["blocks"]["attn"]["k"]["kernel"][...]
  assert k.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  names = dict(hf.to_hf_tensors(params))
  np.testing.assert_array_equal(names["model.layers.2.self_attn.k_proj.weight"],
                                np.asarray(loop_p["blocks"][2]["attn"]["k"]["kernel"][...]).T)


def test_bad_model_settings_fail_naming_the_field():
  with pytest.raises(ValueError, match=r"model\.remat='some' is invalid: must be one of"):
    dataclasses.replace(LOOP, remat="some")
  with pytest.raises(ValueError, match=r"model\.scan_layers=1 is invalid: must be a bool"):
    dataclasses.replace(LOOP, scan_layers=1)


def test_config_validation_names_the_model_field():
  import os

  from jaxreplay.config import ConfigError, load_config, validate
  cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "default.py"))
  cfg.model.remat = "everything"
  with pytest.raises(ConfigError,
                     match=r"config\.model\.remat='everything' is invalid: must be one"):
    validate(cfg, device_count=1)
  tree = cfg.to_dict()  # a ConfigDict refuses a str for its bool field by itself
  tree["model"].update(remat="full", scan_layers="yes")
  with pytest.raises(ConfigError,
                     match=r"config\.model\.scan_layers='yes' is invalid: must be a bool"):
    validate(tree, device_count=1)
