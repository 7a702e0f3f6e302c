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


def smollm2_learner_inputs(b: int, t: int, prompt: int, on_policy: bool = False):
  """A randomly initialised decoder at SmolLM2-135M's shapes (float32) and a learner batch of
  ``b`` rollouts of ``t`` random tokens (the first ``prompt`` of them prompt). The behaviour
  log-probs are uniform's (-log V: PPO clips most tokens, so the gradient may be all but
  zero) or, with ``on_policy``, the model's own (importance ratio 1, nothing clipped).

  Returns:
    (graphdef, params, spec, optimizer, batch, weights [b] float32): what
    ``make_train_step``/``init_train_state`` and the step's call take.
  """
  from jaxreplay.models import Transformer
  from jaxreplay.models.hf import config_from_hf
  from jaxreplay.rl.scoring import token_logprobs
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import make_optimizer
  from jaxreplay.rollout import Rollout

  cfg = config_from_hf(SMOLLM2_135M, dtype="float32", param_dtype="float32")
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant", logprob_chunk=32)
  optimizer = make_optimizer(spec, 0)
  rng = np.random.RandomState(0)
  completion = np.broadcast_to(np.arange(t)[None] >= prompt, (b, t))
  tokens = jnp.asarray(rng.randint(1, cfg.vocab_size, (b, t)), jnp.int32)
  behaviour = jnp.full((b, t), -np.log(cfg.vocab_size), jnp.float32)
  if on_policy:
    behaviour = jax.jit(token_logprobs, static_argnums=0, static_argnames="chunk")(
        graphdef, params, tokens, jnp.ones((b, t), bool), chunk=spec.logprob_chunk)[0]
  batch = Rollout(
      tokens=tokens, attention_mask=jnp.ones((b, t), bool),
      completion_mask=jnp.asarray(completion),
      behaviour_logprobs=jnp.where(jnp.asarray(completion), behaviour, 0.0),
      rewards=jnp.asarray(rng.rand(b), jnp.float32),
      advantages=jnp.asarray(rng.randn(b), jnp.float32),
      group_id=jnp.arange(b, dtype=jnp.int32), policy_version=jnp.zeros((b,), jnp.int32),
      newest_version=jnp.zeros((b,), jnp.int32), truncated=jnp.zeros((b,), bool))
  return graphdef, params, spec, optimizer, batch, jnp.ones((b,), jnp.float32)


def time_variants(variants: dict, graphdef, params, optimizer, spec, batch, weights,
                  steps: int, rounds: int) -> tuple[dict, dict]:
  """Times ``make_train_step``'s learner step traced under each variant's context manager.

  Each variant: one call to compile (its metrics kept), then ``rounds`` times (variants
  alternating, so that the machine's drift falls on both) ``steps`` timed calls from a
  fresh copy of ``params`` (the step donates its state).

  Returns:
    ({name: the first call's metrics, as numpy}, {name: [seconds of each timed call]}).
  """
  from jaxreplay.rl.train_step import init_train_state, make_train_step

  fns, first, times = {}, {}, {name: [] for name in variants}
  for name, ctx in variants.items():
    with ctx:  # the patch acts while the step traces
      fns[name] = make_train_step(graphdef, optimizer, spec, 1.0)
      state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), optimizer, spec)
      t0 = time.perf_counter()
      _, first[name] = jax.device_get(fns[name](state, batch, weights))
      print(f"{name}: compile and first call {time.perf_counter() - t0:.1f} s, "
            f"loss {float(first[name]['loss']):.6f}", flush=True)
  for _ in range(rounds):
    for name, step in fns.items():
      state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), optimizer, spec)
      for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch, weights)
        jax.block_until_ready((state.params, m))
        times[name].append(time.perf_counter() - t0)
  return first, times


def parse_args(doc: str) -> argparse.Namespace:
  """The learner-step benchmarks' flags (batch, seq, prompt, steps, rounds), ``doc``'s first
  line as the description."""
  p = argparse.ArgumentParser(description=doc.split("\n")[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=192)
  p.add_argument("--prompt", type=int, default=60)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--rounds", type=int, default=2)
  return p.parse_args()


def main():
  a = parse_args(__doc__)

  b, t, prompt = a.batch, a.seq, a.prompt
  graphdef, params, spec, optimizer, batch, weights = smollm2_learner_inputs(b, t, prompt)

  variants = {"batched": batched_linears(b, t), "flat": contextlib.nullcontext()}
  metrics, times = time_variants(variants, graphdef, params, optimizer, spec, batch, weights,
                                 a.steps, a.rounds)
  losses = {k: float(m["loss"]) for k, m in metrics.items()}
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
