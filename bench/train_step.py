"""Learner-step throughput and model FLOPs utilisation (MFU) of jaxreplay's jitted update.

Protocol (issue 6): a randomly initialised decoder at a real checkpoint's shapes (default
Qwen2.5-0.5B: 24 layers × 896 hidden, 14/2 heads, SwiGLU 4864, vocab 151936, tied
embeddings) takes jaxreplay's full off-policy learner step (``rl.train_step.make_train_step``:
forward, per-token log-probs and entropy over the whole vocabulary, PPO-clip loss against
stored behaviour log-probs, backward, global-norm clipping and AdamW) on a random batch of
B rollouts of T tokens (the first ``--prompt`` of them prompt). After two warm-up calls
(compilation) it times ``--steps`` calls and reports the median.

MFU = model FLOPs per step / step time / peak. Model FLOPs follow PaLM (Chowdhery et al.
2022, appendix B): 6·N per trained token for the N matmul parameters (embedding lookup
excluded, the tied LM head included as a [D, V] matmul), plus 6·L·T·(H·E) per token for
the causal attention scores and values (q·k and p·v, forward 2·2·T·H·E/2, ×3 for
backward). Peak: the datasheet's dense bf16 rate (``--peak_tflops``, H100/H200 SXM: 989)
and, for reference, a matmul rate measured in the same run (8192³ in the compute dtype).

Usage (GPU): python bench/train_step.py [--batch 16 --seq 512 --dtype bfloat16 --attention xla]
          CPU smoke: python bench/train_step.py --tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=32768)
TINY = dict(QWEN25_05B, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=512, help="T, tokens per rollout")
  p.add_argument("--prompt", type=int, default=128, help="prompt tokens per rollout (no loss)")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                 help="activation / compute dtype")
  p.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"],
                 help="parameter and optimizer-state dtype")
  p.add_argument("--peak_tflops", type=float, default=989.0,
                 help="datasheet dense peak in the compute dtype (H100/H200 SXM bf16: 989)")
  p.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                 help="model.attention: 'auto' is cuDNN's fused attention on a GPU, splash on "
                      "a TPU, XLA elsewhere (models/attention.py)")
  p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test)")
  return p.parse_args()


def matmul_tflops(dtype, n: int) -> float:
  """Measured TFLOP/s of a jitted n×n×n product in ``dtype`` (best of 3 × 10 calls)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (n, n), dtype)
  w = jax.random.normal(k2, (n, n), dtype)
  f = jax.jit(lambda x, w: x @ w)
  f(x, w).block_until_ready()
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(10):
      y = f(x, w)
    y.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / 10)
  return 2 * n ** 3 / best / 1e12


def main():
  a = parse()
  from flax import nnx

  import dataclasses

  from jaxreplay.models import Transformer, attention
  from jaxreplay.models.hf import config_from_hf
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
  from jaxreplay.rollout import Rollout

  hf = TINY if a.tiny else QWEN25_05B
  cfg = config_from_hf(hf, dtype=a.dtype, param_dtype=a.param_dtype)
  cfg = dataclasses.replace(cfg, attention=attention.resolve(a.attention, jax.default_backend()))
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  # PPO-clip, GRPO advantages, token-mean aggregation; Adam at a constant 1e-6
  spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant")
  optimizer = make_optimizer(spec, 0)
  state = init_train_state(graphdef, params, optimizer, spec)
  train_step = make_train_step(graphdef, optimizer, spec, 1.0)

  b, t, p = a.batch, a.seq, a.prompt
  rng = np.random.RandomState(0)
  tokens = rng.randint(1, cfg.vocab_size, (b, t)).astype(np.int32)
  pos = np.arange(t)[None]
  completion = np.broadcast_to(pos >= p, (b, t))
  batch = Rollout(
      tokens=jnp.asarray(tokens), attention_mask=jnp.ones((b, t), bool),
      completion_mask=jnp.asarray(completion),
      behaviour_logprobs=jnp.asarray(np.where(completion, -np.log(cfg.vocab_size), 0.0),
                                     jnp.float32),
      rewards=jnp.asarray(rng.rand(b), jnp.float32),
      advantages=jnp.asarray(rng.randn(b), jnp.float32),
      group_id=jnp.arange(b, dtype=jnp.int32), policy_version=jnp.zeros((b,), jnp.int32), newest_version=jnp.zeros((b,), jnp.int32),
      truncated=jnp.zeros((b,), bool))
  weights = jnp.ones((b,), jnp.float32)

  t0 = time.perf_counter()
  for _ in range(2):
    state, metrics = train_step(state, batch, weights)
  jax.block_until_ready(state.params)
  warm_s = time.perf_counter() - t0
  times = []
  for _ in range(a.steps):
    t0 = time.perf_counter()
    state, metrics = train_step(state, batch, weights)
    jax.block_until_ready((state.params, metrics))
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  loss = float(metrics["loss"])

  d_q = cfg.n_heads * cfg.head_dim
  d_kv = cfg.n_kv_heads * cfg.head_dim
  per_layer = cfg.d_model * (2 * d_q + 2 * d_kv) + 3 * cfg.d_model * cfg.d_ff
  n_matmul = cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  flops_per_token = 6 * n_matmul + 6 * cfg.n_layers * t * d_q
  step_flops = flops_per_token * b * t
  achieved = step_flops / step_s / 1e12
  measured_peak = matmul_tflops(jnp.dtype(a.dtype), 512 if a.tiny else 8192)

  dev = jax.devices()[0]
  print(f"device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
        f"{jax.device_count()} device(s)")
  print(f"model: {hf['model_type']} {cfg.n_layers} layers × {cfg.d_model}, heads "
        f"{cfg.n_heads}/{cfg.n_kv_heads}, ffn {cfg.d_ff}, vocab {cfg.vocab_size}, "
        f"{n_params / 1e6:.1f}M params ({n_matmul / 1e6:.1f}M in matmuls); params "
        f"{a.param_dtype}, compute {a.dtype}; attention {cfg.attention}")
  print(f"batch {b} × {t} tokens ({t - p} completion); PPO-clip + AdamW; warm-up "
        f"(2 calls incl. compile) {warm_s:.1f}s; loss {loss:.4f}")
  print()
  print("| learner step | value |")
  print("|---|---|")
  print(f"| step time (median of {a.steps}) | {step_s * 1e3:.1f} ms |")
  print(f"| trained tokens/s | {b * t / step_s:,.0f} |")
  print(f"| model TFLOP/step | {step_flops / 1e12:.2f} |")
  print(f"| achieved TFLOP/s | {achieved:.1f} |")
  print(f"| MFU vs datasheet {a.peak_tflops:.0f} TFLOP/s | {achieved / a.peak_tflops:.1%} |")
  print(f"| MFU vs measured matmul {measured_peak:.0f} TFLOP/s | {achieved / measured_peak:.1%} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
