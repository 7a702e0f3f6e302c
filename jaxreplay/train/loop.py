"""The synchronous replay loop (the paper's theory model, Arnal et al. 2026 §4).

Each learner step t:
  1. generate R = P·G fresh rollouts with the current policy (version t), score them,
     compute group advantages, and add them to the FIFO buffer;
  2. sample B distinct rollouts uniformly from the buffer and take one off-policy
     update (clipped ratio against the stored behaviour log-probs).
On-policy training is N = R = B. Read top to bottom: ``run`` is the whole job.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxreplay import config as config_lib
from jaxreplay import replay
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.models.tokenizer import load_or_train_tokenizer
from jaxreplay.rl.advantages import compute_advantages
from jaxreplay.replay import stats as replay_stats
from jaxreplay.rl.losses import kl_penalised_rewards
from jaxreplay.rl.update import (TrainState, init_train_state, make_optimizer, make_train_step,
                                 token_logprobs)
from jaxreplay.rollout import Rollout, empty_rollout
from jaxreplay.sampling import generate
from jaxreplay.tasks import make_task
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train.data import PromptStream
from jaxreplay.train.evaluate import evaluate
from jaxreplay.train.metrics import MetricWriter
from jaxreplay.train.policy import TextIO, score
from jaxreplay.train.warmstart import base_policy_key, load_or_train_base_policy


def make_learner_step(train_step, batch_size: int, sampler_cfg: replay.SamplerConfig,
                      mesh=None, state_sharding=None, buffer_sharding=None):
  """Fuses buffer sampling and the update into one jitted function (state, buffer donated).

  The sampler's importance weights (uniform: all 1) and each item's staleness go to
  the train step; the batch statistics the paper plots come back in the metrics.

  Args:
    train_step: ``(state, batch, weights, staleness) -> (state, metrics)``.
    batch_size: B. sampler_cfg: the buffer's sampler.
    mesh: optional mesh: the sampled batch is constrained to split over ``data × fsdp``.
    state_sharding, buffer_sharding: optional sharding pytrees the returned state and
      buffer keep (the layout they were placed with).

  Returns:
    ``learner_step(state, buffer, key) -> (state, buffer, metrics)``; metrics are
    scalars except ``staleness_hist`` / ``steps_since_last_use_hist`` ([16] int32).
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def learner_step(state: TrainState, buffer: replay.BufferState, key):
    buffer, s = replay.sample(buffer, key, batch_size, state.step, state.step, sampler_cfg)
    if mesh is not None:  # the batch splits over the batch axes (data × fsdp)
      s = s.replace(items=jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x, sharding_lib.batch_sharding(mesh, x.ndim, batch_size)), s.items))
    state, metrics = train_step(state, s.items, s.weights, s.staleness)
    if state_sharding is not None:
      state = jax.lax.with_sharding_constraint(state, state_sharding)
    if buffer_sharding is not None:
      buffer = jax.lax.with_sharding_constraint(buffer, buffer_sharding)
    metrics.update(replay_stats.batch_stats(s))
    metrics.update(trained_tokens=s.items.completion_mask.sum(),
                   batch_reward=s.items.rewards.mean())
    return state, buffer, metrics

  return learner_step


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "beta", "estimator"))
def kl_reward_penalty(graphdef, ref_params, rollout: Rollout, *, temperature: float, beta: float,
                      estimator: str) -> jax.Array:
  """Rewards minus β·Σ_t KL_t(behaviour ‖ reference) per rollout (``algo.kl_mode='reward'``).

  The per-token KL estimate uses the stored behaviour log-probs and the frozen
  reference's log-probs of the same tokens (Ziegler et al. 2019, eq. 2; see
  ``rl.losses.kl_penalised_rewards``). Applied at generation time, before the group
  advantages.

  Returns:
    [N] float32 penalised rewards.
  """
  ref_logp, _ = token_logprobs(graphdef, ref_params, rollout.tokens, rollout.attention_mask,
                               temperature)
  return kl_penalised_rewards(rollout.rewards, rollout.behaviour_logprobs, ref_logp,
                              rollout.completion_mask, beta, estimator)


def generate_rollouts(cfg, io, task, graphdef, params, stream, key, version: int, log_counts,
                      ref_params=None, mesh=None):
  """Generates, scores and groups R = P·G rollouts with the current policy (host + jit).

  Draws P = R/G prompts from ``stream`` (skipping, and counting, prompts that do not fit
  when ``task.on_too_long='skip'``), samples G completions each, scores them with the
  task's reward (a raising reward counts as 0), and computes the group advantages at
  generation time — after the KL reward penalty when ``algo.kl_mode='reward'``.

  Args:
    cfg: the config. io: text helpers. task: reward source. graphdef, params: the policy.
    stream: prompt stream (advanced by P or more). key: PRNG key.
    version: int, the policy version stored with every rollout.
    log_counts: the ledger dict, updated in place (tokens, rollouts, failures, skips).
    ref_params: the frozen reference, used only for the KL reward penalty.
    mesh: optional mesh; the prompt batch is split over its ``data × fsdp`` axes.

  Returns:
    (Rollout with R rows, dict of host scalars: reward, frac_mixed_groups,
     completion_len, truncated_frac).
  """
  g = cfg.rollout.group_size
  p = cfg.rollout.per_step // g
  examples, skipped = [], 0
  while len(examples) < p:  # prompts that do not fit are skipped when on_too_long="skip"
    ex = stream.next(p - len(examples))
    _, _, keep = io.prompts(ex)
    examples += [e for e, k in zip(ex, keep) if k]
    skipped += int((~keep).sum())
  first_group = stream.position - p
  toks, mask, _ = io.prompts(examples)
  toks, mask = np.repeat(toks, g, 0), np.repeat(mask, g, 0)
  gen = generate(graphdef, params, toks, mask, key, max_new_tokens=cfg.sampler.max_new_tokens,
                 temperature=cfg.sampler.temperature, eos_ids=io.eos_ids, pad_id=io.pad_id,
                 mesh=mesh)
  rep = [e for e in examples for _ in range(g)]
  rewards, failures = score(task, io.decode(gen.tokens, gen.mask), rep,
                            cfg.task.reward_timeout_s or None)
  n = p * g
  zeros = np.zeros_like(mask)
  rollout = Rollout(
      tokens=jnp.concatenate([toks, gen.tokens], 1),
      attention_mask=jnp.concatenate([mask, gen.mask], 1),
      completion_mask=jnp.concatenate([zeros, gen.mask], 1),
      behaviour_logprobs=jnp.concatenate([np.zeros(mask.shape, np.float32), gen.logprobs], 1),
      rewards=jnp.asarray(rewards), advantages=jnp.zeros((n,), jnp.float32),
      group_id=jnp.asarray(np.repeat(np.arange(first_group, first_group + p), g), jnp.int32),
      policy_version=jnp.full((n,), version, jnp.int32), truncated=gen.truncated)
  shaped = rewards
  if ref_params is not None and cfg.algo.kl_mode == "reward" and cfg.algo.advantage != "gae":
    shaped = np.asarray(kl_reward_penalty(
        graphdef, ref_params, rollout, temperature=cfg.sampler.temperature,
        beta=cfg.algo.kl_coef, estimator=cfg.algo.kl_estimator))
  r_pg = rewards.reshape(p, g)
  adv = np.asarray(compute_advantages(jnp.asarray(shaped.reshape(p, g)), cfg.algo.advantage))
  rollout = rollout.replace(advantages=jnp.asarray(adv.reshape(-1), jnp.float32))
  lengths = np.asarray(gen.length)
  spread = r_pg.max(1) > r_pg.min(1)
  log_counts["generated_tokens"] += int(lengths.sum())
  log_counts["generated_rollouts"] += n
  log_counts["zero_adv_group_tokens"] += int(lengths.reshape(p, g)[~spread].sum())
  log_counts["reward_failures"] += failures
  log_counts["prompts_skipped"] += skipped
  return rollout, {"reward": float(rewards.mean()), "frac_mixed_groups": float(spread.mean()),
                   "completion_len": float(lengths.mean()),
                   "truncated_frac": float(np.asarray(gen.truncated).mean())}


def run(cfg, log=print) -> dict:
  """Runs the whole job described by ``cfg``; resumes from ``cfg.workdir`` if it holds a checkpoint.

  Returns:
    The summary dict also written to ``RUN_DIR/summary.json``.

  Raises:
    jaxreplay.config.ConfigError: invalid config (before any compilation).
    RuntimeError: ``algo.max_consecutive_skips`` non-finite updates in a row.
  """
  config_lib.validate(cfg)
  mesh_shape = config_lib.mesh_shape(cfg)
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  t_start = time.time()
  workdir = os.path.abspath(cfg.workdir)
  os.makedirs(workdir, exist_ok=True)
  manager = ckpt_lib.make_manager(os.path.join(workdir, "checkpoints"), cfg.checkpoint.max_to_keep)
  # The best held-out accuracy's train state, besides the last max_to_keep; resume uses
  # the latest (``manager``), never this one.
  best_manager = (ckpt_lib.make_best_manager(os.path.join(workdir, "checkpoints_best"))
                  if cfg.checkpoint.keep_best else None)
  best = ckpt_lib.best_so_far(best_manager) if best_manager is not None else None
  saved_meta = ckpt_lib.read_meta(manager)
  cfg_json = json.loads(cfg.to_json_best_effort())
  if saved_meta is not None:
    changes = ckpt_lib.config_changes(saved_meta["config"], cfg_json)
    if changes:
      raise config_lib.ConfigError(
          f"workdir {workdir} holds a checkpoint of a run with another config ("
          + "; ".join(changes) + "): pass a new --config.workdir, or the same values to resume")

  # --- task, tokenizer, base policy ------------------------------------------------------
  try:
    task = make_task(cfg.task)
  except (ValueError, FileNotFoundError) as e:  # a bad task config, before any compute
    raise config_lib.ConfigError(str(e)) from None
  ckpt_lib.write_atomic(os.path.join(workdir, "config.json"), cfg.to_json_best_effort(indent=2))
  base_dir = os.path.join(cfg.warmstart.cache_dir, base_policy_key(cfg))
  tok = load_or_train_tokenizer(os.path.join(base_dir, "tokenizer.json"),
                                [e.prompt + " " + e.answer for e in task.train],
                                cfg.model.vocab_size)
  io = TextIO.create(tok, cfg.task.prompt_width, cfg.task.on_too_long)
  graphdef, params, base_info = load_or_train_base_policy(cfg, io, task, log)
  heldout = task.heldout[:cfg.eval.num_examples]
  m = cfg.sampler.max_new_tokens
  evaluate_fn = functools.partial(evaluate, graphdef, io=io, task=task, examples=heldout,
                                  max_new_tokens=m, temperature=cfg.sampler.temperature,
                                  samples_per_example=cfg.eval.samples_per_example)

  # --- learner, buffer, RNG --------------------------------------------------------------
  optimizer = make_optimizer(cfg.algo.lr, cfg.algo.warmup_steps, cfg.algo.max_grad_norm,
                             weight_decay=cfg.algo.weight_decay,
                             # train.steps == 0 (evaluate only): no update, no schedule
                             schedule=cfg.algo.lr_schedule if cfg.train.steps else "constant",
                             total_steps=cfg.train.steps * cfg.algo.update_epochs
                             * cfg.algo.num_minibatches,
                             final_lr_fraction=cfg.algo.final_lr_fraction)
  # Parameters and optimizer state by PARAM_RULES, the buffer's capacity axis over "data",
  # the RNG key replicated; restores go into these layouts (any saved mesh restores).
  state = init_train_state(graphdef, params, optimizer, cfg.algo)
  state_sh = sharding_lib.param_shardings(state, mesh)
  state = jax.device_put(state, state_sh)
  buffer = replay.init(empty_rollout(1, cfg.task.prompt_width + m), cfg.buffer.capacity)
  buffer_sh = replay.state_sharding(buffer, mesh, "data")
  buffer = jax.device_put(buffer, buffer_sh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sampler_cfg = replay.from_config(cfg.buffer)
  add_to_buffer = jax.jit(replay.add, donate_argnums=(0,), out_shardings=buffer_sh)
  train_step = make_train_step(graphdef, optimizer, cfg.algo, cfg.sampler.temperature)
  learner_step = make_learner_step(train_step, cfg.train.batch_size, sampler_cfg, mesh,
                                   state_sh, buffer_sh)
  root_key = jax.random.key(cfg.seed)
  counts = dict(generated_tokens=0, generated_rollouts=0, trained_tokens=0, trained_samples=0,
                zero_adv_group_tokens=0, reward_failures=0, prompts_skipped=0)
  stream = PromptStream(task.train, seed=cfg.seed)
  start, summary0, wall_before = 0, None, 0.0
  timers = {"generate_s": 0.0, "train_s": 0.0, "eval_s": 0.0}  # seconds, continued on resume
  restored = ckpt_lib.restore(manager, {"train": state, "buffer": buffer, "rng": jax.device_put(
      jax.random.key_data(root_key), replicated)}, log=log)
  if restored is not None:
    tree, meta = restored
    state, buffer = tree["train"], tree["buffer"]
    root_key = jax.random.wrap_key_data(tree["rng"])
    start, counts, stream.position = int(meta["step"]), meta["counts"], meta["data_position"]
    timers.update(meta.get("timers", {}))
    summary0 = meta["eval_before"]
    wall_before = meta.get("wall_seconds", 0.0)
    log(f"resumed from {manager.directory} at step {start}")

  eval_key = jax.random.fold_in(root_key, 2**31 - 1)  # disjoint from the per-step keys
  writer = MetricWriter(workdir, cfg.log.tensorboard)
  if summary0 is None:
    summary0 = evaluate_fn(state.params, key=jax.random.fold_in(eval_key, 0))
    writer.write(0, {f"eval/{k}": v for k, v in summary0.items()})
    log(f"held-out before RL: greedy {summary0['acc_greedy']:.3f}, "
        f"sampled {summary0['acc_sampled']:.3f}")
  last_eval = dict(restored[1].get("last_eval", summary0)) if restored else dict(summary0)
  if start >= cfg.train.steps:
    log(f"the run in {workdir} is complete at step {start}; raise --config.train.steps to "
        "continue it")
  consecutive_skips = 0
  bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
             disable=not cfg.log.progress, dynamic_ncols=True)
  for step in bar:
    key_gen, key_sample = jax.random.split(jax.random.fold_in(root_key, step))
    t0 = time.time()
    rollout, gen_metrics = generate_rollouts(cfg, io, task, graphdef, state.params, stream,
                                             key_gen, step, counts, state.ref_params, mesh)
    buffer = add_to_buffer(buffer, rollout, rollout.policy_version, jnp.int32(step))
    t1 = time.time()
    state, buffer, metrics = learner_step(state, buffer, key_sample)
    metrics = jax.device_get(metrics)
    t2 = time.time()
    timers["generate_s"] += t1 - t0
    timers["train_s"] += t2 - t1
    counts["trained_tokens"] += int(metrics.pop("trained_tokens"))
    counts["trained_samples"] += cfg.train.batch_size
    consecutive_skips = consecutive_skips + 1 if metrics["skipped_update"] else 0
    if consecutive_skips >= cfg.algo.max_consecutive_skips:
      raise RuntimeError(f"{consecutive_skips} consecutive non-finite updates at step {step}; "
                         "lower algo.lr or check the data")
    hists = {k: metrics.pop(k).tolist() for k in ("staleness_hist", "steps_since_last_use_hist")}
    record = {**gen_metrics, **{k: float(v) for k, v in metrics.items()}, **counts, **hists,
              "replay_ratio": counts["trained_samples"] / max(counts["generated_rollouts"], 1),
              "buffer_size": int(buffer.size), **timers}
    done = step + 1
    if (cfg.eval.every and done % cfg.eval.every == 0) or done == cfg.train.steps:
      te = time.time()
      last_eval = evaluate_fn(state.params, key=jax.random.fold_in(eval_key, done))
      timers["eval_s"] += time.time() - te
      record.update({f"eval/{k}": v for k, v in last_eval.items()})
      if best_manager is not None and cfg.checkpoint.every:
        best = ckpt_lib.save_best(best_manager, best, done, {"train": state}, last_eval)
    writer.write(done, record)
    bar.set_postfix(reward=f"{gen_metrics['reward']:.2f}", acc=f"{last_eval['acc_sampled']:.2f}",
                    refresh=False)
    if cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == cfg.train.steps):
      ckpt_lib.save(manager, done, {"train": state, "buffer": buffer,
                                    "rng": jax.random.key_data(root_key)},
                    {"step": done, "counts": counts, "data_position": stream.position,
                     "eval_before": summary0, "last_eval": last_eval, "timers": timers,
                     "wall_seconds": wall_before + time.time() - t_start,
                     "config": json.loads(cfg.to_json_best_effort())})
  bar.close()
  manager.wait_until_finished()
  if best_manager is not None:
    best_manager.wait_until_finished()
  writer.close()
  final = last_eval
  summary = {
      "acc_greedy_before": summary0["acc_greedy"], "acc_sampled_before": summary0["acc_sampled"],
      "acc_greedy_after": final["acc_greedy"], "acc_sampled_after": final["acc_sampled"],
      "generated_tokens": counts["generated_tokens"], "trained_tokens": counts["trained_tokens"],
      "generated_rollouts": counts["generated_rollouts"], "steps": cfg.train.steps,
      "wall_seconds": wall_before + time.time() - t_start, "base_policy": base_info["path"],
      "checkpoints": os.path.join(workdir, "checkpoints"), **timers,
      "best_checkpoint": (None if best is None else
                          {"step": best[0], "eval/acc_sampled": best[1],
                           "path": os.path.join(workdir, "checkpoints_best", str(best[0]))}),
  }
  ckpt_lib.write_atomic(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=2))
  return summary
