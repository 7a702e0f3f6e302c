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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxreplay import replay, storage
from jaxreplay.config import RunConfig
from jaxreplay.models import attention
from jaxreplay.models import hf as hf_models
from jaxreplay.models import lora as lora_lib
from jaxreplay.models.hf_tokenizer import HFTokenizer
from jaxreplay.models.spec import ModelSpec
from jaxreplay.models.tokenizer import load_or_train_tokenizer
from jaxreplay.parallel import multihost
from jaxreplay.parallel import sharding as sharding_lib
from jaxreplay.parallel import submesh
from jaxreplay.replay import auto as auto_lib
from jaxreplay.replay import rate_limiter as rate_lib
from jaxreplay.replay.auto import AutoReplaySpec
from jaxreplay.replay.config import SamplerConfig
from jaxreplay.rl.noise import make_buffer_noise_fn
from jaxreplay.rl.scoring import micro_batch_rows
from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
from jaxreplay.rollout import empty_rollout
from jaxreplay.spec import ConfigError
from jaxreplay.tasks import Task, make_task
from jaxreplay.tasks.spec import TaskSpec
from jaxreplay.train import accounting
from jaxreplay.train import checkpoint as ckpt_lib
from jaxreplay.train import samples as samples_lib
from jaxreplay.train.carry import Carry
from jaxreplay.train.data import PromptStream
from jaxreplay.train.drift import make_drift_fn
from jaxreplay.train.evaluate import evaluate
from jaxreplay.train.generation import RolloutSource
from jaxreplay.train.learner import LearnerFns, make_inserter, make_learner_step, make_ready
from jaxreplay.train.ledger import Ledger, Timers
from jaxreplay.train.metrics import MetricWriter
from jaxreplay.train.policy import HFTextIO, TextIO
from jaxreplay.train.progress import phase
from jaxreplay.train.spec import (CheckpointSpec, DriftSpec, EvalSpec, RolloutSpec, TrainSpec,
                                  WarmstartSpec)
from jaxreplay.train.warmstart import (base_policy_key, load_or_train_base_policy,
                                       model_attention)

# folded into the run's seed for the LoRA A matrices: a stream of its own
LORA_KEY = 0x4C6F5241


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a job holds fixed: the specs the loop reads, I/O, model graph, mesh, jitted
  steps.

  Attributes:
    train: the ``train`` spec (steps, B, mode). rollout: the ``rollout`` spec (R, G).
    buffer: the ``buffer`` spec (N, sampler). eval: the ``eval`` spec (cadence).
    drift: the ``drift`` spec (cadence). checkpoint: the ``checkpoint`` spec (cadence).
    max_consecutive_skips: non-finite updates in a row that stop the run (``algo``).
    progress: show a progress bar (``log.progress``).
    config_json: the config tree as given, JSON (checkpoint metadata; resume compares it).
    log: message sink. workdir: the run directory, an absolute local path or an
      ``etils.epath`` URL (``gs://...``).
    t_start: wall-clock start of this process's part of the run (seconds since epoch).
    task: the verifiable task. io: ``TextIO``. graphdef: the policy's NNX graph.
    base_info: where the starting policy came from (``path``, ...).
    mesh: the device mesh (the learner's, with the actor–learner split).
    generator_mesh: the generator's mesh of the actor–learner split
      (``mesh.generator_devices`` > 0), or None. weight_sync: with the split, ``params ->
      generator params`` (``parallel.submesh.make_weight_sync``), else None.
    cost: the model's FLOP parameters.
    lag: policy versions between the learner and the generating policy in the lagged
      strategy (0 for ``sync``, ``train.lag`` for ``simulated_async``).
    source: the ``generation.RolloutSource`` of every generation round.
    evaluate: ``(params, key) -> dict`` held-out accuracy (``train.evaluate``).
    fns: the jitted learner-side functions (``learner.LearnerFns``).
    limiter: the ``RateLimiter`` settings (``async``).
    replicated: a replicated ``NamedSharding`` on ``mesh``.
    manager, best_manager: Orbax checkpoint managers (latest; best held-out accuracy, or
      None). writer: ``MetricWriter``.
    auto_replay: the ``auto_replay`` spec (the self-tuning controller, ``self_tuning``).
    learner_fns: with ``auto_replay.enabled``, ``(per_step, buffer_spec) -> LearnerFns``:
      the learner-side functions for another R or age cut-off (built once per pair, then
      reused); else None. ``rollout``, ``buffer``, ``source`` and ``fns`` are the ones in
      force: the controller replaces them (``self_tuning.apply``).
    record_every: learner steps between ``samples/train_STEP.jsonl`` files (0 = none;
      ``log.record_every``, unset: ``eval.every``).
  """

  train: TrainSpec
  rollout: RolloutSpec
  buffer: SamplerConfig
  eval: EvalSpec
  drift: DriftSpec
  checkpoint: CheckpointSpec
  max_consecutive_skips: int
  progress: bool
  config_json: str
  log: Callable[[str], None]
  workdir: str
  t_start: float
  task: Task
  io: TextIO | HFTextIO
  graphdef: nnx.GraphDef
  base_info: dict
  mesh: jax.sharding.Mesh
  generator_mesh: jax.sharding.Mesh | None
  weight_sync: Callable | None
  cost: accounting.ModelCost
  lag: int
  source: RolloutSource
  evaluate: Callable[..., dict]
  fns: LearnerFns
  limiter: rate_lib.RateLimiter
  replicated: jax.sharding.NamedSharding
  manager: ocp.CheckpointManager
  best_manager: ocp.CheckpointManager | None
  writer: MetricWriter
  auto_replay: AutoReplaySpec = AutoReplaySpec()
  learner_fns: Callable[..., LearnerFns] | None = None
  record_every: int = 0

  @property
  def is_async(self) -> bool:
    """The actor–learner strategy (``train.mode='async'``)."""
    return self.train.is_async


def checkpoint_text_io(model: ModelSpec, task_spec: TaskSpec) -> HFTextIO:
  """The prompt encoder of a pretrained checkpoint, from its tokenizer alone.

  Args:
    model: ``model.source`` ``hf`` (``tokenizer.json`` and its configs in the directory
      ``model.path``) or ``gguf`` (the tokenizer and chat template in the file's metadata);
      ``model.path`` local. task_spec: prompt width, overflow rule, chat template, system turn.

  Returns:
    ``HFTextIO``: ``prompts(examples)`` gives (tokens [B, P] int32, mask [B, P] bool,
    keep [B] bool), left-padded.

  Raises:
    FileNotFoundError: the tokenizer's files are missing. ValueError: ``task.chat_template``
      without a chat template in the checkpoint, or ``model.source`` is ``builtin``.
  """
  if model.source == "hf":
    hf = HFTokenizer.from_pretrained(model.path)
  elif model.source == "gguf":
    hf = HFTokenizer.from_gguf(model.path)
  else:
    raise ValueError(f"model.source={model.source!r}: a checkpoint's tokenizer needs 'hf' or "
                     f"'gguf' (the builtin tokenizer is trained with the warm start)")
  return HFTextIO.from_tokenizer(hf, task_spec.prompt_width, task_spec.on_too_long,
                                 chat=task_spec.chat_template,
                                 system_prompt=task_spec.system_prompt, origin=model.path)


def load_policy(model: ModelSpec, task_spec: TaskSpec, warmstart: WarmstartSpec, task, *,
                seed: int, max_new_tokens: int, log=print, mesh=None, progress: bool = False):
  """The starting policy and its text I/O, by ``model.source``.

  ``builtin``: the byte-level BPE tokenizer and the small decoder of ``model``,
  warm-started on the task (cached under ``warmstart.cache_dir``). ``hf``: a Hugging Face
  checkpoint directory ``model.path`` (``config.json``, safetensors, ``tokenizer.json``),
  loaded as is in ``model.dtype`` / ``model.param_dtype``. ``gguf``: a llama.cpp GGUF file
  (``models.gguf``: dequantized, its tokenizer and chat template from the metadata). Prompts
  go through the checkpoint's chat template when ``task.chat_template``.

  With ``mesh`` the parameters are created in their ``parallel.PARAM_RULES`` layout on it:
  each process reads only the safetensors slices (or the Orbax shards of the cached base
  policy) of its own devices, and no device ever holds a whole unsharded copy.

  Args:
    model, task_spec, warmstart: the section specs. task: the built task (its train split
      trains the tokenizer and the warm start). seed: the run's seed. max_new_tokens: the
      sampler's longest completion. log: message sink. mesh: optional device mesh.
    progress: progress bars for loading and the warm start (``log.progress``); each phase's
      duration is logged either way.

  Returns:
    (io: TextIO, graphdef, params: nnx.State, info dict with at least ``path``).

  Raises:
    jaxreplay.models.hf.CheckpointMismatchError: checkpoint tensors that do not match its
      config (every mismatch listed). FileNotFoundError: files missing from ``model.path``.
  """
  if model.source in ("hf", "gguf"):
    # Checkpoints on cloud storage are copied to the local cache once (safetensors maps
    # local files); local paths and package: paths are read in place.
    model = dataclasses.replace(model, path=storage.local_copy(model.path))
  if model.source == "hf":
    io = checkpoint_text_io(model, task_spec)
    with phase("model load", enabled=progress, log=log):
      _, graphdef, params = hf_models.from_pretrained(model.path, mesh=mesh, dtype=model.dtype,
                                                      param_dtype=model.param_dtype,
                                                      scan_layers=model.scan_layers,
                                                      remat=model.remat,
                                                      attention=model_attention(model))
    log(f"loaded {model.path}")
    return io, graphdef, params, {"path": os.path.abspath(model.path), "cached": True}
  if model.source == "gguf":
    from jaxreplay.models import gguf as gguf_models
    io = checkpoint_text_io(model, task_spec)
    with phase("model load and conversion", enabled=progress, log=log):
      _, graphdef, params = gguf_models.from_pretrained(model.path, mesh=mesh, dtype=model.dtype,
                                                        param_dtype=model.param_dtype,
                                                        scan_layers=model.scan_layers,
                                                        remat=model.remat,
                                                        attention=model_attention(model))
    log(f"loaded {model.path}")
    return io, graphdef, params, {"path": gguf_models.resolve_gguf_path(model.path),
                                  "cached": True}
  key = base_policy_key(task_spec, model, warmstart, max_new_tokens, seed)
  tok = load_or_train_tokenizer(os.path.join(warmstart.cache_dir, key, "tokenizer.json"),
                                [e.prompt + " " + e.answer for e in task.train],
                                model.vocab_size)
  io = TextIO.create(tok, task_spec.prompt_width, task_spec.on_too_long)
  graphdef, params, info = load_or_train_base_policy(model, warmstart, io, task, key=key,
                                                     seed=seed, max_new_tokens=max_new_tokens,
                                                     log=log, mesh=mesh, progress=progress)
  return io, graphdef, params, info


def _check_resumable(manager, config_json: str, workdir: str) -> None:
  """Refuses a workdir whose checkpoint was written under other (non-resumable) settings."""
  saved_meta = ckpt_lib.read_meta(manager)
  if saved_meta is None:
    return
  changes = ckpt_lib.config_changes(saved_meta["config"], json.loads(config_json))
  if changes:
    raise ConfigError(
        f"workdir {workdir} holds a checkpoint of a run with another config ("
        + "; ".join(changes) + "): pass a new --config.workdir, or the same values to resume")


def build(c: RunConfig, log=print) -> tuple[Run, Carry]:
  """Set-up: builds the ``Run`` and the fresh ``Carry`` (step 0) of a validated config.

  Args:
    c: the ``RunConfig`` (``jaxreplay.config.validate``). log: message sink.

  Returns:
    (run, carry): the carry holds the freshly placed train state, an empty buffer, the
    parameter ring of the lagged strategy (``lag`` copies of the starting parameters),
    the rate limiter's counters, the root key ``jax.random.key(seed)``, a zero ledger,
    data position 0 and the best checkpoint so far (from ``checkpoints_best/``).

  Raises:
    TypeError: ``c`` is not a ``RunConfig`` (validate the config tree first).
    jaxreplay.config.ConfigError: a workdir holding a checkpoint of a run with other
      settings, or task data the options do not fit — before any file is written or
      anything compiled.
    jaxreplay.train.checkpoint.CheckpointReadError: the newest checkpoint's metadata could
      not be read for a reason other than corruption (nothing is moved).
  """
  if not isinstance(c, RunConfig):
    raise TypeError(f"build takes a RunConfig (jaxreplay.config.validate(cfg)), not "
                    f"{type(c).__name__}")
  mesh, generator_mesh = _meshes(c)
  t_start = time.time()
  try:  # bad task data fails here, before any file or checkpoint manager is created
    task = make_task(c.task)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from None
  workdir, manager, best_manager = _workdir(c)

  # --- task, tokenizer, starting policy --------------------------------------------------
  io, graphdef, params, base_info = _policy(c, task, workdir, mesh, log)
  # Passes that score rollouts without gradients take the learner's micro-batch rows.
  score_rows = micro_batch_rows(c.train.batch_size, c.algo)
  evaluate_fn = _evaluate_fn(c, graphdef, io, task, mesh, score_rows)

  # --- learner and buffer, created on the mesh -------------------------------------------
  cost = accounting.ModelCost.from_params(params, nnx.merge(graphdef, params).cfg)
  optimizer = make_optimizer(c.algo, c.train.steps)
  state, state_sh = _train_state(c, graphdef, params, optimizer, mesh)
  params = state.params
  rb, buffer, buffer_sh = _replay_buffer(c, mesh)
  fns, learner_fns = _learner_fns(c, graphdef, optimizer, rb, cost, mesh, state_sh, buffer_sh,
                                  score_rows)

  # --- generation: where rollouts come from, and the generator's weights -----------------
  source = RolloutSource(rollout=c.rollout, sampling=c.sampler, algo=c.algo, io=io, task=task,
                         graphdef=graphdef, stream=PromptStream(task.train, seed=c.seed),
                         prompt_width=c.task.prompt_width,
                         reward_timeout_s=c.task.reward_timeout_s or None,
                         score_rows=score_rows, cost=cost,
                         mesh=mesh if generator_mesh is None else generator_mesh,
                         rollout_mesh=None if generator_mesh is None else mesh)
  weight_sync = None
  if generator_mesh is not None:
    # The generator's inference copy: its own layout on its mesh (replicated over data,
    # split over tensor) and the model's activation dtype.
    generator_sh = sharding_lib.param_shardings(jax.eval_shape(lambda: params), generator_mesh)
    weight_sync = submesh.make_weight_sync(state_sh.params, generator_sh, c.model.dtype)

  # --- the run and its starting carry ----------------------------------------------------
  b = c.train.batch_size
  run = Run(train=c.train, rollout=c.rollout, buffer=c.buffer, eval=c.eval, drift=c.drift,
            checkpoint=c.checkpoint, max_consecutive_skips=c.algo.max_consecutive_skips,
            progress=c.log.progress, config_json=c.tree_json, log=log, workdir=workdir,
            t_start=t_start, task=task, io=io, graphdef=graphdef, base_info=base_info,
            mesh=mesh, generator_mesh=generator_mesh, weight_sync=weight_sync,
            cost=cost, lag=c.train.policy_lag, source=source,
            evaluate=evaluate_fn, fns=fns,
            limiter=rate_lib.RateLimiter(**c.rate_limiter.settings(b, c.rollout.per_step)),
            replicated=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
            manager=manager, best_manager=best_manager,
            writer=MetricWriter(workdir, c.log.tensorboard, primary=multihost.is_primary()),
            auto_replay=c.auto_replay, learner_fns=learner_fns,
            record_every=c.log.record_interval(c.eval.every))
  waits = dict(learner_wait_s=0.0, generator_wait_s=0.0) if run.is_async else {}
  # The parameter ring of simulated_async: ``lag`` copies in the parameters' own layout.
  carry = Carry(state=state, buffer=buffer,
                ring=tuple(jax.tree.map(jnp.copy, params) for _ in range(run.lag)),
                limiter_state=rate_lib.init(),
                key=multihost.to_global(jax.random.key(c.seed), run.replicated),
                ledger=Ledger(),
                timers=Timers(**waits), position=0, step=0,
                best=ckpt_lib.best_so_far(best_manager) if best_manager is not None else None,
                auto=(auto_lib.initial_state(c.rollout.per_step, c.buffer.max_staleness)
                      if c.auto_replay.enabled else None))
  return run, carry


def _meshes(c: RunConfig):
  """(learner mesh, generator mesh or None): one mesh over the job's devices, or with
  ``mesh.generator_devices`` the actor–learner split's two sub-meshes."""
  if not c.mesh.generator_devices:
    mesh_shape = c.mesh.shape(jax.device_count())
    return sharding_lib.make_mesh(*mesh_shape,
                                  devices=jax.devices()[:int(np.prod(mesh_shape))]), None
  if jax.process_count() > 1:
    ckpt_lib.use_process_barriers()
  mesh_shape = c.mesh.shape(c.mesh.learner_device_count(jax.device_count(), jax.process_count()))
  return submesh.make_meshes(mesh_shape, c.mesh.generator_devices, c.mesh.generator_tensor)


def _workdir(c: RunConfig):
  """(workdir str, checkpoint manager, best-checkpoint manager or None), the config written.

  Raises:
    ConfigError: the workdir holds a checkpoint of a run with other settings.
  """
  # epath: a gs:// (or other URL) workdir stays a URL; a local relative one becomes absolute.
  workdir = ckpt_lib.run_path(c.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  manager = ckpt_lib.make_manager(workdir / "checkpoints", c.checkpoint.max_to_keep)
  # The best held-out accuracy's train state, besides the last max_to_keep; resume uses
  # the latest (``manager``), never this one.
  best_manager = (ckpt_lib.make_best_manager(workdir / "checkpoints_best")
                  if c.checkpoint.keep_best else None)
  workdir = str(workdir)
  _check_resumable(manager, c.tree_json, workdir)
  if multihost.is_primary():  # one writer per job; Orbax coordinates the checkpoints
    ckpt_lib.write_atomic(os.path.join(workdir, "config.json"),
                          json.dumps(json.loads(c.tree_json), indent=2))
  return workdir, manager, best_manager


def _policy(c: RunConfig, task, workdir: str, mesh, log):
  """(io, graphdef, params, base_info): the starting policy (``load_policy``), with LoRA
  adapters added when ``model.lora`` is on; a built-in policy's tokenizer is copied into
  the workdir, where ``jaxreplay.export`` reads it."""
  io, graphdef, params, base_info = load_policy(c.model, c.task, c.warmstart, task, seed=c.seed,
                                                max_new_tokens=c.sampler.max_new_tokens,
                                                log=log, mesh=mesh, progress=c.log.progress)
  lora_spec = c.model.lora_spec()
  if lora_spec.enabled:  # adapters on the loaded (warm-started) policy, whose weights freeze
    graphdef, params = lora_lib.add_adapters(graphdef, params, lora_spec,
                                             jax.random.fold_in(jax.random.key(c.seed), LORA_KEY))
  if c.model.source == "builtin" and multihost.is_primary():
    ckpt_lib.write_atomic(os.path.join(workdir, "tokenizer.json"), io.tok.to_str())
  return io, graphdef, params, base_info


def _evaluate_fn(c: RunConfig, graphdef, io, task, mesh, score_rows: int):
  """The held-out evaluation, ``evaluate`` with everything but the parameters bound."""
  held_out = c.sampler.with_overrides(c.eval.temperature, c.eval.top_p)
  examples = task.heldout[:c.eval.num_examples]
  return functools.partial(evaluate, graphdef, io=io, task=task, examples=examples,
                           record=samples_lib.record_indices(len(examples), c.eval.record,
                                                             c.seed),
                           max_new_tokens=c.sampler.max_new_tokens,
                           temperature=held_out.temperature,
                           samples_per_example=c.eval.samples_per_example,
                           correct_threshold=c.buffer.correct_threshold,
                           top_k=held_out.top_k, top_p=held_out.top_p,
                           chunk=c.eval.batch_rows, mesh=mesh,
                           logprob_chunk=c.algo.logprob_chunk, score_rows=score_rows,
                           pack=c.algo.pack_sequences, paged=c.sampler.paged,
                           page_size=c.sampler.page_size, num_pages=c.sampler.num_pages,
                           attention=c.sampler.attention)


def _train_state(c: RunConfig, graphdef, params, optimizer, mesh):
  """(train state, its shardings): parameters and optimizer state laid out by PARAM_RULES,
  created by a jit whose out_shardings are those layouts, so every device allocates only
  its block (the loaded parameters are donated into the state; the frozen KL reference
  exists only when ``algo`` uses one). Restores go into the same layouts."""
  init_state = lambda p: init_train_state(graphdef, p, optimizer, c.algo)
  state_sh = sharding_lib.param_shardings(jax.eval_shape(init_state, params), mesh)
  return jax.jit(init_state, out_shardings=state_sh, donate_argnums=0)(params), state_sh


def _replay_buffer(c: RunConfig, mesh):
  """(the replay-buffer bundle, its empty state, that state's shardings: the capacity axis
  over ``data``)."""
  rb = replay.make_replay_buffer(c.buffer.capacity, c.train.batch_size, c.buffer)
  # The self-tuning controller may set an age cut-off at any step: its buffer is created
  # with ``may_have_holes`` (a static part of the state's structure) from the start.
  evicts = c.buffer.evicts or c.auto_replay.enabled
  width = c.task.prompt_width + c.sampler.max_new_tokens
  init_buffer = lambda: rb.init(empty_rollout(1, width), evicts=evicts)
  buffer_sh = replay.state_sharding(jax.eval_shape(init_buffer), mesh, "data")
  return rb, jax.jit(init_buffer, out_shardings=buffer_sh)(), buffer_sh


def _learner_fns(c: RunConfig, graphdef, optimizer, rb, cost, mesh, state_sh, buffer_sh,
                 score_rows: int):
  """(the ``LearnerFns`` of the configured R and buffer, and with ``auto_replay`` a
  ``learner_fns(per_step, buffer_spec)`` that builds — once per setting — those the
  self-tuning controller switches to; else None)."""
  samp, algo, b = c.sampler, c.algo, c.train.batch_size
  train_step = make_train_step(graphdef, optimizer, algo, samp.temperature, samp.top_k,
                               samp.top_p, seed=c.seed)
  drift_fn = make_drift_fn(graphdef, samp.temperature, c.drift.num_samples,
                           algo.staleness_buckets, samp.top_k, samp.top_p, algo.logprob_chunk,
                           score_rows, pack=algo.pack_sequences) if c.drift.every else None
  ar = c.auto_replay
  noise_fn = make_buffer_noise_fn(graphdef, algo, samp.temperature, samp.top_k, samp.top_p,
                                  num_samples=ar.num_samples,
                                  num_projections=ar.num_projections, center=ar.center,
                                  min_count=ar.min_samples, rows=score_rows
                                  ) if ar.enabled else None
  record_every = c.log.record_interval(c.eval.every)

  def make_fns(per_step: int, buffer_spec: SamplerConfig, rb=None) -> LearnerFns:
    """The learner-side functions for R = ``per_step`` and the buffer's sampler spec (its
    age cut-off): what the self-tuning controller rebuilds when it changes them."""
    if rb is None:
      rb = replay.make_replay_buffer(buffer_spec.capacity, b, buffer_spec)
    learner_step = make_learner_step(train_step, rb, cost=cost, epochs=algo.update_epochs,
                                     forwards=accounting.learner_forwards(algo),
                                     mesh=mesh, state_sharding=state_sh,
                                     buffer_sharding=buffer_sh,
                                     compile_cost_steps=c.train.compile_cost_steps)
    ready = make_ready(rb)
    return LearnerFns(insert=make_inserter(rb, per_step, buffer_sh),
                      learner_step=learner_step,
                      ready=lambda buffer, version: bool(multihost.to_host(ready(buffer,
                                                                                 version))),
                      # scorers over the learner's mesh without its context mesh: a splash
                      # kernel in them runs per device (attention.kernel_mesh)
                      drift=attention.with_kernel_mesh(drift_fn, mesh),
                      noise=attention.with_kernel_mesh(noise_fn, mesh),
                      trained=attention.with_kernel_mesh(samples_lib.make_trained_fn(
                          graphdef, rb, c.log.record_rollouts, samp.temperature, samp.top_k,
                          samp.top_p, algo.logprob_chunk, score_rows), mesh)
                      if record_every else None)

  fns = make_fns(c.rollout.per_step, c.buffer, rb)
  if not ar.enabled:
    return fns, None
  built = {(c.rollout.per_step, c.buffer.max_staleness): fns}  # returning compiles nothing

  def learner_fns(per_step: int, buffer_spec: SamplerConfig) -> LearnerFns:
    key = (per_step, buffer_spec.max_staleness)
    if key not in built:
      built[key] = make_fns(per_step, buffer_spec)
    return built[key]

  return fns, learner_fns
