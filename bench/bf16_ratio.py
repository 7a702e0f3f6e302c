"""The importance ratio at identical parameters: the sampler's cached decode vs the learner's forward.

Fresh rollouts scored by the parameters that generated them should have importance ratio
π/μ = 1 on every token. In float32 the two computations agree to rounding; in bfloat16 the
sampler (prefill, then one token at a time against a bf16 KV cache) and the learner (one
full forward over prompt + completion) round differently, so log π − log μ ≠ 0 with no
parameter change. This measures that spread, per numerics setting:

* ``float32``: float32 activations and parameters (the reference; ratio 1 up to rounding);
* ``bf16``: bfloat16 activations, float32 parameters (the Qwen presets' setting);
* ``bf16_params``: bfloat16 activations and parameters.

For each it samples ``--rows`` completions with ``sampling.generate`` (temperature
``--temperature``), scores the same tokens with ``rl.scoring.token_logprobs`` (the
learner's path) at the same parameters, and prints over completion tokens x = log π − log μ:
its standard deviation and largest |x|, quantiles of the ratio exp(x), the fraction of tokens
whose ratio leaves PPO's clip range [1 − ε, 1 + ε] (ε = 0.2: their gradient is cut whenever
the advantage pushes outward), the mean k3 KL (Schulman 2020) and the standard deviation of
the sequence log-ratio Σ_t x_t (what sequence-level ratios such as GSPO's see). With
``--recompute`` it also scores the behaviour log-probs in the learner's numerics before
comparing (``rollout.behaviour_logprobs = "learner"``), which must give x = 0 exactly.

Models:
  ``--config PATH`` (default ``configs/default.py``): the config's builtin model with its
    cached warm-started base policy (trained on first use, ~2 min here) and the task's prompts.
  ``--qwen_shapes``: a randomly initialised decoder at Qwen2.5-0.5B's shapes (24 × 896,
    14/2 heads, SwiGLU 4864, vocab 151,936; ``--layers`` to shorten it) on random prompt
    tokens. Random weights give near-uniform next-token distributions, unlike a trained
    checkpoint's: a statement about the numerics at these shapes, not about Qwen.

Usage: python bench/bf16_ratio.py [--config configs/default.py] [--rows 256] [--set KEY=VALUE]
       python bench/bf16_ratio.py --qwen_shapes --rows 8 --prompt 32 --new 32 --layers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxreplay.models.transformer import Transformer  # noqa: E402
from jaxreplay.rl.scoring import token_logprobs  # noqa: E402
from jaxreplay.sampling import generate  # noqa: E402

SETTINGS = {"float32": ("float32", "float32"), "bf16": ("bfloat16", "float32"),
            "bf16_params": ("bfloat16", "bfloat16")}
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=32768)
EPS = 0.2


def ratio_stats(x: np.ndarray, mask: np.ndarray) -> dict:
  """Summary of log-ratios x = log π − log μ over the completion tokens.

  Args:
    x: [B, T] float log-ratios (nats). mask: [B, T] bool completion tokens.

  Returns:
    dict of floats: ``tokens`` (count), ``std`` and ``max_abs`` of x, ratio quantiles
    ``q0.001 … q0.999`` of exp(x), ``out_of_clip`` (fraction with |exp(x) − 1| > ε = 0.2),
    ``kl_k3`` (mean exp(x) − 1 − x, Schulman 2020), ``seq_std`` (std over rows of Σ_t x_t).
  """
  xs = np.asarray(x, np.float64)[np.asarray(mask, bool)]
  r = np.exp(xs)
  q = np.quantile(r, [0.001, 0.01, 0.5, 0.99, 0.999])
  seq = np.where(mask, x, 0.0).sum(1)
  return {"tokens": int(xs.size), "std": float(xs.std()), "max_abs": float(np.abs(xs).max()),
          "q0.001": q[0], "q0.01": q[1], "q0.5": q[2], "q0.99": q[3], "q0.999": q[4],
          "out_of_clip": float((np.abs(r - 1) > EPS).mean()),
          "kl_k3": float(np.mean(np.expm1(xs) - xs)), "seq_std": float(seq.std())}


def measure(graphdef, params, prompt_tokens, prompt_mask, key, *, max_new_tokens: int,
            temperature: float, eos_ids, pad_id: int, recompute: bool = False) -> dict:
  """Samples completions, then scores them with the learner's forward at the same parameters.

  Args:
    graphdef, params: the policy (its config's ``dtype`` sets the activation dtype).
    prompt_tokens: [B, P] int32 left-padded. prompt_mask: [B, P] bool. key: PRNG key.
    max_new_tokens, temperature, eos_ids, pad_id: the sampler's settings.
    recompute: compare against behaviour log-probs recomputed by the learner's forward
      (``train.generation.learner_logprobs``) instead of the sampler's.

  Returns:
    ``ratio_stats`` of x = log π (learner) − log μ (behaviour), plus ``entropy`` (mean
    nats per completion token) and ``seconds`` (wall time of generate + score, compile
    included).
  """
  t0 = time.time()
  gen = generate(graphdef, params, prompt_tokens, prompt_mask, key,
                 max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos_ids,
                 pad_id=pad_id)
  tokens = jnp.concatenate([jnp.asarray(prompt_tokens), gen.tokens], 1)
  attn = jnp.concatenate([jnp.asarray(prompt_mask), gen.mask], 1)
  comp = jnp.concatenate([jnp.zeros_like(prompt_mask, dtype=bool), gen.mask], 1)
  behaviour = jnp.concatenate([jnp.zeros(prompt_mask.shape, jnp.float32), gen.logprobs], 1)
  score = jax.jit(token_logprobs, static_argnums=(0, 4))
  logp, ent = score(graphdef, params, tokens, attn, temperature)
  if recompute:
    behaviour, _ = score(graphdef, params, tokens, attn, temperature)
  x, m, ent = jax.device_get((jnp.where(comp, logp - behaviour, 0.0), comp, ent))
  out = ratio_stats(x, m)
  out.update(entropy=float(ent[m].mean()), seconds=time.time() - t0)
  return out


def with_numerics(graphdef, params, dtype: str, param_dtype: str):
  """The same policy with activations in ``dtype`` and parameters cast to ``param_dtype``."""
  cfg = dataclasses.replace(nnx.merge(graphdef, params).cfg, dtype=dtype, param_dtype=param_dtype)
  new_def, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
  return new_def, jax.tree.map(lambda a: a.astype(param_dtype), params)


def builtin_policy(config_path: str, rows: int, overrides=()):
  """(graphdef, float32 params, prompt tokens, mask, eos ids, pad id, M, temperature) of the
  config's builtin model, warm-started (cached), with ``KEY=VALUE`` ``overrides``."""
  from jaxreplay.config import apply_overrides, load_config, specs
  from jaxreplay.tasks.registry import make_task
  from jaxreplay.train.build import load_policy
  tree = load_config(config_path)
  apply_overrides(tree, overrides)
  cfg = specs(tree)
  task = make_task(cfg.task)
  io, graphdef, params, _ = load_policy(cfg.model, cfg.task, cfg.warmstart, task, seed=cfg.seed,
                                        max_new_tokens=cfg.sampler.max_new_tokens,
                                        log=lambda *a: None)
  examples = [task.train[i % len(task.train)] for i in range(rows)]
  toks, mask, _ = io.prompts(examples)
  return (graphdef, params, toks, mask, io.eos_ids, io.pad_id, cfg.sampler.max_new_tokens,
          cfg.sampler.temperature)


def qwen_policy(rows: int, prompt: int, layers: int, seed: int = 0):
  """A random decoder at Qwen2.5-0.5B shapes and random prompts (no end-of-sequence id)."""
  from jaxreplay.models.hf import config_from_hf
  cfg = config_from_hf(dict(QWEN25_05B, num_hidden_layers=layers))
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(seed)), nnx.Param)
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, cfg.vocab_size, (rows, prompt)).astype(np.int32)
  return graphdef, params, toks, np.ones_like(toks, bool), (cfg.vocab_size + 1,), 0


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. model.n_layers=12 (repeatable; a new model is "
                      "warm-started and cached on first use)")
  p.add_argument("--qwen_shapes", action="store_true")
  p.add_argument("--layers", type=int, default=24, help="--qwen_shapes: decoder layers")
  p.add_argument("--prompt", type=int, default=32, help="--qwen_shapes: prompt tokens")
  p.add_argument("--new", type=int, default=32, help="--qwen_shapes: completion tokens")
  p.add_argument("--rows", type=int, default=256)
  p.add_argument("--temperature", type=float, default=None,
                 help="sampling temperature (default: the config's; 1.0 with --qwen_shapes)")
  p.add_argument("--settings", default="float32,bf16,bf16_params")
  p.add_argument("--recompute", action="store_true",
                 help="also the bf16 settings with behaviour log-probs recomputed by the learner")
  a = p.parse_args()
  if a.qwen_shapes:
    graphdef, params, toks, mask, eos, pad = qwen_policy(a.rows, a.prompt, a.layers)
    m, temp = a.new, 1.0
    print(f"random decoder at Qwen2.5-0.5B shapes, {a.layers} layers; {a.rows} rows of "
          f"{a.prompt} prompt + {m} sampled tokens")
  else:
    graphdef, params, toks, mask, eos, pad, m, temp = builtin_policy(a.config, a.rows, a.set)
    mc = nnx.merge(graphdef, params).cfg
    print(f"{a.config} {' '.join(a.set)}: warm-started builtin policy ({mc.n_layers} layers x "
          f"{mc.d_model}), {a.rows} task prompts, up to {m} tokens")
  temp = a.temperature if a.temperature is not None else temp
  cols = ("tokens", "entropy", "std", "max_abs", "q0.001", "q0.01", "q0.5", "q0.99", "q0.999",
          "out_of_clip", "kl_k3", "seq_std")
  print(f"temperature {temp}; x = log π(learner forward) − log μ(sampler decode), same params")
  print(f"{'setting':<22}" + "".join(f"{c:>12}" for c in cols))
  runs = [(s, False) for s in a.settings.split(",")]
  runs += [(s, True) for s in a.settings.split(",") if a.recompute and s != "float32"]
  for name, recompute in runs:
    if name not in SETTINGS:
      raise SystemExit(f"--settings: {name!r} is not one of {sorted(SETTINGS)}")
    g, prm = with_numerics(graphdef, params, *SETTINGS[name])
    r = measure(g, prm, toks, mask, jax.random.key(0), max_new_tokens=m, temperature=temp,
                eos_ids=eos, pad_id=pad, recompute=recompute)
    label = name + (" +recompute" if recompute else "")
    print(f"{label:<22}" + "".join(f"{r[c]:>12d}" if c == "tokens" else f"{r[c]:>12.4g}"
                                   for c in cols) + f"   ({r['seconds']:.1f} s)")


if __name__ == "__main__":
  main()
