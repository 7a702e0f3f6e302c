"""Held-out evaluation: accuracy of greedy and of sampled completions."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxreplay.sampling import generate
from jaxreplay.tasks.base import Example
from jaxreplay.train.policy import TextIO, score


def evaluate(graphdef, params, io: TextIO, task, examples: Sequence[Example], key: jax.Array,
             max_new_tokens: int, temperature: float, samples_per_example: int,
             chunk: int = 1024) -> dict[str, float]:
  """Held-out accuracy: greedy (temperature 0) and sampled at ``temperature``.

  Args:
    graphdef, params: the policy. io: text helpers. task: gives ``reward``.
    examples: held-out examples. key: PRNG key for the sampled pass.
    max_new_tokens: M. temperature: sampling temperature of the sampled pass.
    samples_per_example: completions per example in the sampled pass.
    chunk: rows per generate call (fixed so shapes, hence compiles, repeat).

  Returns:
    {"acc_greedy", "acc_sampled", "len_sampled"}: fractions in [0, 1] and mean
    completion length in tokens.
  """
  def run(exs, temp, k):
    rewards, lengths = [], []
    for s in range(0, len(exs), chunk):
      part = list(exs[s:s + chunk])
      n = len(part)
      part = part + [part[-1]] * (chunk - n) if len(exs) > chunk else part
      toks, mask, _ = io.prompts(part)
      k, sub = jax.random.split(k)
      g = generate(graphdef, params, toks, mask, sub, max_new_tokens=max_new_tokens,
                   temperature=temp, eos_ids=io.eos_ids, pad_id=io.pad_id)
      r, _ = score(task, io.decode(g.tokens[:n], g.mask[:n]), part[:n])
      rewards.append(r)
      lengths.append(np.asarray(g.length[:n]))
    return float(np.concatenate(rewards).mean()), float(np.concatenate(lengths).mean())

  acc_g, _ = run(examples, 0.0, key)
  rep = [e for e in examples for _ in range(samples_per_example)]
  acc_s, len_s = run(rep, temperature, key)
  return {"acc_greedy": acc_g, "acc_sampled": acc_s, "len_sampled": len_s}
