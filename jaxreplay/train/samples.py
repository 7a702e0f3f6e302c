"""The model's own words, recorded: completions as JSON lines under ``WORKDIR/samples/``.

* ``eval_STEP.jsonl``: every evaluation (step 0 is the starting policy), one record per
  completion of a fixed subset of held-out questions (``eval.record`` of them, drawn once
  with the run's seed, the same every time): greedy and each sampled completion, with the
  prompt, the completion, the extracted and gold answers, the reward and the token count
  (for a math-graded task also its strict and lenient grades, ``train.evaluate``).
  The records come from the evaluation's own generations: recording decodes nothing twice
  and generates nothing more.
* ``train_STEP.jsonl``: every ``log.record_every`` learner steps, the first
  ``log.record_rollouts`` rows of the batch that step trains on — drawn again before the
  update with the learner's own key and version, so they are the same rows — with text,
  reward, advantage, generating policy versions (staleness) and the mean per-token
  importance ratio π_θ/μ under the parameters about to be updated.

The same records go to TensorBoard's text panel (``samples/eval``, ``samples/train``) when
``log.tensorboard`` is on.

A file is named by the learner steps completed, written whole (``write_atomic``) by process
0 only: a resumed run that redoes a step rewrites that step's file with the same content,
and the files of earlier steps stay.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jaxreplay import storage
from jaxreplay.parallel import multihost
from jaxreplay.replay import buffer as replay_buffer
from jaxreplay.rl.scoring import token_logprobs_by_rows

SAMPLES_DIR = "samples"
EVAL_FIELDS = ("step", "question_id", "mode", "sample", "prompt", "completion", "extracted",
               "gold", "reward", "completion_tokens")
TRAIN_FIELDS = ("step", "row", "prompt", "completion", "reward", "advantage",
                "policy_version", "newest_version", "staleness", "importance_ratio_mean",
                "completion_tokens", "truncated")


def record_indices(num_examples: int, count: int, seed: int) -> list[int]:
  """The held-out questions every evaluation records: ``min(count, num_examples)`` distinct
  indices in ``[0, num_examples)``, ascending, the same for the same seed.

  Args:
    num_examples: E, questions evaluated. count: ``eval.record`` (0: none). seed: the run's.

  Returns:
    [int] indices into the evaluated examples (= into the held-out split).
  """
  k = min(count, num_examples)
  if k <= 0:
    return []
  rng = np.random.default_rng([seed, 0x5A3])  # a stream of its own, apart from the seed's others
  return sorted(int(i) for i in rng.choice(num_examples, k, replace=False))


def extracted_answer(task, completion: str) -> str | None:
  """The answer ``task`` reads from ``completion``: math-verify's extraction with
  ``answer_extraction='math'``, the last box's content with ``'boxed'``, else the bare
  answer (``tasks.base.extract_answer``)."""
  extraction = getattr(task, "answer_extraction", "bare")
  if extraction == "math":
    from jaxreplay.tasks.math_answer import extract_answer_text
    return extract_answer_text(completion)
  if extraction == "boxed":
    from jaxreplay.tasks.math_answer import boxed_answer
    return boxed_answer(completion)
  from jaxreplay.tasks.base import extract_answer
  return extract_answer(completion)


def eval_records(task, examples: Sequence[Any], indices: Sequence[int], greedy: tuple,
                 sampled: tuple, samples_per_example: int,
                 grades: dict | None = None) -> list[dict]:
  """The records of one evaluation for the questions ``indices``.

  Args:
    task: the task (answer extraction). examples: the E evaluated examples.
    indices: which of them to record (``record_indices``).
    greedy: (texts [E] str, rewards [E] float, lengths [E] int) of the greedy pass.
    sampled: (texts [E·S], rewards [E·S], lengths [E·S]) of the sampled pass, S per example
      consecutively. samples_per_example: S.
    grades: optional {grader name: (greedy [E] float, sampled [E·S] float)}, the
      evaluation's other grades (``train.evaluate``: "strict", "lenient").

  Returns:
    One dict per completion (``EVAL_FIELDS`` but ``step``, then one field per grader,
    named by it): greedy first, then the S sampled, per question in ``indices`` order.
  """
  grades = grades or {}
  out = []
  for i in indices:
    e = examples[i]
    rows = [("greedy", 0, greedy, i)] + [("sampled", j, sampled, i * samples_per_example + j)
                                          for j in range(samples_per_example)]
    for mode, j, (texts, rewards, lengths), r in rows:
      out.append({"question_id": int(i), "mode": mode, "sample": j, "prompt": e.prompt,
                  "completion": texts[r], "extracted": extracted_answer(task, texts[r]),
                  "gold": e.answer, "reward": float(rewards[r]),
                  "completion_tokens": int(lengths[r]),
                  **{g: float(pair[mode == "sampled"][r]) for g, pair in grades.items()}})
  return out


def write(workdir: str, name: str, step: int, records: Sequence[dict]) -> str | None:
  """Writes ``WORKDIR/samples/NAME`` (JSON lines, ``step`` added to each record) whole, from
  process 0 only.

  Returns:
    The path written, or None on other processes or with no records.
  """
  if not records or not multihost.is_primary():
    return None
  path = os.path.join(workdir, SAMPLES_DIR, name)
  # object stores need no directories, but a filesystem behind a URL (and a local disk) does
  epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
  storage.write_atomic(path, "".join(json.dumps({"step": step, **r}) + "\n" for r in records))
  return path


def as_text(records: Sequence[dict]) -> str:
  """Records as markdown lines for TensorBoard's text panel: the fields, then the prompt and
  the completion in code spans."""
  lines = []
  for r in records:
    head = ", ".join(f"{k}={r[k]}" for k in r if k not in ("prompt", "completion", "step"))
    lines.append(f"- {head}: `{r['prompt']}` → `{r['completion']}`")
  return "\n".join(lines)


def split(evaluation: dict) -> tuple[dict, list[dict]]:
  """(metrics, records) of an evaluation dict: ``train.evaluate`` returns the records of
  ``record`` under ``"samples"`` beside its float metrics."""
  evaluation = dict(evaluation)
  return evaluation, evaluation.pop("samples", [])


def make_trained_fn(graphdef, rb, rows: int, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, logprob_chunk: int = 0, score_rows: int = 0):
  """Builds ``trained(params, buffer, key, version) -> dict`` (jitted, nothing donated): the
  first ``rows`` rows of the batch ``rb.sample`` draws with ``key`` at ``version`` (the
  learner's own draw, so the rows it is about to train on), scored under ``params``.

  Args:
    graphdef: the policy graph. rb: the buffer's bundle the learner samples with.
    rows: K <= B rows kept. temperature, top_k, top_p: the sampler's (log π under the
      distribution the behaviour log-probs were computed in).
    logprob_chunk, score_rows: as ``scoring.token_logprobs_by_rows``.

  Returns:
    The function; its dict holds ``tokens``/``attention_mask``/``completion_mask`` [K, T],
    ``reward``/``advantage`` [K] float32, ``policy_version``/``newest_version``/``staleness``
    [K] int32, ``truncated`` [K] bool and ``ratio_mean`` [K] float32, the mean over
    completion tokens of exp(log π − log μ).
  """
  k = min(rows, rb.batch_size)

  @jax.jit
  def trained(params, buffer, key, version):
    # the learner's draw (``rb.sample`` is this function jitted with the metadata donated)
    _, s = replay_buffer.sample(buffer, key, rb.batch_size, version, version, rb.spec)
    it = jax.tree.map(lambda a: a[:k], s.items)
    logp, _ = token_logprobs_by_rows(graphdef, params, it.tokens, it.attention_mask,
                                     temperature, top_k, top_p, logprob_chunk, score_rows)
    m = it.completion_mask
    ratio = jnp.where(m, jnp.exp(logp - it.behaviour_logprobs), 0.0).sum(-1) / jnp.maximum(
        m.sum(-1), 1)
    return {"tokens": it.tokens, "attention_mask": it.attention_mask, "completion_mask": m,
            "reward": it.rewards, "advantage": it.advantages,
            "policy_version": it.policy_version, "newest_version": it.newest_version,
            "staleness": s.staleness[:k], "truncated": it.truncated, "ratio_mean": ratio}

  return trained


def train_records(io, batch: dict) -> list[dict]:
  """Records of ``make_trained_fn``'s host output (``TRAIN_FIELDS`` but ``step``).

  Args:
    io: the run's ``TextIO``. batch: the dict of host arrays.
  """
  tokens, attn, comp = (np.asarray(batch[k]) for k in ("tokens", "attention_mask",
                                                        "completion_mask"))
  prompts = io.decode(tokens, attn & ~comp)
  completions = io.decode(tokens, comp)
  return [{"row": r, "prompt": prompts[r], "completion": completions[r],
           "reward": float(batch["reward"][r]), "advantage": float(batch["advantage"][r]),
           "policy_version": int(batch["policy_version"][r]),
           "newest_version": int(batch["newest_version"][r]),
           "staleness": int(batch["staleness"][r]),
           "importance_ratio_mean": float(batch["ratio_mean"][r]),
           "completion_tokens": int(comp[r].sum()), "truncated": bool(batch["truncated"][r])}
          for r in range(tokens.shape[0])]


def due(run, done: int) -> bool:
  """Whether learner step ``done`` (steps completed) writes ``train_STEP.jsonl``."""
  every = run.record_every
  return bool(every) and run.fns.trained is not None and done % every == 0


def peek_trained(run, params, buffer, key, version: int, done: int):
  """The host arrays of the rows the coming learner step trains on (``make_trained_fn``),
  when step ``done`` records them; else None. Every process calls it (the buffer may be
  sharded across them)."""
  if not due(run, done):
    return None
  return multihost.to_host(run.fns.trained(params, buffer, key,
                                           jnp.asarray(version, jnp.int32)))
