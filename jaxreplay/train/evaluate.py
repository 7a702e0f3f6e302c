"""Held-out evaluation: greedy and sampled accuracy, pass@k, length, fresh-sample entropy;
for math-graded tasks also strict and lenient accuracy (``grader_names``)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import attention as attention_lib
from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.rl.scoring import plan_rows, token_logprobs_by_rows
from jaxreplay.sampling import generate
from jaxreplay.tasks.base import Example
from jaxreplay.tasks.spec import MATH_EXTRACTIONS
from jaxreplay.train.policy import TextIO, score

PASS_AT = (1, 2, 4, 8, 16)


def pass_at_k(num_samples: np.ndarray, num_correct: np.ndarray, k: int) -> np.ndarray:
  """Unbiased pass@k per problem (Chen et al. 2021, "Evaluating LLMs trained on code", eq. 1).

  pass@k = 1 − C(n − c, k) / C(n, k), computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i) for
  numerical stability (the paper's Fig. 3 code).

  Args:
    num_samples: [E] int, n >= k samples per problem. num_correct: [E] int, c in [0, n].
    k: int >= 1.

  Returns:
    [E] float64 in [0, 1].

  Raises:
    ValueError: k < 1 or some n < k.
  """
  n = np.asarray(num_samples, np.int64)
  c = np.asarray(num_correct, np.int64)
  if k < 1 or (n < k).any():
    raise ValueError(f"pass@k needs 1 <= k <= samples per problem; got k={k}, n={n.min()}")
  out = np.empty(n.shape, np.float64)
  for j, (nj, cj) in enumerate(zip(n.reshape(-1), c.reshape(-1))):
    if nj - cj < k:
      out.reshape(-1)[j] = 1.0
    else:
      out.reshape(-1)[j] = 1.0 - np.prod(1.0 - k / np.arange(nj - cj + 1, nj + 1))
  return out


def grader_names(task) -> tuple[str, ...]:
  """The graders an evaluation of ``task`` runs besides its reward.

  A task graded by math-verify (``task.answer_extraction`` in ``MATH_EXTRACTIONS``) whose
  reward function offers them (``tasks.math_answer.MathReward``) is graded ``"strict"``
  (only the last ``\\boxed{}`` counts) and ``"lenient"`` (the last number, no format
  needed), so that a format gain and a correctness gain are told apart; any other task
  (``"bare"``, a reward function swapped for one without graders) by none.

  Args:
    task: the task (``answer_extraction``, and ``scorer`` or ``reward_fn``).

  Returns:
    The grader names, e.g. ``("strict", "lenient")``, or ``()``.
  """
  if getattr(task, "answer_extraction", "bare") not in MATH_EXTRACTIONS:
    return ()
  scorer = getattr(task, "scorer", None)
  if scorer is not None:
    return scorer.graders()
  fn = getattr(task, "reward_fn", None)
  return tuple(g for g in getattr(fn, "GRADERS", ()) if callable(getattr(fn, g, None)))


def _reward_grader(task) -> str | None:
  """The grader the task's reward equals (``MathReward.reward_grader``), if any."""
  scorer = getattr(task, "scorer", None)
  fn = scorer.reward_fn if scorer is not None else getattr(task, "reward_fn", None)
  return getattr(fn, "reward_grader", None)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p",
                                             "logprob_chunk", "rows"))
def _entropy_sum(graphdef, params, prompt_tokens, prompt_mask, tokens, mask, *, temperature,
                 top_k=0, top_p=1.0, logprob_chunk=0, rows=0, plan=None):
  """(Σ entropy, token count) over completion tokens of one generated chunk; with ``plan``
  (``scoring.plan_rows`` of the [prompt, completion] attention mask) scored packed."""
  full = jnp.concatenate([prompt_tokens, tokens], 1)
  attn = jnp.concatenate([prompt_mask, mask], 1)
  comp = jnp.concatenate([jnp.zeros_like(prompt_mask), mask], 1)
  _, ent = token_logprobs_by_rows(graphdef, params, full, attn, temperature, top_k, top_p,
                                  logprob_chunk, rows, plan)
  return jnp.where(comp, ent, 0.0).sum(), comp.sum()


def evaluate(graphdef, params, io: TextIO, task, examples: Sequence[Example], key: jax.Array,
             max_new_tokens: int, temperature: float, samples_per_example: int,
             chunk: int = 1024, correct_threshold: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, mesh=None, logprob_chunk: int = 0,
             score_rows: int = 0, pack: bool = False, record: Sequence[int] = (),
             progress=None, paged: bool = False, page_size: int = 16, num_pages: int = 0,
             attention: str = "auto") -> dict[str, Any]:
  """Held-out accuracy: greedy (temperature 0) and sampled at ``temperature``, with pass@k.

  Rewards go through ``policy.score``: the task's scorer, with the same timeout and worker
  pool as training. A math-graded task's completions of both passes are also graded by each
  of ``grader_names(task)`` through the same scorer (a call that fails scores 0 and is
  counted in ``grade_failures``); a grader the reward equals (``answer_extraction='boxed'``
  is the strict grade) reuses the rewards instead of grading again. The sampled pass draws
  ``samples_per_example`` completions per example; pass@k for k in ``PASS_AT`` up to that
  count uses the unbiased estimator (``pass_at_k``) with "correct" meaning reward >=
  ``correct_threshold``. The fresh-sample entropy is the
  mean per-token entropy of the policy's (tempered) next-token distribution over the
  completion tokens it just sampled — comparable to the training-batch ``entropy``,
  which is measured on replayed, possibly stale samples.

  Args:
    graphdef, params: the policy. io: text helpers. task: gives ``reward``.
    examples: held-out examples. key: PRNG key for the sampled pass.
    max_new_tokens: M. temperature: sampling temperature of the sampled pass (> 0).
    samples_per_example: completions per example in the sampled pass.
    chunk: decode slots of the engine (rows decoded at once, a finished row's slot taking
      the next request) and rows per fresh-sample entropy pass.
    correct_threshold: reward at or above which a completion counts as correct.
    top_k, top_p: the sampled pass's truncation (the sampler's ``sampler.top_k/top_p``;
      the fresh-sample entropy is that of the truncated distribution).
    mesh: optional mesh: each chunk's rows split over its ``data × fsdp`` axes
      (``sampling.generate``); the completions are gathered to every process
      (``parallel.multihost.to_host``), which all score them alike.
    logprob_chunk, score_rows: the fresh-sample entropy is computed ``score_rows`` rows and
      ``logprob_chunk`` positions at a time (``scoring.token_logprobs_by_rows``; 0 = all).
    pack: score the fresh samples' entropy on packed rows (``scoring.plan_rows``), as the
      learner does with ``algo.pack_sequences``.
    record: indices into ``examples`` whose completions are returned as records
      (``train.samples.eval_records``; empty: none).
    progress: optional progress bar (``tqdm``-like: ``total``, ``update(n)``, ``refresh()``):
      its total is set to an estimate of both passes' decode chunks and it advances by one
      before each chunk (the engine's ``weights`` hook, which swaps nothing here).
    paged, page_size, num_pages, attention: the engine's KV cache, as the rollouts'
      (``sampler.paged``, ``sampler.page_size``, ``sampler.num_pages``,
      ``sampler.attention``; ``sampling.generate``).

  Returns:
    {"acc_greedy", "acc_sampled" (= mean reward of the sampled pass), "len_sampled"
    (mean completion length, tokens), "entropy_fresh" (nats per token),
    "pass@k" for each k in PASS_AT with k <= samples_per_example (fractions in [0, 1]),
    "reward_failures" (int: reward calls of both passes that raised, returned NaN, timed
    out or lost their scoring worker; each scored 0)}; for each grader G of
    ``grader_names(task)`` also "acc_greedy_G" and "acc_sampled_G" (mean grade of each
    pass, fractions in [0, 1]: "acc_greedy_strict", "acc_sampled_lenient", ...) and once
    "grade_failures" (int: grading calls that failed as a reward call can, each scored 0);
    with ``record``, also "samples": the list of completion records
    (``train.samples.split`` takes it out), carrying each grade.
  """
  failures = [0, 0]  # reward, grading calls that raised, timed out or lost their worker
  graders = grader_names(task)
  same = _reward_grader(task)

  def tick():  # before each decode chunk: the bar moves, the weights stay
    if progress is not None:
      progress.update(1)
    return None

  if progress is not None:  # decode chunks if no row stopped early (the engine's 16 steps)
    per_row = -(-max_new_tokens // min(16, max_new_tokens))
    progress.total = sum(-(-n // max(min(chunk, n), 1)) * per_row
                         for n in (len(examples), len(examples) * samples_per_example))
    progress.refresh()

  def run(temp, k, group, with_entropy=False, tk=0, tp=1.0):
    # One engine call: ``chunk`` decode slots, each prompt prefilled once for its ``group``
    # samples, finished rows refilled from the remaining requests.
    toks, mask, _ = io.prompts(list(examples))
    g = generate(graphdef, params, toks, mask, k, max_new_tokens=max_new_tokens,
                 temperature=temp, top_k=tk, top_p=tp, eos_ids=io.eos_ids, pad_id=io.pad_id,
                 mesh=mesh, group_size=group, slots=chunk, weights=tick, paged=paged,
                 page_size=page_size, num_pages=num_pages, attention=attention)
    out = multihost.to_host({"tokens": g.tokens, "mask": g.mask, "length": g.length})
    rows = [e for e in examples for _ in range(group)]
    texts = io.decode(out["tokens"], out["mask"])
    rewards, f = score(task, texts, rows)
    failures[0] += f
    grades = {}
    for g in graders:
      if g == same:
        grades[g] = rewards
      else:
        grades[g], f = score(task, texts, rows, grader=g)
        failures[1] += f
    ent = [0.0, 0]
    if with_entropy:  # scored ``chunk`` rows at a time (fixed shapes; the last chunk padded)
      ptoks, pmask = np.repeat(toks, group, 0), np.repeat(mask, group, 0)
      n = len(rows)
      c = min(chunk, n)
      for s in range(0, n, c):
        idx = np.minimum(np.arange(s, s + c), n - 1)
        keep = np.arange(s, s + c) < n  # padding rows of the last chunk do not count
        comp = out["mask"][idx] & keep[:, None]
        plan = (sharding_lib.place_rows(plan_rows(
            np.concatenate([pmask[idx], comp], 1), score_rows, sharding_lib.batch_shards(mesh)),
            mesh) if pack else None)
        with attention_lib.kernel_mesh(mesh):  # a splash kernel runs per device
          e_sum, e_cnt = multihost.to_host(_entropy_sum(
              graphdef, params, jnp.asarray(ptoks[idx]), jnp.asarray(pmask[idx]),
              jnp.asarray(out["tokens"][idx]), jnp.asarray(comp), temperature=temp, top_k=tk,
              top_p=tp, logprob_chunk=logprob_chunk, rows=score_rows, plan=plan))
        ent[0] += float(e_sum)
        ent[1] += int(e_cnt)
    return rewards, out["length"], ent[0] / max(ent[1], 1), texts, grades

  r_g, len_g, _, t_g, grades_g = run(0.0, key, 1)
  r_s, len_s, ent, t_s, grades_s = run(temperature, key, samples_per_example,
                                       with_entropy=True, tk=top_k, tp=top_p)
  out = {"acc_greedy": float(r_g.mean()), "acc_sampled": float(r_s.mean()),
         "len_sampled": float(len_s.mean()), "entropy_fresh": float(ent),
         "reward_failures": failures[0]}
  for g in graders:
    out[f"acc_greedy_{g}"] = float(grades_g[g].mean())
    out[f"acc_sampled_{g}"] = float(grades_s[g].mean())
  if graders:
    out["grade_failures"] = failures[1]
  correct = (r_s >= correct_threshold).reshape(len(examples), samples_per_example).sum(1)
  n = np.full(len(examples), samples_per_example)
  for k in PASS_AT:
    if k <= samples_per_example:
      out[f"pass@{k}"] = float(pass_at_k(n, correct, k).mean())
  if record:
    from jaxreplay.train.samples import eval_records
    out["samples"] = eval_records(task, examples, record, (t_g, r_g, len_g), (t_s, r_s, len_s),
                                  samples_per_example,
                                  grades={g: (grades_g[g], grades_s[g]) for g in graders})
  return out
