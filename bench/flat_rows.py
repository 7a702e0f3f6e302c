"""Learner-step time with the linear layers on [B·T, D] token rows vs on [B, T, D] batches.

The model's projections (attention q/k/v/o, the SwiGLU MLP) run on token rows
(``models/transformer.py``, FLAT ROWS). Their weight gradients contract the token axes; on
[B, T, D] inputs XLA:CPU feeds those dots a transposed copy of the cotangent with the
elementwise backward fused in, emitted over three axes with strided reads. This benchmark
times jaxreplay's full learner step (``rl.train_step.make_train_step``: forward, per-token
log-probs in chunks, PPO-clip loss, backward, AdamW) both ways in one process: the baseline
wraps every ``nnx.Linear`` call so that it sees the [B, T, D] batch the layers took
before (and the MLP's SiLU on the batch), which gives the same dots and the same loss.

Model: a randomly initialised decoder at SmolLM2-135M's shapes (30 layers × 576, 9/3
heads, SwiGLU 1536, vocab 49,152, tied), float32, on B rollouts of T tokens (the first
``--prompt`` of them prompt), the learner batch of configs/smollm2_135m.py's short
completions (4 × 192 tokens). Each variant: one call to compile, then the median of
``--steps`` calls; the variants alternate ``--rounds`` times.

Usage: python bench/flat_rows.py [--batch 4 --seq 192 --prompt 60 --steps 3 --rounds 2]
Ends with: ``flat_rows: batched_step_s=F flat_step_s=F speedup=F``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from prompt_sharing import SMOLLM2_135M  # noqa: E402  (this folder is sys.path[0])


@contextlib.contextmanager
def batched_linears(b: int, t: int):
  """The layers as they ran on [b, t, D] batches: the MLP whole on the batch, and every
  other ``nnx.Linear`` called on [b·t, D] rows (attention's) on the batch instead."""
  from jaxreplay.models.transformer import MLP
  linear, mlp = nnx.Linear.__call__, MLP.__call__

  def linear_call(self, x):
    if x.ndim == 2 and x.shape[0] == b * t:
      return linear(self, x.reshape(b, t, -1)).reshape(b * t, -1)
    return linear(self, x)

  def mlp_call(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

  nnx.Linear.__call__, MLP.__call__ = linear_call, mlp_call
  try:
    yield
  finally:
    nnx.Linear.__call__, MLP.__call__ = linear, mlp


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=192)
  p.add_argument("--prompt", type=int, default=60)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--rounds", type=int, default=2)
  a = p.parse_args()

  from jaxreplay.models import Transformer
  from jaxreplay.models.hf import config_from_hf
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
  from jaxreplay.rollout import Rollout

  cfg = config_from_hf(SMOLLM2_135M, dtype="float32", param_dtype="float32")
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant", logprob_chunk=32)
  optimizer = make_optimizer(spec, 0)
  b, t, prompt = a.batch, a.seq, a.prompt
  rng = np.random.RandomState(0)
  completion = np.broadcast_to(np.arange(t)[None] >= prompt, (b, t))
  batch = Rollout(
      tokens=jnp.asarray(rng.randint(1, cfg.vocab_size, (b, t)), jnp.int32),
      attention_mask=jnp.ones((b, t), bool), completion_mask=jnp.asarray(completion),
      behaviour_logprobs=jnp.asarray(np.where(completion, -np.log(cfg.vocab_size), 0.0),
                                     jnp.float32),
      rewards=jnp.asarray(rng.rand(b), jnp.float32),
      advantages=jnp.asarray(rng.randn(b), jnp.float32),
      group_id=jnp.arange(b, dtype=jnp.int32), policy_version=jnp.zeros((b,), jnp.int32),
      newest_version=jnp.zeros((b,), jnp.int32), truncated=jnp.zeros((b,), bool))
  weights = jnp.ones((b,), jnp.float32)

  steps, losses, times = {}, {}, {"batched": [], "flat": []}
  for name, ctx in (("batched", batched_linears(b, t)), ("flat", contextlib.nullcontext())):
    with ctx:  # the patch acts while the step traces
      step = make_train_step(graphdef, optimizer, spec, 1.0)
      state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), optimizer, spec)
      t0 = time.perf_counter()
      _, metrics = step(state, batch, weights)
      losses[name] = float(metrics["loss"])
      print(f"{name}: compile and first call {time.perf_counter() - t0:.1f} s, "
            f"loss {losses[name]:.6f}", flush=True)
    steps[name] = step
  for _ in range(a.rounds):
    for name, step in steps.items():
      state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), optimizer,
                               spec)  # the step donates its state
      for _ in range(a.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, weights)
        jax.block_until_ready((state.params, metrics))
        times[name].append(time.perf_counter() - t0)
  if abs(losses["batched"] - losses["flat"]) > 1e-4 * max(1.0, abs(losses["flat"])):
    raise SystemExit(f"the variants' losses differ: {losses}")
  med = {k: statistics.median(v) for k, v in times.items()}
  dev = jax.devices()[0]
  print(f"device: {dev.platform}, {os.cpu_count()} CPUs, jax {jax.__version__}; batch "
        f"{b} x {t} tokens ({t - prompt} completion); medians of {len(times['flat'])} steps")
  print(f"flat_rows: batched_step_s={med['batched']:.3f} flat_step_s={med['flat']:.3f} "
        f"speedup={med['batched'] / med['flat']:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
