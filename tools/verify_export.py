"""Checks a Hugging Face export against the run it came from: both libraries answer held-out
questions greedily, compared token for token.

    python -m jaxreplay.export --workdir runs/smollm2_135m --out exported/smollm2_rl
    python tools/verify_export.py --workdir runs/smollm2_135m --export exported/smollm2_rl --n 8

The checkpoint's policy (an Orbax partial restore, as ``jaxreplay.export`` reads it) answers
the first N held-out questions of the run's task with ``jaxreplay.sampling.generate`` at
temperature 0; transformers loads the export (``AutoModelForCausalLM``, ``AutoTokenizer``:
nothing but the exported directory) and answers the same prompts, rendered by the exported chat
template, with ``generate(do_sample=False)``. Prints each question, its gold answer, both
completions and jaxreplay's reward, and ends with the line
``verify: K of N greedy continuations equal token for token``.

Needs torch and transformers (the ``test`` extra), which the package itself does not import:
this is a script, not part of ``jaxreplay``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
import torch
import transformers

from jaxreplay import export
from jaxreplay.models.hf import abstract_model
from jaxreplay.sampling import generate
from jaxreplay.tasks import make_task
from jaxreplay.train.policy import score


def greedy_pairs(graphdef, params, io, examples, tok, model, max_new_tokens: int) -> list:
  """jaxreplay's and transformers' greedy continuations of the same prompts.

  jaxreplay generates from ``params`` (``sampling.generate`` at temperature 0, stopping at
  the run's stop ids); transformers from the exported ``model``, its prompt rendered by the
  exported tokenizer's chat template (one user turn after the run's system turn), or encoded
  with its special tokens where the run used no template.

  Args:
    graphdef, params: the policy (``nnx.GraphDef``, ``nnx.State``). io: the run's ``TextIO``
      (``jaxreplay.export.run_text_io``). examples: task ``Example``s. tok, model: the exported directory's
      ``AutoTokenizer`` and ``AutoModelForCausalLM`` (float32, eval mode).
    max_new_tokens: M, the most tokens generated per prompt.

  Returns:
    one ``(ours, theirs)`` per example: token id lists, ``ours`` up to its first stop id
    (the stop excluded, at most M), ``theirs`` cut to ``len(ours)``.

  Raises:
    ExportError: the exported tokenizer renders a prompt as other tokens than the run's.
  """
  toks, mask, _ = io.prompts(examples)
  g = generate(graphdef, params, toks, mask, jax.random.key(0), max_new_tokens=max_new_tokens,
               temperature=0.0, eos_ids=io.eos_ids, pad_id=io.pad_id)
  gen_tokens, gen_mask = np.asarray(g.tokens), np.asarray(g.mask)
  system = getattr(io, "system_prompt", "")
  pairs = []
  for i, e in enumerate(examples):
    prompt = [int(t) for t, m in zip(toks[i], mask[i]) if m]
    if getattr(io, "chat", True) and tok.chat_template:
      turns = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": e.prompt}]
      chat = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
      chat = list(chat["input_ids"] if not isinstance(chat, list) else chat)
    else:
      chat = list(tok(e.prompt)["input_ids"])
    if chat != prompt:
      raise export.ExportError(f"the exported tokenizer renders held-out prompt {i} as "
                               f"{len(chat)} tokens that differ from the run's {len(prompt)}")
    out = model.generate(torch.tensor([chat]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(chat), dtype=torch.long))
    ours = [int(t) for t, m in zip(gen_tokens[i], gen_mask[i]) if m]
    pairs.append((ours, out[0, len(chat):].tolist()[:len(ours)]))
  return pairs


def verify(workdir: str, out: str, *, n: int = 8, max_new_tokens: int | None = None,
           step: int | None = None, best: bool = False) -> dict:
  """Checks an export against the run: greedy answers to held-out questions, both ways.

  The checkpoint's policy (read as ``jaxreplay.export`` reads it) and the exported directory loaded by
  transformers each answer the first ``n`` held-out questions greedily (``greedy_pairs``);
  jaxreplay's completions are graded by the run's reward.

  Args:
    workdir: the run directory. out: its export (``export``). n: held-out questions.
    max_new_tokens: M (None: the run's ``sampler.max_new_tokens``).
    step, best: the checkpoint the export was made from (as ``jaxreplay.export``).

  Returns:
    {"step", "equal": questions whose continuations are equal token for token,
    "n", "rows": [{"question", "gold", "jaxreplay", "transformers" (texts), "tokens",
    "reward" (jaxreplay's completion), "equal" (bool), "first_diff" (index or None)}]}.

  Raises:
    ExportError: see ``jaxreplay.export``'s ``locate``, ``policy_config``, ``read_params``,
      ``run_text_io``, and ``greedy_pairs``; ``n`` < 1.
  """
  if n < 1:
    raise export.ExportError(f"--n {n}: the number of held-out questions must be at least 1")
  state_dir, step, tree = export.locate(workdir, step, best)
  c = export.run_specs(tree)
  cfg = export.policy_config(c)
  params = export.read_params(state_dir, cfg, c.model.lora_spec())
  graphdef, _ = abstract_model(cfg)
  task = make_task(c.task)
  io = export.run_text_io(c, workdir)
  examples = list(task.heldout[:n])
  m = max_new_tokens or c.sampler.max_new_tokens
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  pairs = greedy_pairs(graphdef, params, io, examples, tok, model, m)
  ours_text = [io.decode(np.asarray([o], np.int32), np.ones((1, len(o)), bool))[0]
               for o, _ in pairs]
  try:
    rewards, _ = score(task, ours_text, examples)
  finally:
    if getattr(task, "scorer", None) is not None:
      task.scorer.close()
  rows = []
  for e, (ours, theirs), text, r in zip(examples, pairs, ours_text, rewards):
    diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(theirs) == len(ours) else len(theirs))
    rows.append({"question": e.prompt, "gold": e.answer, "jaxreplay": text,
                 "transformers": tok.decode(theirs, skip_special_tokens=True),
                 "tokens": len(ours), "reward": float(r), "equal": diff is None,
                 "first_diff": diff})
  return {"step": step, "n": len(rows), "equal": sum(r["equal"] for r in rows), "rows": rows}


def main(argv=None) -> dict:
  """The command line (module docstring).

  Returns:
    ``verify``'s result.

  Raises:
    SystemExit: with one line, on any ``jaxreplay.export.ExportError``.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="the run directory")
  p.add_argument("--export", required=True, help="its Hugging Face export")
  p.add_argument("--n", type=int, default=8, help="held-out questions (the first N)")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="tokens per answer (default: the run's sampler.max_new_tokens)")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None,
                     help="the checkpoint the export was made from (default: newest)")
  which.add_argument("--best", action="store_true", help="the best held-out checkpoint")
  a = p.parse_args(argv)
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  try:
    v = verify(a.workdir, a.export, n=a.n, max_new_tokens=a.max_new_tokens, step=a.step,
               best=a.best)
  except export.ExportError as e:
    raise SystemExit(f"verify_export: {e}") from None
  for i, row in enumerate(v["rows"]):
    same = "same" if row["equal"] else f"differ from token {row['first_diff']}"
    print(f"[{i}] {row['question']!r} gold {row['gold']!r} reward {row['reward']:g}\n"
          f"    jaxreplay    {row['jaxreplay']!r}\n"
          f"    transformers {row['transformers']!r}  ({row['tokens']} tokens, {same})")
  print(f"verify: {v['equal']} of {v['n']} greedy continuations equal token for token")
  return v


if __name__ == "__main__":
  main(sys.argv[1:])
