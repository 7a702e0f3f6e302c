"""A checkpoint written on 8 devices (mesh data=8) restores in a fresh process on 4 devices
(mesh data=4, and data=1 × fsdp=2 × tensor=2) and on 1 device, into abstract targets that
carry the new shardings: parameters, optimizer state, buffer and RNG are bit-identical."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import xla_flags
from jaxreplay import replay
from jaxreplay.models import Transformer, TransformerConfig
from jaxreplay.parallel import make_mesh, param_shardings
from jaxreplay.rl.train_step import init_train_state, scheduled_adamw
from jaxreplay.rollout import empty_rollout
from jaxreplay.train import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64)


def build():
  """Train state after 2 Adam updates, a buffer with 12 of 16 slots written, key(7) data."""
  graphdef, params = nnx.split(Transformer(MODEL, nnx.Rngs(3)), nnx.Param)
  opt = scheduled_adamw(1e-2, 0, 1.0)
  from jaxreplay.config import load_config
  algo = load_config(os.path.join(ROOT, "configs", "default.py")).algo
  state = init_train_state(graphdef, params, opt, algo)
  for i in range(2):
    grads = jax.tree.map(lambda p: jnp.sin(p + i), state.params)
    upd, opt_state = opt.update(grads, state.opt_state, state.params)
    state = state.replace(params=optax.apply_updates(state.params, upd), opt_state=opt_state,
                          step=state.step + 1)
  buf = replay.init(empty_rollout(1, 10), 16)
  r = empty_rollout(12, 10)
  k = jax.random.key(11)
  r = r.replace(tokens=jax.random.randint(k, (12, 10), 0, 64),
                behaviour_logprobs=-jax.random.uniform(jax.random.fold_in(k, 1), (12, 10)),
                rewards=jnp.arange(12, dtype=jnp.float32) % 2,
                advantages=jnp.linspace(-1, 1, 12))
  buf = replay.add(buf, r, jnp.arange(12, dtype=jnp.int32) // 4, jnp.int32(2))
  return {"train": state, "buffer": buf, "rng": jax.random.key_data(jax.random.key(7))}


def shardings_for(tree, mesh):
  """Parameters/optimizer by PARAM_RULES, buffer capacity over "data", RNG replicated."""
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return {"train": param_shardings(tree["train"], mesh),
          "buffer": replay.state_sharding(tree["buffer"], mesh, "data"), "rng": rep}


def fingerprint(tree) -> dict:
  """Per leaf: sha256 of the bytes, dtype and shape, keyed by the leaf path."""
  return {jax.tree_util.keystr(p): [hashlib.sha256(np.asarray(x).tobytes()).hexdigest(),
                                    str(x.dtype), list(x.shape)]
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


RESTORE = textwrap.dedent("""
    import json, sys
    import jax
    sys.path.insert(0, {tests!r})
    from test_checkpoint_mesh import build, shardings_for, fingerprint
    from jaxreplay.parallel import make_mesh
    from jaxreplay.train import checkpoint as ckpt
    assert jax.device_count() == {n}, jax.device_count()
    abstract = jax.eval_shape(build)
    out = {{}}
    for name, shape in {meshes!r}:
      mesh = make_mesh(*shape)
      target = ckpt.abstract_target(abstract, shardings_for(abstract, mesh))
      state, meta = ckpt.restore(ckpt.make_manager({d!r}, 2), target)
      emb = state["train"].params["embed"]["embedding"][...]
      mu = state["train"].opt_state[1][0].mu["embed"]["embedding"][...]
      out[name] = {{"fp": fingerprint(state), "step": meta["step"],
                   "buffer_spec": list(state["buffer"].valid.sharding.spec),
                   "buffer_devices": len(state["buffer"].valid.sharding.device_set),
                   "buffer_shard": state["buffer"].items.tokens.addressable_shards[0].data.shape[0],
                   "emb_spec": list(emb.sharding.spec), "mu_spec": list(mu.sharding.spec),
                   "emb_shard": list(emb.addressable_shards[0].data.shape)}}
    print(json.dumps(out))
""")


def _restore_in_subprocess(d, n, meshes):
  code = RESTORE.format(tests=os.path.join(ROOT, "tests"), d=str(d), n=n, meshes=meshes)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(n))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_checkpoint_from_8_devices_restores_on_4_and_1(tmp_path):
  mesh8 = make_mesh(8, 1, 1)
  tree = build()
  tree = jax.device_put(tree, shardings_for(tree, mesh8))
  assert tree["buffer"].items.tokens.addressable_shards[0].data.shape[0] == 2  # 16 / 8
  expected = fingerprint(tree)
  mu = tree["train"].opt_state[1][0].mu["embed"]["embedding"][...]
  assert float(jnp.abs(mu).sum()) > 0  # Adam moments are non-trivial
  mgr = ckpt.make_manager(str(tmp_path), 2)
  ckpt.save(mgr, 5, tree, {"step": 5})
  mgr.wait_until_finished()

  got4 = _restore_in_subprocess(tmp_path, 4, [("data4", (4, 1, 1)), ("fsdp_tensor", (1, 2, 2))])
  got1 = _restore_in_subprocess(tmp_path, 1, [("one", (1, 1, 1))])
  for name, got in [*got4.items(), *got1.items()]:
    assert got["fp"] == expected, name  # every leaf: same bytes, dtype, shape
    assert got["step"] == 5
  assert len(expected) > 20  # params, Adam mu/nu/count, buffer fields, rng
  d4 = got4["data4"]
  assert d4["buffer_spec"] == ["data"] and d4["buffer_devices"] == 4
  assert d4["buffer_shard"] == 4  # 16 / 4
  assert d4["emb_spec"] == [None, None]  # data-only mesh: parameters replicated
  ft = got4["fsdp_tensor"]
  assert ft["emb_spec"] == ["tensor", "fsdp"] and ft["emb_shard"] == [32, 16]
  assert ft["mu_spec"] == ["tensor", "fsdp"]
  assert ft["buffer_shard"] == 16  # data=1: the buffer is whole on each device
  one = got1["one"]
  assert one["buffer_devices"] == 1 and one["buffer_shard"] == 16
