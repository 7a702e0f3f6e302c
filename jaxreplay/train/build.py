"""Set-up, once per job: a frozen ``Run`` (what never changes) and the fresh ``Carry``.

``build`` validates the config, makes the task, loads the starting policy, places the
train state and the buffer on the mesh, compiles nothing yet but builds every jitted
function the loop calls (insert, learner step, eligibility check, drift monitor), and
opens the checkpoint managers and the metric writer. The strategies (``lagged``,
``actor_learner``) read the ``Run`` and thread the ``Carry``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxreplay import config as config_lib
from jaxreplay import replay
from jaxreplay.models import hf as hf_models
from jaxreplay.models.tokenizer import load_or_train_tokenizer
from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.replay import rate_limiter as rate_lib
from jaxreplay.rl.scoring import micro_batch_rows
from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
from jaxreplay.rollout import empty_rollout
from jaxreplay.tasks import make_task
from jaxreplay.train import accounting
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train.carry import Carry
from jaxreplay.train.data import PromptStream
from jaxreplay.train.drift import make_drift_fn
from jaxreplay.train.evaluate import evaluate
from jaxreplay.train.learner import make_inserter, make_learner_step, make_ready
from jaxreplay.train.ledger import Ledger, Timers
from jaxreplay.train.metrics import MetricWriter
from jaxreplay.train.policy import HFTextIO, TextIO
from jaxreplay.train.warmstart import base_policy_key, load_or_train_base_policy


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a job holds fixed: config, I/O, model graph, mesh and jitted steps.

  Attributes:
    cfg: the validated config. log: message sink. workdir: the run directory, an absolute
      local path or an ``etils.epath`` URL (``gs://...``).
    t_start: wall-clock start of this process's part of the run (seconds since epoch).
    task: the verifiable task. io: ``TextIO``. graphdef: the policy's NNX graph.
    base_info: where the starting policy came from (``path``, ...).
    mesh: the device mesh. cost: the model's FLOP parameters.
    lag: policy versions between the learner and the generating policy in the lagged
      strategy (0 for ``sync``, ``train.lag`` for ``simulated_async``).
    stream: ``PromptStream`` of the train split.
    evaluate: ``(params, key) -> dict`` held-out accuracy (``train.evaluate``).
    insert: ``(buffer, rollout, step) -> (buffer, lost)`` (``learner.make_inserter``).
    learner_step: ``(state, buffer, key) -> (state, buffer, metrics)``.
    ready: ``(buffer, version) -> bool``: the buffer holds B items and the sampler can
      draw its batch at ``version`` (``replay.can_sample``): the learner may draw.
    drift: ``(params, buffer, key, version) -> dict``, or None (``drift.every = 0``).
    limiter: the ``RateLimiter`` settings (``async``).
    replicated: a replicated ``NamedSharding`` on ``mesh``.
    manager, best_manager: Orbax checkpoint managers (latest; best held-out accuracy, or
      None). writer: ``MetricWriter``.
  """

  cfg: Any
  log: Callable
  workdir: str
  t_start: float
  task: Any
  io: Any
  graphdef: Any
  base_info: dict
  mesh: Any
  cost: accounting.ModelCost
  lag: int
  stream: PromptStream
  evaluate: Callable
  insert: Callable
  learner_step: Callable
  ready: Callable
  drift: Callable | None
  limiter: rate_lib.RateLimiter
  replicated: Any
  manager: Any
  best_manager: Any
  writer: MetricWriter

  @property
  def is_async(self) -> bool:
    """The actor–learner strategy (``train.mode='async'``)."""
    return self.cfg.train.mode == "async"


def load_policy(cfg, task, log=print, mesh=None):
  """The starting policy and its text I/O, by ``model.source``.

  ``builtin``: the byte-level BPE tokenizer and the small decoder of ``cfg.model``,
  warm-started on the task (cached under ``warmstart.cache_dir``). ``hf``: a Hugging Face
  checkpoint directory ``model.path`` (``config.json``, safetensors, ``tokenizer.json``),
  loaded as is in ``model.dtype`` / ``model.param_dtype``; prompts go through its chat
  template when ``task.chat_template``.

  With ``mesh`` the parameters are created in their ``parallel.PARAM_RULES`` layout on it:
  each process reads only the safetensors slices (or the Orbax shards of the cached base
  policy) of its own devices, and no device ever holds a whole unsharded copy.

  Returns:
    (io: TextIO, graphdef, params: nnx.State, info dict with at least ``path``).

  Raises:
    jaxreplay.models.hf.CheckpointMismatchError: checkpoint tensors that do not match its
      config (every mismatch listed). FileNotFoundError: files missing from ``model.path``.
  """
  if cfg.model.source == "hf":
    io = HFTextIO.from_pretrained(cfg.model.path, cfg.task.prompt_width, cfg.task.on_too_long,
                                  chat=cfg.task.chat_template,
                                  system_prompt=cfg.task.system_prompt)
    _, graphdef, params = hf_models.from_pretrained(cfg.model.path, mesh=mesh,
                                                    dtype=cfg.model.dtype,
                                                    param_dtype=cfg.model.param_dtype,
                                                    scan_layers=cfg.model.get("scan_layers", False),
                                                    remat=cfg.model.get("remat", "none"))
    log(f"loaded {cfg.model.path}")
    return io, graphdef, params, {"path": os.path.abspath(cfg.model.path), "cached": True}
  base_dir = os.path.join(cfg.warmstart.cache_dir, base_policy_key(cfg))
  tok = load_or_train_tokenizer(os.path.join(base_dir, "tokenizer.json"),
                                [e.prompt + " " + e.answer for e in task.train],
                                cfg.model.vocab_size)
  io = TextIO.create(tok, cfg.task.prompt_width, cfg.task.on_too_long)
  graphdef, params, info = load_or_train_base_policy(cfg, io, task, log, mesh=mesh)
  return io, graphdef, params, info


def _check_resumable(manager, cfg, workdir: str) -> None:
  """Refuses a workdir whose checkpoint was written under other (non-resumable) settings."""
  saved_meta = ckpt_lib.read_meta(manager)
  if saved_meta is None:
    return
  changes = ckpt_lib.config_changes(saved_meta["config"], json.loads(cfg.to_json_best_effort()))
  if changes:
    raise config_lib.ConfigError(
        f"workdir {workdir} holds a checkpoint of a run with another config ("
        + "; ".join(changes) + "): pass a new --config.workdir, or the same values to resume")


def build(cfg, log=print) -> tuple[Run, Carry]:
  """Set-up: validates ``cfg``, then builds the ``Run`` and the fresh ``Carry`` (step 0).

  Args:
    cfg: the config tree. log: message sink.

  Returns:
    (run, carry): the carry holds the freshly placed train state, an empty buffer, the
    parameter ring of the lagged strategy (``lag`` copies of the starting parameters),
    the rate limiter's counters, the root key ``jax.random.key(cfg.seed)``, a zero ledger,
    data position 0 and the best checkpoint so far (from ``checkpoints_best/``).

  Raises:
    jaxreplay.config.ConfigError: an invalid config, or a workdir holding a checkpoint of
      a run with other settings — before any file is written or anything compiled.
    jaxreplay.train.checkpoint.CheckpointReadError: the newest checkpoint's metadata could
      not be read for a reason other than corruption (nothing is moved).
  """
  config_lib.validate(cfg)
  mesh_shape = config_lib.mesh_shape(cfg)
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  t_start = time.time()
  try:  # a bad task config fails here, before any file or checkpoint manager is created
    task = make_task(cfg.task)
  except (ValueError, FileNotFoundError) as e:
    raise config_lib.ConfigError(str(e)) from None
  # epath: a gs:// (or other URL) workdir stays a URL; a local relative one becomes absolute.
  workdir = ckpt_lib.run_path(cfg.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  manager = ckpt_lib.make_manager(workdir / "checkpoints", cfg.checkpoint.max_to_keep)
  # The best held-out accuracy's train state, besides the last max_to_keep; resume uses
  # the latest (``manager``), never this one.
  best_manager = (ckpt_lib.make_best_manager(workdir / "checkpoints_best")
                  if cfg.checkpoint.keep_best else None)
  workdir = str(workdir)
  _check_resumable(manager, cfg, workdir)
  if multihost.is_primary():  # one writer per job; Orbax coordinates the checkpoints
    ckpt_lib.write_atomic(os.path.join(workdir, "config.json"),
                          cfg.to_json_best_effort(indent=2))

  # --- task, tokenizer, starting policy --------------------------------------------------
  io, graphdef, params, base_info = load_policy(cfg, task, log, mesh=mesh)
  m = cfg.sampler.max_new_tokens
  # Passes that score rollouts without gradients take the learner's micro-batch rows.
  score_rows = micro_batch_rows(cfg.train.batch_size, cfg.algo)
  evaluate_fn = functools.partial(evaluate, graphdef, io=io, task=task,
                                  examples=task.heldout[:cfg.eval.num_examples],
                                  max_new_tokens=m,
                                  temperature=cfg.eval.get("temperature") or cfg.sampler.temperature,
                                  samples_per_example=cfg.eval.samples_per_example,
                                  correct_threshold=cfg.buffer.correct_threshold,
                                  top_k=cfg.sampler.top_k,
                                  top_p=cfg.eval.get("top_p") or cfg.sampler.top_p,
                                  chunk=cfg.eval.batch_rows,
                                  mesh=mesh, logprob_chunk=cfg.algo.logprob_chunk,
                                  score_rows=score_rows,
                                  pack=cfg.algo.get("pack_sequences", True))

  # --- learner and buffer, created on the mesh -------------------------------------------
  # Parameters and optimizer state by PARAM_RULES, the buffer's capacity axis over "data",
  # the RNG key replicated; restores go into these layouts (any saved mesh restores).
  # Each is computed by a jit whose out_shardings are these layouts, so every device
  # allocates only its block (the loaded parameters are donated into the train state;
  # the frozen KL reference exists only when ``algo`` uses one).
  cost = accounting.ModelCost.from_params(params, nnx.merge(graphdef, params).cfg)
  optimizer = make_optimizer(cfg.algo, cfg.train.steps)
  init_state = lambda p: init_train_state(graphdef, p, optimizer, cfg.algo)
  state_sh = sharding_lib.param_shardings(jax.eval_shape(init_state, params), mesh)
  state = jax.jit(init_state, out_shardings=state_sh, donate_argnums=0)(params)
  params = state.params
  sampler_cfg = replay.from_config(cfg.buffer)
  b = cfg.train.batch_size
  init_buffer = lambda: replay.init(empty_rollout(1, cfg.task.prompt_width + m),
                                    cfg.buffer.capacity, evicts=sampler_cfg.evicts)
  buffer_sh = replay.state_sharding(jax.eval_shape(init_buffer), mesh, "data")
  buffer = jax.jit(init_buffer, out_shardings=buffer_sh)()
  train_step = make_train_step(graphdef, optimizer, cfg.algo, cfg.sampler.temperature,
                               cfg.sampler.top_k, cfg.sampler.top_p)
  learner_step = make_learner_step(train_step, b, sampler_cfg, cost=cost,
                                   prompt_len=cfg.task.prompt_width,
                                   epochs=cfg.algo.update_epochs, mesh=mesh,
                                   state_sharding=state_sh, buffer_sharding=buffer_sh)
  ready = make_ready(b, sampler_cfg)
  drift_fn = make_drift_fn(graphdef, cfg.sampler.temperature, cfg.drift.num_samples,
                           tuple(cfg.algo.staleness_buckets), cfg.sampler.top_k,
                           cfg.sampler.top_p, cfg.algo.logprob_chunk, score_rows,
                           pack=cfg.algo.get("pack_sequences", True)
                           ) if cfg.drift.every else None
  lag = config_lib.policy_lag(cfg)

  run = Run(cfg=cfg, log=log, workdir=workdir, t_start=t_start, task=task, io=io,
            graphdef=graphdef, base_info=base_info, mesh=mesh, cost=cost, lag=lag,
            stream=PromptStream(task.train, seed=cfg.seed), evaluate=evaluate_fn,
            insert=make_inserter(cfg.rollout.per_step, buffer_sh), learner_step=learner_step,
            ready=lambda buffer, version: bool(multihost.to_host(ready(buffer, version))),
            drift=drift_fn, limiter=rate_lib.RateLimiter(**config_lib.rate_limiter_settings(cfg)),
            replicated=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
            manager=manager, best_manager=best_manager,
            writer=MetricWriter(workdir, cfg.log.tensorboard, primary=multihost.is_primary()))
  waits = dict(learner_wait_s=0.0, generator_wait_s=0.0) if run.is_async else {}
  # The parameter ring of simulated_async: ``lag`` copies in the parameters' own layout.
  carry = Carry(state=state, buffer=buffer,
                ring=tuple(jax.tree.map(jnp.copy, params) for _ in range(lag)),
                limiter_state=rate_lib.init(),
                key=multihost.to_global(jax.random.key(cfg.seed), run.replicated),
                ledger=Ledger(),
                timers=Timers(**waits), position=0, step=0,
                best=ckpt_lib.best_so_far(best_manager) if best_manager is not None else None)
  return run, carry
