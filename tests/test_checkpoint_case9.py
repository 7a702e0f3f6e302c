"""CASES.md case 9: a checkpoint restores the buffer's versions and pointer, the typed RNG key
and the optimizer count, in a fresh process, into an abstract target."""

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

from jaxreplay import replay
from jaxreplay.train import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = replay.SamplerConfig(max_staleness=1)


def build_state():
  """Capacity 4, versions [5, 6, 7, 7], write pointer 2, full; Adam after 3 updates; key(42)."""
  items = {"x": jnp.arange(4, dtype=jnp.float32)[:, None] * jnp.ones((4, 3)),
           "mu": jnp.array([[-0.1, -0.2], [-0.3, -0.4], [-0.5, -0.6], [-0.7, -0.8]])}
  buf = replay.init(items, 4)
  buf = replay.add(buf, items, jnp.array([3, 3, 7, 7], jnp.int32), jnp.int32(3))
  two = jax.tree.map(lambda a: a[:2] + 10.0, items)
  buf = replay.add(buf, two, jnp.array([5, 6], jnp.int32), jnp.int32(7))
  params = {"w": jnp.ones((3,))}
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  for _ in range(3):
    upd, opt_state = opt.update({"w": jnp.ones((3,))}, opt_state, params)
    params = optax.apply_updates(params, upd)
  return {"buffer": buf, "params": params, "opt_state": opt_state, "version": jnp.int32(7),
          "rng": jax.random.key_data(jax.random.key(42))}


def next_indices(buf, rng_data, n=8):
  key = jax.random.wrap_key_data(rng_data)
  out = []
  for i in range(n):
    buf, s = replay.sample(buf, jax.random.fold_in(key, i), 1, jnp.int32(7), jnp.int32(8 + i), CFG)
    out.append(int(s.indices[0]))
  return out


RESTORE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    from test_checkpoint_case9 import build_state, next_indices
    from jaxreplay.train import checkpoint as ckpt
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), build_state())
    state, meta = ckpt.restore(ckpt.make_manager({d!r}, 2), abstract)
    b = state["buffer"]
    print(json.dumps({{
        "pointer": int(b.write_index), "size": int(b.size), "full": bool(b.size == b.capacity),
        "versions": np.asarray(b.policy_version).tolist(),
        "mu": np.asarray(b.items["mu"]).tobytes().hex(),
        "version": int(state["version"]), "count": int(state["opt_state"][0].count),
        "rng": np.asarray(state["rng"]).tolist(), "rng_dtype": str(state["rng"].dtype),
        "meta_step": meta["step"], "next": next_indices(b, state["rng"])}}))
""")


@pytest.mark.slow
def test_case9_restore_in_a_fresh_process(tmp_path):
  state = build_state()
  assert np.asarray(state["rng"]).tolist() == [0, 42]
  mgr = ckpt.make_manager(str(tmp_path), 2)
  ckpt.save(mgr, 7, state, {"step": 7})
  mgr.wait_until_finished()
  code = RESTORE.format(tests=os.path.join(ROOT, "tests"), d=str(tmp_path))
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["pointer"] == 2 and got["size"] == 4 and got["full"]
  assert got["versions"] == [5, 6, 7, 7]
  assert got["mu"] == np.asarray(state["buffer"].items["mu"]).tobytes().hex()
  assert got["version"] == 7 and got["count"] == 3 and got["meta_step"] == 7
  assert got["rng"] == [0, 42] and got["rng_dtype"] == "uint32"
  # the age filter still works after restore: version 5 (staleness 2 > 1) is never drawn
  assert 0 not in got["next"] and set(got["next"]) <= {1, 2, 3}
  # and the next 8 draws equal those of an uninterrupted run from the same state
  assert got["next"] == next_indices(state["buffer"], state["rng"])
