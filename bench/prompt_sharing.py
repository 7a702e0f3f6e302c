"""The packed learner step with every slot scored, with the completion slots alone scored,
and with each group's prompt packed once (``algo.share_prompts``), on one batch.

Protocol: a randomly initialised decoder at SmolLM2-135M's shapes (30 layers × 576, 9/3
heads, SwiGLU 1536, vocab 49,152, tied embeddings; weights do not change the compute) takes
jaxreplay's packed learner step (``rl.train_step.make_train_step``: PPO-clip, GRPO
advantages, token-mean, the head's log-softmax in chunks of ``--chunk`` positions, ``--accum``
micro-batches, AdamW) on a batch laid out like ``configs/smollm2_135m.py``'s: ``--groups``
prompts of ``--prompt`` real tokens (left-padded to ``--prompt_width``), each with
``--group_size`` completions of up to ``--max_new`` tokens whose lengths are uniform in
[mean/2, 3·mean/2] for each ``--completion_means`` entry. For each mean and mode it runs one
step to compile, then times ``--steps`` steps (median). The three modes:

* ``whole``: the plan without completion masks: the head and log-softmax run on every
  packed slot (prompt tokens included), as the learner did before it scored completions
  only;
* ``scored``: ``plan_batch(completion=...)``: the head on the completion slots alone;
* ``shared``: ``algo.share_prompts``: also one copy of each group's prompt per packed unit.

Each mode's loss is printed: the three agree to float rounding. Ends with the line

  prompt_sharing mean=<last mean> whole_s=F scored_s=F shared_s=F shared_vs_whole=F

(the ratio is whole_s / shared_s: how many times faster the shared step is, on this machine).

Usage: python bench/prompt_sharing.py [--completion_means 72,25] [--steps 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--groups", type=int, default=4)
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--prompt", type=int, default=60, help="real prompt tokens")
  p.add_argument("--prompt_width", type=int, default=96)
  p.add_argument("--max_new", type=int, default=128)
  p.add_argument("--completion_means", default="72,25",
                 help="comma-separated mean completion lengths, one batch each")
  p.add_argument("--chunk", type=int, default=32, help="algo.logprob_chunk")
  p.add_argument("--accum", type=int, default=4, help="algo.grad_accum_steps")
  p.add_argument("--steps", type=int, default=2, help="timed steps per mode (after 1 compile)")
  p.add_argument("--modes", default="whole,scored,shared")
  p.add_argument("--scan_layers", action="store_true", help="model.scan_layers (one lax.scan "
                 "over the blocks: a shorter compile)")
  p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  return p.parse_args()


def make_batch(a, vocab: int, mean: float, seed: int = 0):
  """A Rollout of groups × group_size rows: equal prompts per group, ragged completions."""
  from jaxreplay.rollout import Rollout
  rng = np.random.default_rng(seed)
  b, t = a.groups * a.group_size, a.prompt_width + a.max_new
  group = np.arange(b) // a.group_size
  prompts = rng.integers(1, vocab, (a.groups, a.prompt))
  lens = np.clip(rng.integers(int(mean / 2), int(1.5 * mean) + 1, b), 1, a.max_new)
  tokens = np.zeros((b, t), np.int32)
  cols = np.arange(t)
  tokens[:, a.prompt_width - a.prompt:a.prompt_width] = prompts[group]
  comp = (cols >= a.prompt_width) & (cols < a.prompt_width + lens[:, None])
  tokens = np.where(comp, rng.integers(1, vocab, (b, t)), tokens).astype(np.int32)
  attn = tokens > 0
  rewards = rng.integers(0, 2, b).astype(np.float32)
  adv = rewards - rewards.reshape(a.groups, -1).mean(1).repeat(a.group_size)
  return Rollout(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attn),
                 completion_mask=jnp.asarray(comp),
                 behaviour_logprobs=jnp.asarray(np.where(comp, -np.log(vocab), 0.0), jnp.float32),
                 rewards=jnp.asarray(rewards), advantages=jnp.asarray(adv, jnp.float32),
                 group_id=jnp.asarray(group, jnp.int32), policy_version=jnp.zeros(b, jnp.int32),
                 newest_version=jnp.zeros(b, jnp.int32), truncated=jnp.asarray(lens >= a.max_new))


def time_step(step, state, batch, plan, steps: int):
  """Times a packed train step: one call to compile, then the median of ``steps`` calls.

  Args:
    step: ``make_train_step``'s step. state: its TrainState (donated: pass a copy).
    batch: the Rollout. plan: ``step.plan_batch``'s PackPlan. steps: ≥ 1 timed calls.

  Returns:
    (seconds of the first call, median seconds of the timed calls, the last call's metrics).
  """
  t0 = time.perf_counter()
  state, m = step(state, batch, None, None, plan)
  jax.block_until_ready(state.params)
  first = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, batch, None, None, plan)
    jax.block_until_ready((state.params, m))
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times), m


def main():
  a = parse()
  from flax import nnx

  from jaxreplay.models import Transformer
  from jaxreplay.models.hf import config_from_hf
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step

  cfg = dataclasses.replace(config_from_hf(TINY if a.tiny else SMOLLM2_135M,
                                           dtype="float32", param_dtype="float32"),
                            attention="xla", scan_layers=a.scan_layers)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  print(f"jax {jax.__version__} on {jax.default_backend()} ({platform.node()}, "
        f"{os.cpu_count()} cpus); {len(jax.tree.leaves(params))} arrays, "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M parameters", flush=True)
  out = {}
  for mean in [float(x) for x in a.completion_means.split(",")]:
    batch = make_batch(a, cfg.vocab_size, mean)
    attn = np.asarray(batch.attention_mask)
    comp = np.asarray(batch.completion_mask)
    tokens = np.asarray(batch.tokens)
    print(f"mean {mean:g}: {attn.shape[0]} rollouts, {int(comp.sum())} completion tokens, "
          f"{int((attn & ~comp).sum())} prompt tokens", flush=True)
    for mode in a.modes.split(","):
      spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant", logprob_chunk=a.chunk,
                      grad_accum_steps=a.accum, share_prompts=mode == "shared")
      opt = make_optimizer(spec, 0)
      step = make_train_step(graphdef, opt, spec, 1.0)
      plan = (step.plan_batch(attn) if mode == "whole" else
              step.plan_batch(attn, completion=comp, tokens=tokens))
      slots = int((plan.segment_ids > 0).sum())
      state = init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, spec)
      first, out[mean, mode], m = time_step(step, state, batch, plan, a.steps)
      print(f"  {mode:7s} packed tokens {slots:5d}  plan {plan.src.shape[1:4]}  first "
            f"{first:6.1f} s  step {out[mean, mode]:6.2f} s  loss {float(m['loss']):+.6f}",
            flush=True)
  last = mean
  if any((last, k) not in out for k in ("whole", "scored", "shared")):
    return
  w, s, sh = (out[last, k] for k in ("whole", "scored", "shared"))
  print(f"prompt_sharing mean={last:g} whole_s={w:.2f} scored_s={s:.2f} shared_s={sh:.2f} "
        f"shared_vs_whole={w / sh:.2f}")


if __name__ == "__main__":
  main()
