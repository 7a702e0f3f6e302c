"""The learner at realistic completion lengths: padding in its arrays, packed vs full width.

Protocol (issue 21): rollouts are stored at the full padded width T = P + M. A batch whose
completion lengths follow a lognormal shaped like real GSM8K/MATH runs (mean 300 tokens,
capped at 1024, ~2% truncated; prompts ~130 real tokens padded to 384) is mostly padding.
Here the shape is kept and the scale divided by 4 so it runs in about a minute on a 2-core
CPU: completions lognormal with mean 75 capped at M = 256 (σ chosen so ~2% reach the cap),
prompts of 24–40 real tokens left-padded to P = 96. A 2-layer × 128 decoder (vocab 1024)
takes jaxreplay's learner step (``rl.train_step.make_train_step``: forward, log-probs and
entropy, PPO-clip, backward, AdamW) twice: with ``algo.pack_sequences`` (the batch's real
tokens packed into rows, ``rl.packing``; the host-side plan included in the time) and at
full width. Each is timed as the median of ``reps`` calls after one warm-up (compile) call.

``learner_padding`` is empty ÷ all token slots of the packed learner's arrays;
``learner_step_vs_full`` the packed step's time ÷ the full-width step's.

Usage: python bench/learner_width.py  (prints ``learner_padding=F learner_step_vs_full=F``)
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

# lognormal of mean 300 capped at 1024 with 2% above the cap, at 1/4 scale: the cap is at
# 2.054 σ above μ (the 98th percentile) and the mean is exp(μ + σ²/2)
MEAN, CAP, TRUNCATED = 75, 256, 0.02


def lognormal_params(mean: float, cap: float, z: float = 2.0537) -> tuple[float, float]:
  """(μ, σ) of a lognormal with the given mean whose ``z``-quantile (default 98%) is ``cap``.

  Solves ln(cap) = μ + zσ and ln(mean) = μ + σ²/2 (the smaller root).

  Returns:
    (μ, σ) floats.

  Raises:
    ValueError: no solution (cap too close to the mean for that quantile).
  """
  gap = math.log(cap) - math.log(mean)
  disc = z * z - 2 * gap
  if disc < 0 or gap <= 0:
    raise ValueError(f"no lognormal has mean {mean} and quantile {cap} at z={z}")
  sigma = z - math.sqrt(disc)
  return math.log(mean) - sigma ** 2 / 2, sigma


def make_batch(rows: int, prompt_width: int, max_new: int, vocab: int, seed: int = 0,
               mean: float = MEAN, prompt_real: tuple[int, int] = (24, 40)):
  """A ``Rollout`` of ``rows`` rows at width P + M with lognormal completion lengths.

  The lengths are the lognormal's quantiles at (i + ½)/B, i = 0..B−1, in a random row
  order: every batch has the distribution's shape (e.g. 1 of 64 rows, 2 of 128, at the cap)
  rather than one random draw's.

  Args:
    rows: B. prompt_width: P. max_new: M (the cap). vocab: token ids drawn in [1, vocab).
    seed: numpy seed. mean: the lognormal's mean (before the cap).
    prompt_real: inclusive range of real prompt tokens (left-padded).

  Returns:
    (rollout, completion lengths [B] int64).
  """
  import jax.numpy as jnp

  from jaxreplay.rollout import Rollout

  rng = np.random.default_rng(seed)
  mu, sigma = lognormal_params(mean, max_new)
  z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / rows) for i in range(rows)])
  comp = np.clip(np.round(np.exp(mu + sigma * rng.permutation(z))), 1, max_new).astype(np.int64)
  plen = rng.integers(prompt_real[0], prompt_real[1] + 1, rows)
  cols = np.arange(prompt_width + max_new)[None]
  prompt = (cols < prompt_width) & (cols >= prompt_width - plen[:, None])
  completion = (cols >= prompt_width) & (cols < prompt_width + comp[:, None])
  tokens = rng.integers(1, vocab, prompt.shape) * (prompt | completion)
  batch = Rollout(
      tokens=jnp.asarray(tokens, jnp.int32), attention_mask=jnp.asarray(prompt | completion),
      completion_mask=jnp.asarray(completion),
      behaviour_logprobs=jnp.asarray(np.where(completion, -np.log(vocab), 0.0), jnp.float32),
      rewards=jnp.asarray(rng.random(rows), jnp.float32),
      advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
      group_id=jnp.arange(rows, dtype=jnp.int32), policy_version=jnp.zeros(rows, jnp.int32), newest_version=jnp.zeros(rows, jnp.int32),
      truncated=jnp.asarray(comp >= max_new))
  return batch, comp


def _time_steps(step, state, batch, reps: int) -> tuple[float, object]:
  import jax

  state, m = step(state, batch)  # compile
  jax.block_until_ready((state.params, m))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready((state.params, m))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), state


def measure_learner(rows: int = 64, prompt_width: int = 96, max_new: int = 256,
                    vocab: int = 1024, d_model: int = 128, n_layers: int = 2, reps: int = 3,
                    seed: int = 0) -> dict:
  """Padding of the packed learner's arrays and its step time relative to full width.

  Args:
    rows: B rollouts per learner step. prompt_width: P. max_new: M, the completion cap.
    vocab, d_model, n_layers: the decoder's size (4 heads, 2 KV heads, SwiGLU 3·D).
    reps: timed calls per variant (median). seed: the batch's numpy seed.

  Returns:
    {"learner_padding": empty ÷ all slots of the packed [R, P + M] arrays,
     "learner_step_vs_full": packed step time ÷ full-width step time} (floats).
  """
  import jax
  from flax import nnx

  from jaxreplay.models.transformer import Transformer, TransformerConfig
  from jaxreplay.rl import packing
  from jaxreplay.rl.spec import AlgoSpec
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step

  cfg = TransformerConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=4,
                          n_kv_heads=2, head_dim=d_model // 4, d_ff=3 * d_model)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  batch, _ = make_batch(rows, prompt_width, max_new, vocab, seed)
  times = {}
  for pack in (True, False):
    spec = AlgoSpec(lr=1e-6, warmup_steps=0, lr_schedule="constant", pack_sequences=pack)
    opt = make_optimizer(spec, 0)
    state = init_train_state(graphdef, jax.tree.map(lambda x: x.copy(), params), opt, spec)
    times[pack], _ = _time_steps(make_train_step(graphdef, opt, spec, 1.0), state, batch, reps)
  plan = packing.plan_batch(np.asarray(batch.attention_mask))  # the packed step's plan
  return {"learner_padding": packing.padding_fraction(plan),
          "learner_step_vs_full": times[True] / times[False]}


if __name__ == "__main__":
  out = measure_learner()
  print(" ".join(f"{k}={v:.3f}" for k, v in out.items()))
