"""GENERATE: R = P·G rollouts from the behaviour policy, scored, with group advantages.

``generate_rollouts`` is host code around the jitted sampler: it reads prompts at a data
position, samples G completions each, scores them with the task's verifiable reward and
computes the group advantages at generation time (Arnal et al. 2026, §3: advantages are
fixed when a rollout enters the buffer). It returns what it produced and what it cost as
values; the caller adds the ``Ledger`` increment and moves the data position.
``stream_rollouts`` produces round after round the same way from one set of decode slots
kept full across rounds (the actor–learner split's generator).
"""

from __future__ import annotations

import contextlib

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.rl.advantages import compute_advantages
from jaxreplay.rl.losses import kl_penalised_rewards
from jaxreplay.rl.scoring import plan_rows, token_logprobs_by_rows
from jaxreplay.rl.spec import AlgoSpec
from jaxreplay.rollout import Rollout
from jaxreplay.sampling import engine
from jaxreplay.sampling.generate import as_generation, generate
from jaxreplay.sampling.spec import SamplingSpec
from jaxreplay.train import accounting
from jaxreplay.train.ledger import Ledger
from jaxreplay.train.policy import score
from jaxreplay.train.spec import RolloutSpec


class Generation(NamedTuple):
  """What one call of ``generate_rollouts`` produced besides the rollouts.

  Attributes:
    ledger: the ``Ledger`` increment (tokens, rollouts, failures, skips, FLOPs).
    metrics: host floats ``reward``, ``frac_mixed_groups``, ``completion_len``,
      ``truncated_frac`` (means over the R rollouts); with
      ``rollout.behaviour_logprobs='learner'`` also ``behaviour_kl_sampler`` and
      ``behaviour_max_abs_log_ratio`` (``learner_behaviour_logprobs``).
    position: the data position after the prompts this call consumed.
    token_versions: [R, M] int32 host array, the policy version that sampled each
      completion token (0 past the stop), or None.
  """

  ledger: Ledger
  metrics: dict
  position: int
  token_versions: Any = None


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "beta", "estimator",
                                             "top_k", "top_p", "chunk", "rows"))
def kl_reward_penalty(graphdef, ref_params, rollout: Rollout, *, temperature: float, beta: float,
                      estimator: str, top_k: int = 0, top_p: float = 1.0, chunk: int = 0,
                      rows: int = 0, plan=None) -> jax.Array:
  """Rewards minus β·Σ_t KL_t(behaviour ‖ reference) per rollout (``algo.kl_mode='reward'``).

  The per-token KL estimate uses the stored behaviour log-probs and the frozen
  reference's log-probs of the same tokens (Ziegler et al. 2019, eq. 2; see
  ``rl.losses.kl_penalised_rewards``). Applied at generation time, before the group
  advantages.

  Args:
    graphdef: the policy's NNX graph (static). ref_params: the frozen reference's state.
    rollout: [N, T] rollouts with behaviour log-probs. temperature, top_k, top_p: the
      sampler's (static). beta: KL coefficient β >= 0. estimator: 'k1', 'k2' or 'k3'.
    chunk, rows: the reference is scored ``rows`` rows and ``chunk`` positions at a time
      (``scoring.token_logprobs_by_rows``; 0 = all at once).
    plan: None, or ``scoring.plan_rows(attention_mask, rows)``: each pass packed.

  Returns:
    [N] float32 penalised rewards.
  """
  ref_logp, _ = token_logprobs_by_rows(graphdef, ref_params, rollout.tokens,
                                       rollout.attention_mask, temperature, top_k, top_p,
                                       chunk, rows, plan)
  return kl_penalised_rewards(rollout.rewards, rollout.behaviour_logprobs, ref_logp,
                              rollout.completion_mask, beta, estimator)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k", "top_p",
                                             "chunk", "rows"))
def learner_behaviour_logprobs(graphdef, params, rollout: Rollout, *, temperature: float,
                               top_k: int = 0, top_p: float = 1.0, chunk: int = 0,
                               rows: int = 0, plan=None) -> tuple[jax.Array, dict]:
  """Behaviour log-probs recomputed by the learner's forward (``rollout.behaviour_logprobs='learner'``).

  The sampler's cached decode and the learner's full forward round differently in
  bfloat16, so with the sampler's log-probs the importance ratio of a fresh rollout at
  the very parameters that generated it is not exactly 1 (``bench/bf16_ratio.py``
  measures the spread). Scoring the stored tokens with the learner's own function
  (``scoring.token_logprobs_by_rows``: the train step's log-prob chunks and, with gradient
  accumulation, its micro-batch rows — the shapes its forward runs at) before insertion
  makes it exactly 1 (``tests/test_bf16_ratio.py``), so the clip range and truncation act
  on policy change alone; the sampler-vs-learner difference is reported, not corrected
  (cf. the recompute of verl's ``old_log_prob``; Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training", weight it by truncated IS).

  Args:
    graphdef, params: the behaviour policy (the parameters that sampled ``rollout``).
    rollout: [N, T] rollouts with the sampler's behaviour log-probs.
    temperature, top_k, top_p: the sampler's (static). chunk, rows: the learner's
      ``algo.logprob_chunk`` and micro-batch rows (``scoring.micro_batch_rows``).
    plan: None, or ``scoring.plan_rows(attention_mask, rows)``: each pass runs packed, as
      the learner does with ``algo.pack_sequences``.

  Returns:
    (logp [N, T] float32: the learner's log-probs on completion columns, 0 elsewhere;
     metrics: float32 scalars over completion tokens of x = log π_learner − log μ_sampler:
     ``behaviour_kl_sampler`` (mean k3, exp(x) − 1 − x, Schulman 2020) and
     ``behaviour_max_abs_log_ratio`` (max |x|)).
  """
  logp, _ = token_logprobs_by_rows(graphdef, params, rollout.tokens, rollout.attention_mask,
                                   temperature, top_k, top_p, chunk, rows, plan)
  mask = rollout.completion_mask
  logp = jnp.where(mask, logp, 0.0)
  x = jnp.where(mask, logp - rollout.behaviour_logprobs, 0.0)
  n = jnp.maximum(mask.sum(), 1)
  return logp, {"behaviour_kl_sampler": (jnp.expm1(x) - x).sum() / n,
                "behaviour_max_abs_log_ratio": jnp.abs(x).max()}


def _place(tree, mesh):
  """Host arrays of R rows as device arrays: without a mesh on the default device, with
  one split over its ``data × fsdp`` axes, each process placing only its devices' rows."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)
  return jax.tree.map(lambda x: multihost.to_global(
      x, sharding_lib.batch_sharding(mesh, x.ndim, x.shape[0])), tree)


def _fitting_prompts(io, stream, position: int, p: int) -> tuple[list, int, int]:
  """P prompts from ``position`` on, skipping those ``io`` rejects as too long.

  Returns:
    (examples, prompts skipped, new position).
  """
  examples, skipped = [], 0
  while len(examples) < p:
    ex = stream.take(position, p - len(examples))
    position += len(ex)
    _, _, keep = io.prompts(ex)
    examples += [e for e, k in zip(ex, keep) if k]
    skipped += int((~keep).sum())
  return examples, skipped, position


@dataclasses.dataclass(frozen=True)
class RolloutSource:
  """What a generation round needs that stays fixed over the run.

  Attributes:
    rollout: the ``rollout`` section (R, G, where behaviour log-probs come from).
    sampling: the ``sampler`` section (decoding; the engine's slots and chunk).
    algo: the ``algo`` section (advantage estimator, KL reward penalty, the learner's
      log-prob chunk and packing, which the rescoring passes follow).
    io: ``TextIO`` (prompt tokens, decoding, stop and pad ids). task: the reward source.
    graphdef: the policy's NNX graph. stream: ``PromptStream`` of the train split.
    prompt_width: P, prompt tokens per rollout row.
    reward_timeout_s: seconds per reward call before it scores 0, or None (no limit).
    score_rows: rows per pass of the scoring passes (the learner's micro-batch rows).
    cost: the model's FLOP parameters, or None (no FLOP counts).
    mesh: optional mesh; the prompt batch splits over its ``data × fsdp`` axes.
    rollout_mesh: the mesh the returned rollouts are placed on, when it is not ``mesh``
      (the learner mesh of the actor–learner split; the generator runs on ``mesh``).
  """

  rollout: RolloutSpec
  sampling: SamplingSpec
  algo: AlgoSpec
  io: Any
  task: Any
  graphdef: Any
  stream: Any
  prompt_width: int
  reward_timeout_s: float | None
  score_rows: int
  cost: accounting.ModelCost | None = None
  mesh: Any = None
  rollout_mesh: Any = None


class RoundPrompts(NamedTuple):
  """One round's prompts (``round_prompts``).

  Attributes:
    examples: the P task examples. skipped: prompts skipped as too long.
    position: the data position after them. tokens, mask: [P, prompt_width] int32 / bool.
  """

  examples: list
  skipped: int
  position: int
  tokens: np.ndarray
  mask: np.ndarray


def round_prompts(src: RolloutSource, position: int) -> RoundPrompts:
  """P = R/G prompts from ``src.stream`` at ``position``, skipping (and counting) those that
  do not fit when ``task.on_too_long='skip'`` (host)."""
  examples, skipped, position = _fitting_prompts(src.io, src.stream, position,
                                                 src.rollout.prompts_per_step)
  tokens, mask, _ = src.io.prompts(examples)
  return RoundPrompts(examples, skipped, position, tokens, mask)


def _engine_options(src: RolloutSource) -> dict:
  """The ``sampler`` settings of ``generate`` and ``engine.stream``."""
  samp, io = src.sampling, src.io
  return dict(max_new_tokens=samp.max_new_tokens, temperature=samp.temperature,
              top_k=samp.top_k, top_p=samp.top_p, eos_ids=io.eos_ids, pad_id=io.pad_id,
              mesh=src.mesh, group_size=src.rollout.group_size, slots=samp.slots,
              chunk_steps=samp.chunk_steps, paged=samp.paged, page_size=samp.page_size,
              num_pages=samp.num_pages, attention=samp.attention,
              overlap_host_check=samp.overlap_host_check, on_weight_swap=samp.on_weight_swap)


def generate_rollouts(src: RolloutSource, params, position: int, key, version: int,
                      ref_params=None, weights=None) -> tuple[Rollout, Generation]:
  """Generates, scores and groups R = P·G rollouts with the behaviour policy (host + jit).

  Reads P = R/G prompts from ``src.stream`` at ``position`` (``round_prompts``), samples G
  completions each and hands them to ``finish_round``: scored with the task's reward (a
  raising or timed-out reward counts as 0), grouped, with the group advantages — after
  the KL reward penalty when ``algo.kl_mode='reward'``. With
  ``rollout.behaviour_logprobs='learner'`` the behaviour log-probs are rescored by the
  learner's forward first (``learner_behaviour_logprobs``).

  Args:
    src: the fixed ``RolloutSource``. params: the behaviour policy's parameters.
    position: int, data position of the first prompt. key: PRNG key of the sampler.
    version: int, the policy version of ``params``.
    ref_params: the frozen reference, used only for the KL reward penalty.
    weights: optional in-flight weight source (``sampling.engine.run``): newer parameters
      may replace ``params`` between decode chunks; each rollout records the oldest and
      newest version that sampled its tokens (``policy_version``, ``newest_version``).

  Returns:
    (``Rollout`` with R rows of width ``prompt_width + sampler.max_new_tokens``,
     ``Generation``).
  """
  prompts = round_prompts(src, position)
  gen = generate(src.graphdef, params, prompts.tokens, prompts.mask, key, version=version,
                 weights=weights, **_engine_options(src))
  return finish_round(src, params, prompts, gen, ref_params, in_flight=weights is not None)


def stream_rollouts(src: RolloutSource, params, position: int, key, version: int,
                    next_round, deliver, weights=None) -> None:
  """Rounds of R rollouts at consecutive data positions from one set of decode slots kept
  full across rounds (``sampling.engine.stream``), each finished round handed on as
  ``generate_rollouts`` returns it.

  Round j reads its prompts at the position round j − 1 ended at (``round_prompts``) and
  samples with ``fold_in(key, its position)``: the keys ``generate_rollouts`` would get
  from a caller folding in each round's position.

  Args:
    src, params, version, weights: as ``generate_rollouts`` (``params`` of version
      ``version`` start the stream; ``weights`` swaps newer ones in between chunks).
    position: data position of the first round's first prompt. key: the base PRNG key.
    next_round: ``(block: bool) -> params | None``: whether the next round may start now
      (the engine asks once every request it holds is admitted; with ``block``, nothing
      decodes and it may wait); the parameters given are the behaviour policy the
      rescoring passes use for that round (``rollout.behaviour_logprobs='learner'``).
      None: not now, or with ``block`` the stream's end. May raise to abandon the stream.
    deliver: ``(Rollout, Generation) -> None``, each finished round, in order.

  Raises:
    As ``generate_rollouts``; whatever ``next_round`` raises.
  """
  at = {"position": position}

  def engine_next(block):
    behaviour = next_round(block)
    if behaviour is None:
      return None
    prompts = round_prompts(src, at["position"])
    round_key = jax.random.fold_in(key, at["position"])
    at["position"] = prompts.position
    return prompts.tokens, prompts.mask, round_key, (prompts, behaviour)

  def engine_deliver(tag, tokens, logprobs, full, _length, versions):
    prompts, behaviour = tag
    gen = as_generation(tokens, logprobs, full, versions, eos_ids=src.io.eos_ids,
                        pad_id=src.io.pad_id, mesh=src.mesh)
    deliver(*finish_round(src, behaviour, prompts, gen, None, in_flight=weights is not None))

  opts = _engine_options(src)
  if opts.pop("mesh") is not None:
    params = sharding_lib.shard_params(params, src.mesh)
  engine.stream(src.graphdef, params, engine_next, engine_deliver, mesh=src.mesh,
                version=version, weights=weights, **opts)


def finish_round(src: RolloutSource, params, prompts: RoundPrompts, gen, ref_params=None,
                 in_flight: bool = False) -> tuple[Rollout, Generation]:
  """A round's sampled completions (``sampling.generate.Generation``, [R, M]) as scored,
  grouped rollouts with their advantages (``generate_rollouts``'s second half).

  Args:
    src: the ``RolloutSource``. params: the behaviour policy the rescoring passes use.
    prompts: the round's ``RoundPrompts``. gen: its completions, request r the sample
      r % G of prompt r // G. ref_params: the KL reward penalty's reference, or None.
    in_flight: weights may have been swapped during the round (adds ``version_span``).

  Returns:
    (``Rollout`` of R rows, ``Generation``).
  """
  io, task, graphdef, mesh, cost = src.io, src.task, src.graphdef, src.mesh, src.cost
  samp, algo = src.sampling, src.algo
  g = src.rollout.group_size
  p = src.rollout.prompts_per_step
  examples, skipped, position = prompts.examples, prompts.skipped, prompts.position
  prompt_toks, prompt_mask = prompts.tokens, prompts.mask
  first_group = position - p
  # Rollout rows: prompt r // G's tokens beside completion r (the engine's request order).
  toks, mask = np.repeat(prompt_toks, g, 0), np.repeat(prompt_mask, g, 0)
  # Every process reads the whole generation (gathered across processes), so each decodes,
  # scores and groups the same R rollouts; placement below gives each device its rows.
  out = multihost.to_host({"tokens": gen.tokens, "mask": gen.mask, "logprobs": gen.logprobs,
                           "length": gen.length, "truncated": gen.truncated,
                           "versions": gen.versions})
  big = np.iinfo(np.int32).max  # every row has at least one token (its length >= 1)
  oldest = np.where(out["mask"], out["versions"], big).min(1).astype(np.int32)
  newest = np.where(out["mask"], out["versions"], -1).max(1).astype(np.int32)
  rep = [e for e in examples for _ in range(g)]
  rewards, failures = score(task, io.decode(out["tokens"], out["mask"]), rep,
                            src.reward_timeout_s)
  n = p * g
  zeros = np.zeros_like(mask)
  host = Rollout(
      tokens=np.concatenate([toks, out["tokens"]], 1).astype(np.int32),
      attention_mask=np.concatenate([mask, out["mask"]], 1),
      completion_mask=np.concatenate([zeros, out["mask"]], 1),
      behaviour_logprobs=np.concatenate([np.zeros(mask.shape, np.float32), out["logprobs"]], 1),
      rewards=np.asarray(rewards, np.float32), advantages=np.zeros((n,), np.float32),
      group_id=np.repeat(np.arange(first_group, first_group + p), g).astype(np.int32),
      policy_version=oldest, truncated=np.asarray(out["truncated"]), newest_version=newest)
  out_mesh = mesh if src.rollout_mesh is None else src.rollout_mesh
  rollout = _place(host, out_mesh)
  chunk, rows = algo.logprob_chunk, src.score_rows
  # the scoring passes run on packed rows when the learner does (their cost follows the
  # real tokens); the plan is host numpy from the host attention mask
  plan = (sharding_lib.place_rows(plan_rows(host.attention_mask, rows,
                                            sharding_lib.batch_shards(out_mesh)), out_mesh)
          if algo.pack_sequences else None)
  numerics = {}
  # The scoring passes trace under the same context mesh as the learner's step
  # (``learner.under_mesh``), so they run the model's FSDP layout too: the rescored
  # behaviour log-probs then equal the step's own to the bit, and the ratio is 1 on-policy.
  scoring_mesh = (lambda: jax.set_mesh(out_mesh)) if out_mesh is not None else contextlib.nullcontext
  if src.rollout.behaviour_logprobs == "learner":
    with scoring_mesh():
      logp, numerics = learner_behaviour_logprobs(
          graphdef, params, rollout, temperature=samp.temperature,
          top_k=samp.top_k, top_p=samp.top_p, chunk=chunk, rows=rows, plan=plan)
    rollout = rollout.replace(behaviour_logprobs=logp)
    numerics = {k: float(v) for k, v in multihost.to_host(numerics).items()}
  shaped = rewards
  kl_reward = ref_params is not None and algo.kl_mode == "reward" and algo.advantage != "gae"
  if kl_reward:
    with scoring_mesh():
      shaped = multihost.to_host(kl_reward_penalty(
          graphdef, ref_params, rollout, temperature=samp.temperature,
          beta=algo.kl_coef, estimator=algo.kl_estimator, top_k=samp.top_k,
          top_p=samp.top_p, chunk=chunk, rows=rows, plan=plan))
  r_pg = rewards.reshape(p, g)
  adv = np.asarray(compute_advantages(jnp.asarray(shaped.reshape(p, g)), algo.advantage))
  rollout = rollout.replace(advantages=_place(adv.reshape(-1).astype(np.float32), out_mesh))
  lengths = np.asarray(out["length"])
  truncated = np.asarray(out["truncated"])
  spread = r_pg.max(1) > r_pg.min(1)
  # useful FLOPs of the real prompt and completion tokens; each scoring pass above (the
  # learner's rescoring, the reference's KL penalty) is one more forward per rollout
  scoring = int(src.rollout.behaviour_logprobs == "learner") + int(kl_reward)
  flops = 0.0 if cost is None else float(accounting.generation_flops(
      cost, mask.sum(1).astype(np.float64), lengths.astype(np.float64), scoring).sum())
  ledger = Ledger(generated_tokens=int(lengths.sum()), generated_rollouts=n,
                  zero_adv_group_tokens=int(lengths.reshape(p, g)[~spread].sum()),
                  truncated_tokens=int(lengths[truncated].sum()), generation_flops=flops,
                  reward_failures=failures, prompts_skipped=skipped)
  metrics = {"reward": float(rewards.mean()), "frac_mixed_groups": float(spread.mean()),
             "completion_len": float(lengths.mean()), "truncated_frac": float(truncated.mean()),
             **numerics}
  if in_flight:
    metrics["version_span"] = float((newest - oldest).mean())
  return rollout, Generation(ledger, metrics, position, out["versions"])


def mean_metrics(ms: list[dict]) -> dict:
  """Key-wise mean of generation metric dicts (an empty list gives an empty dict)."""
  return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]} if ms else {}
