"""The replay loop in three modes (``train.mode``; Arnal et al. 2026 §3, §4).

``sync`` — the paper's theory model (§4). Each learner step t:
  1. generate R = P·G fresh rollouts with the current policy (version t), score them,
     compute group advantages, and add them to the FIFO buffer;
  2. sample B distinct rollouts uniformly from the buffer and take one off-policy
     update (clipped ratio against the stored behaviour log-probs).
``simulated_async`` — the same single-process schedule, but step 1 uses the parameters
of exactly ``train.lag`` learner steps ago (version max(t − lag, 0)) and stamps the
rollouts with that version: the staleness of an asynchronous system, bit-reproducibly.
The ring of the last ``lag`` parameter snapshots is checkpointed, so resuming continues
the same trajectory.
``async`` — the paper's experimental system (§3): a generator thread with its own copy of
the weights (refreshed every ``train.weight_sync_every`` learner steps) inserts R rollouts
at a time while the learner trains; a samples-per-insert rate limiter
(``replay.rate_limiter``) holds the replay ratio ρ. On one host ρ stands in for the W/T
split (W/T = μ/ρ, see ``accounting``). Thread timing decides which weights generate
which rollouts, so this mode is *not* bit-reproducible; a resumed run loses the rollouts
the generator had in flight.
On-policy training is N = R = B in any mode. Read top to bottom: ``run`` is the whole job.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxreplay import config as config_lib
from jaxreplay import replay
from jaxreplay.models import hf as hf_models
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.models.tokenizer import load_or_train_tokenizer
from jaxreplay.rl.advantages import compute_advantages
from jaxreplay.replay import rate_limiter as rate_lib
from jaxreplay.replay import stats as replay_stats
from jaxreplay.rl.losses import kl_penalised_rewards
from jaxreplay.rl.update import (TrainState, init_train_state, make_optimizer, make_train_step,
                                 token_logprobs)
from jaxreplay.rollout import Rollout, empty_rollout
from jaxreplay.sampling import generate
from jaxreplay.tasks import make_task
from jaxreplay.train import accounting
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train.data import PromptStream
from jaxreplay.train.drift import make_drift_fn
from jaxreplay.train.evaluate import evaluate
from jaxreplay.train.metrics import MetricWriter
from jaxreplay.train.policy import HFTextIO, TextIO, score
from jaxreplay.train.warmstart import base_policy_key, load_or_train_base_policy


def make_learner_step(train_step, batch_size: int, sampler_cfg: replay.SamplerConfig,
                      cost: accounting.ModelCost | None = None, prompt_len: int = 0,
                      epochs: int = 1, mesh=None, state_sharding=None,
                      buffer_sharding=None):
  """Fuses buffer sampling and the update into one jitted function (state, buffer donated).

  The sampler's importance weights (uniform: all 1) and each item's staleness go to
  the train step; the batch statistics the paper plots come back in the metrics.

  Args:
    train_step: from ``rl.update.make_train_step``. batch_size: B. sampler_cfg: static.
    cost: the model's FLOP parameters; with it the metrics carry ``training_flops``.
    prompt_len: P, prompt width in tokens (FLOP estimate). epochs: ``algo.update_epochs``.
    mesh: optional mesh: the sampled batch is constrained to split over ``data × fsdp``.
    state_sharding, buffer_sharding: optional sharding pytrees the returned state and
      buffer keep (the layout they were placed with).

  Returns:
    ``learner_step(state, buffer, key) -> (state, buffer, metrics)``; metrics are
    scalars except ``staleness_hist`` / ``steps_since_last_use_hist`` ([16] int32).
    ``trained_tokens`` counts completion tokens with reuse; ``first_use_tokens`` those
    of items drawn for the first time (the "trained on at least once" ledger).
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def learner_step(state: TrainState, buffer: replay.BufferState, key):
    never_used = buffer.valid & (buffer.times_sampled == 0)
    buffer, s = replay.sample(buffer, key, batch_size, state.step, state.step, sampler_cfg)
    if mesh is not None:  # the batch splits over the batch axes (data × fsdp)
      s = s.replace(items=jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x, sharding_lib.batch_sharding(mesh, x.ndim, batch_size)), s.items))
    first_use = never_used & (buffer.times_sampled > 0)  # per slot: a duplicate counts once
    state, metrics = train_step(state, s.items, s.weights, s.staleness)
    if state_sharding is not None:
      state = jax.lax.with_sharding_constraint(state, state_sharding)
    if buffer_sharding is not None:
      buffer = jax.lax.with_sharding_constraint(buffer, buffer_sharding)
    metrics.update(replay_stats.batch_stats(s))
    lengths = s.items.completion_mask.sum(-1, dtype=jnp.int32)
    metrics.update(trained_tokens=lengths.sum(),
                   batch_reward=s.items.rewards.mean(),
                   first_use_tokens=jnp.where(
                       first_use, buffer.items.completion_mask.sum(-1, dtype=jnp.int32), 0).sum())
    if cost is not None:
      metrics["training_flops"] = accounting.training_flops(cost, prompt_len, lengths,
                                                            epochs).sum()
    return state, buffer, metrics

  return learner_step


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "beta", "estimator",
                                             "top_k", "top_p"))
def kl_reward_penalty(graphdef, ref_params, rollout: Rollout, *, temperature: float, beta: float,
                      estimator: str, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Rewards minus β·Σ_t KL_t(behaviour ‖ reference) per rollout (``algo.kl_mode='reward'``).

  The per-token KL estimate uses the stored behaviour log-probs and the frozen
  reference's log-probs of the same tokens (Ziegler et al. 2019, eq. 2; see
  ``rl.losses.kl_penalised_rewards``). Applied at generation time, before the group
  advantages.

  Returns:
    [N] float32 penalised rewards.
  """
  ref_logp, _ = token_logprobs(graphdef, ref_params, rollout.tokens, rollout.attention_mask,
                               temperature, top_k, top_p)
  return kl_penalised_rewards(rollout.rewards, rollout.behaviour_logprobs, ref_logp,
                              rollout.completion_mask, beta, estimator)


def generate_rollouts(cfg, io, task, graphdef, params, stream, key, version: int, log_counts,
                      ref_params=None, cost: accounting.ModelCost | None = None,
                      mesh=None):
  """Generates, scores and groups R = P·G rollouts with the current policy (host + jit).

  Draws P = R/G prompts from ``stream`` (skipping, and counting, prompts that do not fit
  when ``task.on_too_long='skip'``), samples G completions each, scores them with the
  task's reward (a raising reward counts as 0), and computes the group advantages at
  generation time — after the KL reward penalty when ``algo.kl_mode='reward'``.

  Args:
    cfg: the config. io: text helpers. task: reward source. graphdef, params: the policy.
    stream: prompt stream (advanced by P or more). key: PRNG key.
    version: int, the policy version stored with every rollout.
    log_counts: the ledger dict, updated in place (tokens, rollouts, failures, skips,
      tokens of zero-advantage groups and of truncated rollouts, generation FLOPs).
    ref_params: the frozen reference, used only for the KL reward penalty.
    cost: the model's FLOP parameters (``accounting.ModelCost``), or None (no FLOPs).
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
                 temperature=cfg.sampler.temperature, top_k=cfg.sampler.top_k,
                 top_p=cfg.sampler.top_p, eos_ids=io.eos_ids, pad_id=io.pad_id,
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
        beta=cfg.algo.kl_coef, estimator=cfg.algo.kl_estimator, top_k=cfg.sampler.top_k,
        top_p=cfg.sampler.top_p))
  r_pg = rewards.reshape(p, g)
  adv = np.asarray(compute_advantages(jnp.asarray(shaped.reshape(p, g)), cfg.algo.advantage))
  rollout = rollout.replace(advantages=jnp.asarray(adv.reshape(-1), jnp.float32))
  lengths = np.asarray(gen.length)
  spread = r_pg.max(1) > r_pg.min(1)
  log_counts["generated_tokens"] += int(lengths.sum())
  log_counts["generated_rollouts"] += n
  log_counts["zero_adv_group_tokens"] += int(lengths.reshape(p, g)[~spread].sum())
  log_counts["truncated_tokens"] += int(lengths[np.asarray(gen.truncated)].sum())
  if cost is not None:
    log_counts["generation_flops"] += float(
        accounting.generation_flops(cost, cfg.task.prompt_width, lengths.astype(np.float64)).sum())
  log_counts["reward_failures"] += failures
  log_counts["prompts_skipped"] += skipped
  return rollout, {"reward": float(rewards.mean()), "frac_mixed_groups": float(spread.mean()),
                   "completion_len": float(lengths.mean()),
                   "truncated_frac": float(np.asarray(gen.truncated).mean())}


def load_policy(cfg, task, log=print):
  """The starting policy and its text I/O, by ``model.source``.

  ``builtin``: the byte-level BPE tokenizer and the small decoder of ``cfg.model``,
  warm-started on the task (cached under ``warmstart.cache_dir``). ``hf``: a Hugging Face
  checkpoint directory ``model.path`` (``config.json``, safetensors, ``tokenizer.json``),
  loaded as is in ``model.dtype`` / ``model.param_dtype``; prompts go through its chat
  template when ``task.chat_template``.

  Returns:
    (io: TextIO, graphdef, params, info dict with at least ``path``).

  Raises:
    jaxreplay.models.hf.CheckpointMismatchError: checkpoint tensors that do not match its
      config (every mismatch listed). FileNotFoundError: files missing from ``model.path``.
  """
  if cfg.model.source == "hf":
    io = HFTextIO.from_pretrained(cfg.model.path, cfg.task.prompt_width, cfg.task.on_too_long,
                                  chat=cfg.task.chat_template,
                                  system_prompt=cfg.task.system_prompt)
    _, graphdef, params = hf_models.from_pretrained(cfg.model.path, dtype=cfg.model.dtype,
                                                    param_dtype=cfg.model.param_dtype)
    log(f"loaded {cfg.model.path}")
    return io, graphdef, params, {"path": os.path.abspath(cfg.model.path), "cached": True}
  base_dir = os.path.join(cfg.warmstart.cache_dir, base_policy_key(cfg))
  tok = load_or_train_tokenizer(os.path.join(base_dir, "tokenizer.json"),
                                [e.prompt + " " + e.answer for e in task.train],
                                cfg.model.vocab_size)
  io = TextIO.create(tok, cfg.task.prompt_width, cfg.task.on_too_long)
  graphdef, params, info = load_or_train_base_policy(cfg, io, task, log)
  return io, graphdef, params, info


def _copy(tree):
  """A fresh device copy of a pytree (survives donation of the original)."""
  return jax.tree.map(jnp.copy, tree)


def make_inserter(n: int, buffer_sharding=None):
  """Builds ``insert(buffer, rollout, step) -> (buffer, lost)`` (jitted, buffer donated).

  ``lost`` is ``(rollouts, tokens)`` int32 of the slots the add overwrites before they
  were ever sampled (``accounting.unused_overwritten``), counted before the add. With
  ``buffer_sharding`` (a sharding pytree) the returned buffer keeps that layout.
  """

  @functools.partial(jax.jit, donate_argnums=(0,),
                     out_shardings=None if buffer_sharding is None else (buffer_sharding, None))
  def insert(buffer, rollout, step):
    lost = accounting.unused_overwritten(buffer, n)
    return replay.add(buffer, rollout, rollout.policy_version, step), lost

  return insert


def behaviour_params(ring: list, state: TrainState, mode: str):
  """The parameters that generate this step's rollouts: the current ones (``sync``) or
  the oldest snapshot of the ``simulated_async`` ring (``lag`` steps old; the initial
  parameters while fewer than ``lag`` steps have been taken). Its version is
  ``behaviour_version``."""
  return ring[0] if mode == "simulated_async" and ring else state.params


def behaviour_version(step: int, mode: str, lag: int) -> int:
  """Policy version stamped on the rollouts generated at learner step ``step``."""
  return max(step - lag, 0) if mode == "simulated_async" else step


class AsyncGenerator:
  """The ``async`` mode's generator thread and the state it shares with the learner.

  The thread loops: wait until the rate limiter allows inserting R rollouts, generate
  them outside the lock with its own parameter copy, then (under the lock) add them to
  the buffer and count them. The learner calls ``train(fn)`` to run one step under the
  lock once sampling is allowed, and ``publish`` to refresh the generator's weights.
  Every wait has a timeout; an exception in the thread is re-raised in the learner.

  Args:
    produce: ``produce(params, ref_params, version, key) -> (rollout, gen_metrics, counts)``.
    insert: from ``make_inserter``. limiter: ``RateLimiter``. limiter_state: counters.
    buffer: the initial ``BufferState``. params, ref_params, version: initial weights.
    insert_size: R. sample_size: B. key: PRNG key of the generator's stream.
    timeout_s: longest the learner waits for a sample before raising.
  """

  def __init__(self, produce, insert, limiter, limiter_state, buffer, params, ref_params,
               version, insert_size, sample_size, key, timeout_s, learner_step):
    self._produce, self._insert, self.limiter = produce, insert, limiter
    self.limiter_state, self.buffer = limiter_state, buffer
    self._weights = (_copy(params), ref_params if ref_params is None else _copy(ref_params),
                     version)
    self._r, self._b, self._key, self._timeout = insert_size, sample_size, key, timeout_s
    self.learner_step = learner_step
    self.cond = threading.Condition()
    self._stop = False
    self.error: BaseException | None = None
    self.pending: list[dict] = []  # generation metrics since the learner last looked
    self.counts = {}  # ledger increments since the learner last looked
    self.busy_s = self.wait_s = 0.0
    self._thread = threading.Thread(target=self._loop, name="jaxreplay-generator", daemon=True)

  def start(self):
    self._thread.start()
    return self

  def _loop(self):
    chunk = 0
    try:
      while True:
        t0 = time.time()
        with self.cond:
          while not self._stop and not rate_lib.can_insert(
              self.limiter, self.limiter_state, self._r, int(self.buffer.size)):
            self.cond.wait(0.5)
          if self._stop:
            return
          params, ref, version = self._weights
        t1 = time.time()
        rollout, gm, counts = self._produce(params, ref, version,
                                            jax.random.fold_in(self._key, chunk))
        with self.cond:
          self.buffer, lost = self._insert(self.buffer, rollout, jnp.int32(self.learner_step))
          lost = jax.device_get(lost)
          counts["evicted_unused_rollouts"] = int(lost[0])
          counts["evicted_unused_tokens"] = int(lost[1])
          self.limiter_state = rate_lib.record_insert(self.limiter_state, self._r)
          self.pending.append(gm)
          for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
          self.wait_s += t1 - t0
          self.busy_s += time.time() - t1
          self.cond.notify_all()
        chunk += 1
    except BaseException as e:  # noqa: BLE001 - handed to the learner thread
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def _check(self):
    if self.error is not None:
      raise RuntimeError(f"the generator thread failed: {type(self.error).__name__}: "
                         f"{self.error}") from self.error

  def wait_for_sample(self) -> float:
    """Blocks (lock held on return) until B items may be sampled; returns seconds waited.

    Raises:
      RuntimeError: the generator failed, or no sample was allowed for ``timeout_s``.
    """
    t0 = time.time()
    while not rate_lib.can_sample(self.limiter, self.limiter_state, self._b,
                                  int(self.buffer.size)):
      self._check()
      if time.time() - t0 > self._timeout:
        raise RuntimeError(f"async mode: no batch became available in {self._timeout:.0f} s "
                           f"(inserted={int(self.limiter_state.inserted)}, "
                           f"sampled={int(self.limiter_state.sampled)}, "
                           f"buffer size={int(self.buffer.size)})")
      self.cond.wait(0.5)
    self._check()
    return time.time() - t0

  def publish(self, params, ref_params, version: int):
    """Hands the generator a copy of the learner's weights (call with the lock held)."""
    self._weights = (_copy(params), self._weights[1], version)

  def take(self) -> tuple[list[dict], dict]:
    """Generation metrics and ledger increments since the last call (lock held)."""
    out = (self.pending, self.counts)
    self.pending, self.counts = [], {}
    return out

  def stop(self, timeout_s: float = 120.0) -> bool:
    """Stops the thread and joins it (an in-flight generation finishes first).

    Returns:
      True when the thread has ended within ``timeout_s``.
    """
    with self.cond:
      self._stop = True
      self.cond.notify_all()
    if self._thread.is_alive():
      self._thread.join(timeout_s)
    return not self._thread.is_alive()


def _mean_metrics(ms: list[dict]) -> dict:
  """Key-wise mean of generation metric dicts (empty list: empty dict)."""
  return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]} if ms else {}


LEDGER = dict(generated_tokens=0, generated_rollouts=0, trained_tokens=0, trained_samples=0,
              zero_adv_group_tokens=0, reward_failures=0, prompts_skipped=0,
              first_use_tokens=0, evicted_unused_rollouts=0, evicted_unused_tokens=0,
              truncated_tokens=0, generation_flops=0.0, training_flops=0.0)


def run(cfg, log=print) -> dict:
  """Runs the whole job described by ``cfg``; resumes from ``cfg.workdir`` if it holds a checkpoint.

  Returns:
    The summary dict also written to ``RUN_DIR/summary.json``.

  Raises:
    jaxreplay.config.ConfigError: invalid config (before any compilation).
    RuntimeError: ``algo.max_consecutive_skips`` non-finite updates in a row; in async
      mode, a failed generator thread or no batch for ``train.async_timeout_s``.
  """
  config_lib.validate(cfg)
  mesh_shape = config_lib.mesh_shape(cfg)
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  t_start = time.time()
  try:  # a bad task config fails here, before any file or checkpoint manager is created
    task = make_task(cfg.task)
  except (ValueError, FileNotFoundError) as e:
    raise config_lib.ConfigError(str(e)) from None
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
  mode, lag = cfg.train.mode, cfg.train.lag if cfg.train.mode == "simulated_async" else 0

  # --- task, tokenizer, base policy ------------------------------------------------------
  ckpt_lib.write_atomic(os.path.join(workdir, "config.json"), cfg.to_json_best_effort(indent=2))
  io, graphdef, params, base_info = load_policy(cfg, task, log)
  heldout = task.heldout[:cfg.eval.num_examples]
  m = cfg.sampler.max_new_tokens
  evaluate_fn = functools.partial(evaluate, graphdef, io=io, task=task, examples=heldout,
                                  max_new_tokens=m,
                                  temperature=cfg.eval.get("temperature") or cfg.sampler.temperature,
                                  samples_per_example=cfg.eval.samples_per_example,
                                  correct_threshold=cfg.buffer.correct_threshold,
                                  top_k=cfg.sampler.top_k, top_p=cfg.sampler.top_p)

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
  sampler_cfg = replay.from_config(cfg.buffer)
  buffer = replay.init(empty_rollout(1, cfg.task.prompt_width + m), cfg.buffer.capacity,
                       evicts=sampler_cfg.evicts)
  buffer_sh = replay.state_sharding(buffer, mesh, "data")
  buffer = jax.device_put(buffer, buffer_sh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  insert = make_inserter(cfg.rollout.per_step, buffer_sh)
  cost = accounting.ModelCost.from_params(params, nnx.merge(graphdef, params).cfg)
  train_step = make_train_step(graphdef, optimizer, cfg.algo, cfg.sampler.temperature,
                               cfg.sampler.top_k, cfg.sampler.top_p)
  learner_step = make_learner_step(train_step, cfg.train.batch_size, sampler_cfg, cost=cost,
                                   prompt_len=cfg.task.prompt_width,
                                   epochs=cfg.algo.update_epochs, mesh=mesh,
                                   state_sharding=state_sh, buffer_sharding=buffer_sh)
  drift_fn = make_drift_fn(graphdef, cfg.sampler.temperature, cfg.drift.num_samples,
                           tuple(cfg.algo.staleness_buckets), cfg.sampler.top_k,
                           cfg.sampler.top_p) if cfg.drift.every else None
  limiter = rate_lib.RateLimiter(**config_lib.rate_limiter_settings(cfg))
  limiter_state = rate_lib.init()
  ring = [_copy(params) for _ in range(lag)]  # simulated_async: versions t−lag .. t−1
  root_key = jax.random.key(cfg.seed)
  counts = dict(LEDGER)
  stream = PromptStream(task.train, seed=cfg.seed)
  start, summary0, wall_before = 0, None, 0.0
  timers = {"generate_s": 0.0, "train_s": 0.0, "eval_s": 0.0}  # seconds, continued on resume
  if mode == "async":
    timers.update(learner_wait_s=0.0, generator_wait_s=0.0)

  def ckpt_tree(state, buffer, ring, limiter_state):
    tree = {"train": state, "buffer": buffer,
            "rng": jax.device_put(jax.random.key_data(root_key), replicated)}
    if ring:
      tree["snapshots"] = ring
    if mode == "async":
      tree["limiter"] = limiter_state
    return tree

  restored = ckpt_lib.restore(manager, ckpt_tree(state, buffer, ring, limiter_state), log=log)
  if restored is not None:
    tree, meta = restored
    state, buffer = tree["train"], tree["buffer"]
    ring, limiter_state = tree.get("snapshots", ring), tree.get("limiter", limiter_state)
    root_key = jax.random.wrap_key_data(tree["rng"])
    start, counts, stream.position = int(meta["step"]), meta["counts"], meta["data_position"]
    counts = {**LEDGER, **counts}
    timers.update(meta.get("timers", {}))
    summary0 = meta["eval_before"]
    wall_before = meta.get("wall_seconds", 0.0)
    log(f"resumed from {manager.directory} at step {start}")

  eval_key = jax.random.fold_in(root_key, 2**31 - 1)  # disjoint from the per-step keys
  drift_key = jax.random.fold_in(root_key, 2**31 - 2)
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

  def finish_step(step, state, buffer, metrics, gen_metrics, extra=None, lim_state=None):
    """Ledger, JSONL record, evaluation, drift and checkpoint after learner step ``step``."""
    nonlocal consecutive_skips, last_eval, best
    counts["trained_tokens"] += int(metrics.pop("trained_tokens"))
    counts["first_use_tokens"] += int(metrics.pop("first_use_tokens"))
    counts["training_flops"] += float(metrics.pop("training_flops"))
    counts["trained_samples"] += cfg.train.batch_size
    consecutive_skips = consecutive_skips + 1 if metrics["skipped_update"] else 0
    if consecutive_skips >= cfg.algo.max_consecutive_skips:
      raise RuntimeError(f"{consecutive_skips} consecutive non-finite updates at step {step}; "
                         "lower algo.lr or check the data")
    hists = {k: metrics.pop(k).tolist() for k in ("staleness_hist", "steps_since_last_use_hist")}
    derived = accounting.summarize(counts, timers)
    record = {**gen_metrics, **{k: float(v) for k, v in metrics.items()}, **counts, **hists,
              "replay_ratio": counts["trained_samples"] / max(counts["generated_rollouts"], 1),
              "buffer_size": int(buffer.size), **timers, **(extra or {}),
              # deterministic in sync/simulated_async; the time-based μ, γ are in the summary
              **{k: v for k, v in derived.items() if k.endswith("_flops")}}
    done = step + 1
    if (cfg.eval.every and done % cfg.eval.every == 0) or done == cfg.train.steps:
      te = time.time()
      last_eval = evaluate_fn(state.params, key=jax.random.fold_in(eval_key, done))
      timers["eval_s"] += time.time() - te
      record.update({f"eval/{k}": v for k, v in last_eval.items()})
      if best_manager is not None and cfg.checkpoint.every:
        best = ckpt_lib.save_best(best_manager, best, done, {"train": state}, last_eval)
    if drift_fn is not None and done % cfg.drift.every == 0:
      record.update({k: float(v) for k, v in jax.device_get(drift_fn(
          state.params, buffer, jax.random.fold_in(drift_key, done), jnp.int32(done))).items()})
    writer.write(done, record)
    bar.set_postfix(reward=f"{gen_metrics.get('reward', float('nan')):.2f}",
                    acc=f"{last_eval['acc_sampled']:.2f}", refresh=False)
    if cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == cfg.train.steps):
      ckpt_lib.save(manager, done, ckpt_tree(state, buffer, ring,
                                                limiter_state if lim_state is None else lim_state),
                    {"step": done, "counts": counts, "data_position": stream.position,
                     "eval_before": summary0, "last_eval": last_eval, "timers": timers,
                     "wall_seconds": wall_before + time.time() - t_start,
                     "config": json.loads(cfg.to_json_best_effort())})

  def produce(params, ref_params, version, key, counts):
    rollout, gen_metrics = generate_rollouts(cfg, io, task, graphdef, params, stream, key,
                                             version, counts, ref_params, cost, mesh)
    return rollout, gen_metrics

  if mode in ("sync", "simulated_async"):
    for step in bar:
      key_gen, key_sample = jax.random.split(jax.random.fold_in(root_key, step))
      t0 = time.time()
      rollout, gen_metrics = produce(behaviour_params(ring, state, mode), state.ref_params,
                                     behaviour_version(step, mode, lag), key_gen, counts)
      buffer, lost = insert(buffer, rollout, jnp.int32(step))
      counts["evicted_unused_rollouts"] += int(lost[0])
      counts["evicted_unused_tokens"] += int(lost[1])
      t1 = time.time()
      if ring:  # keep versions step−lag+1 .. step for the next steps' generation
        ring = ring[1:] + [_copy(state.params)]
      state, buffer, metrics = learner_step(state, buffer, key_sample)
      metrics = jax.device_get(metrics)
      t2 = time.time()
      timers["generate_s"] += t1 - t0
      timers["train_s"] += t2 - t1
      finish_step(step, state, buffer, metrics, gen_metrics)
  else:
    state, buffer, limiter_state = run_async_learner(
        cfg, state, buffer, limiter, limiter_state, bar, root_key, timers, counts, produce,
        insert, learner_step, finish_step, log)
  bar.close()
  manager.wait_until_finished()
  if best_manager is not None:
    best_manager.wait_until_finished()
  writer.close()
  final = last_eval
  unused = jax.device_get(accounting.unused_in_buffer(buffer))
  ledger = {**counts, "unused_in_buffer_rollouts": int(unused[0]),
            "unused_in_buffer_tokens": int(unused[1]), **accounting.summarize(counts, timers)}
  summary = {
      "acc_greedy_before": summary0["acc_greedy"], "acc_sampled_before": summary0["acc_sampled"],
      "acc_greedy_after": final["acc_greedy"], "acc_sampled_after": final["acc_sampled"],
      "generated_tokens": counts["generated_tokens"], "trained_tokens": counts["trained_tokens"],
      "generated_rollouts": counts["generated_rollouts"], "steps": cfg.train.steps,
      "wall_seconds": wall_before + time.time() - t_start, "base_policy": base_info["path"],
      "checkpoints": os.path.join(workdir, "checkpoints"), **timers, "mode": mode,
      "ledger": ledger, "eval_after": final,
      "checkpoints": os.path.join(workdir, "checkpoints"), **timers,
      "best_checkpoint": (None if best is None else
                          {"step": best[0], "eval/acc_sampled": best[1],
                           "path": os.path.join(workdir, "checkpoints_best", str(best[0]))}),
  }
  ckpt_lib.write_atomic(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=2))
  return summary


def run_async_learner(cfg, state, buffer, limiter, limiter_state, bar, root_key, timers, counts,
                      produce, insert, learner_step, finish_step, log):
  """The ``async`` mode's learner loop over ``bar``'s steps, with an ``AsyncGenerator``.

  Each step waits (under the lock) until the rate limiter allows a sample, runs the
  learner step, records the sample, publishes the weights every
  ``train.weight_sync_every`` steps and calls ``finish_step`` (lock held, so the
  generator cannot donate the buffer while it is logged or checkpointed). The generator
  thread is stopped and joined on every exit path.

  Returns:
    (state, buffer, limiter_state) after the last step.

  Raises:
    RuntimeError: the generator failed, or no batch for ``train.async_timeout_s`` seconds.
  """
  b = cfg.train.batch_size

  def produce_counted(params, ref, version, key):
    local = {k: 0 for k in ("generated_tokens", "generated_rollouts", "zero_adv_group_tokens",
                            "reward_failures", "prompts_skipped", "truncated_tokens")}
    local["generation_flops"] = 0.0
    rollout, gm = produce(params, ref, version, key, local)
    return rollout, gm, local

  start = bar.n
  gen_s0, wait_s0 = timers["generate_s"], timers["generator_wait_s"]  # from before a resume
  gen = AsyncGenerator(produce_counted, insert, limiter, limiter_state, buffer, state.params,
                       state.ref_params, start, cfg.rollout.per_step, b,
                       jax.random.fold_in(root_key, 2**31 - 3), cfg.train.async_timeout_s,
                       start).start()
  try:
    for step in bar:
      with gen.cond:
        timers["learner_wait_s"] += gen.wait_for_sample()
        t1 = time.time()
        state, gen.buffer, metrics = learner_step(state, gen.buffer,
                                                  jax.random.fold_in(root_key, step))
        metrics = jax.device_get(metrics)
        gen.limiter_state = rate_lib.record_sample(gen.limiter_state, b)
        gen.learner_step = step + 1
        if (step + 1) % cfg.train.weight_sync_every == 0:
          gen.publish(state.params, state.ref_params, step + 1)
        timers["train_s"] += time.time() - t1
        pending, inc = gen.take()
        for k, v in inc.items():
          counts[k] += v
        timers["generate_s"] = gen_s0 + gen.busy_s
        timers["generator_wait_s"] = wait_s0 + gen.wait_s
        extra = {"limiter_inserted": int(gen.limiter_state.inserted),
                 "limiter_sampled": int(gen.limiter_state.sampled),
                 "rollouts_since_last_step": len(pending) * cfg.rollout.per_step}
        finish_step(step, state, gen.buffer, metrics, _mean_metrics(pending), extra,
                    gen.limiter_state)
        gen.cond.notify_all()
  finally:
    if not gen.stop():
      log("async mode: the generator thread did not stop in time (left as a daemon)")
  with gen.cond:  # rollouts inserted after the last step still count in the ledger
    for k, v in gen.take()[1].items():
      counts[k] += v
  return state, gen.buffer, gen.limiter_state
