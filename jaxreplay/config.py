"""The config tree → one frozen ``RunConfig`` of section specs, validated before any compute.

Each section of the tree is owned by a frozen spec defined next to the module that uses it
(``SECTIONS``); ``validate`` builds them all, then checks the rules that read several
sections (``check_combinations``) and the files the run needs. Every error is one line,
``"config.SECTION.FIELD=VALUE is invalid: what is allowed"``. Only this module and
``main.py`` read the tree; everything downstream takes its own spec(s).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import math
import os

from jaxreplay.models.spec import ModelSpec
from jaxreplay.parallel.spec import DistributedSpec, MeshSpec
from jaxreplay.replay.auto import AutoReplaySpec
from jaxreplay.replay.config import RateLimiterSpec, SamplerConfig
from jaxreplay.rl.spec import GROUP_ESTIMATORS, AlgoSpec
from jaxreplay.sampling.spec import SamplingSpec
from jaxreplay.spec import ConfigError
from jaxreplay.tasks.spec import TaskSpec
from jaxreplay.train.spec import (MODES, CheckpointSpec, DriftSpec, EvalSpec, LogSpec,
                                  RolloutSpec, TrainSpec, WarmstartSpec)

__all__ = ["ConfigError", "RunConfig", "SECTIONS", "apply_overrides", "check_combinations",
           "derived", "distributed_settings", "load_config", "mesh_shape", "policy_lag",
           "rate_limiter_settings", "sibling_config", "validate", "MODES"]


def load_config(path: str):
  """``get_config()`` of the config file at ``path`` (a Python file).

  Raises:
    FileNotFoundError: no such file.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location(
      "jaxreplay_config_" + os.path.basename(path)[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def sibling_config(file: str, name: str):
  """The config ``NAME.py`` next to ``file`` — how presets build on ``configs/default.py``."""
  return load_config(os.path.join(os.path.dirname(os.path.abspath(file)), name + ".py"))


def apply_overrides(cfg, pairs) -> None:
  """Sets ``KEY=VALUE`` overrides on ``cfg`` in place — the scripts' form of ``--config.KEY=VALUE``.

  Args:
    cfg: a ConfigDict tree. pairs: strings ``"section.field=value"``; the value is read as a
      Python literal (``8``, ``1e-4``, ``True``, ``(0, 1)``), else kept as a string.

  Raises:
    KeyError / AttributeError: an unknown section or field (ConfigDict names it).
  """
  for pair in pairs:
    key, _, raw = pair.partition("=")
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    node = cfg
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value


# Every section of the tree and the spec that owns it, in the order a reader meets them.
SECTIONS = {
    "task": TaskSpec, "model": ModelSpec, "warmstart": WarmstartSpec, "sampler": SamplingSpec,
    "rollout": RolloutSpec, "buffer": SamplerConfig, "auto_replay": AutoReplaySpec,
    "train": TrainSpec, "rate_limiter": RateLimiterSpec, "algo": AlgoSpec, "eval": EvalSpec, "drift": DriftSpec,
    "checkpoint": CheckpointSpec, "mesh": MeshSpec, "log": LogSpec,
    "distributed": DistributedSpec,
}
TOP_LEVEL = ("seed", "workdir")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A validated config: one frozen spec per section, plus the run's seed and directory.

  Attributes:
    seed: int, the root of every random stream of the run.
    workdir: str, the run directory (a local path or an ``etils.epath`` URL).
    task … distributed: the section specs (``SECTIONS``).
    tree_json: the config tree as given, JSON (recorded in ``config.json`` and checkpoints;
      ``checkpoint.config_changes`` compares it on resume).
  """

  seed: int
  workdir: str
  task: TaskSpec
  model: ModelSpec
  warmstart: WarmstartSpec
  sampler: SamplingSpec
  rollout: RolloutSpec
  buffer: SamplerConfig
  auto_replay: AutoReplaySpec
  train: TrainSpec
  rate_limiter: RateLimiterSpec
  algo: AlgoSpec
  eval: EvalSpec
  drift: DriftSpec
  checkpoint: CheckpointSpec
  mesh: MeshSpec
  log: LogSpec
  distributed: DistributedSpec
  tree_json: str = dataclasses.field(default="{}", repr=False, compare=False)

  __hash__ = None  # TaskSpec holds a dict

  def replace(self, **changes) -> RunConfig:
    """A copy with whole sections (or seed / workdir) replaced."""
    return dataclasses.replace(self, **changes)


def _fail(field: str, value, allowed: str):
  raise ConfigError(" ".join(f"config.{field}={value!r} is invalid: {allowed}".split()))


def _prefixed(e: Exception) -> ConfigError:
  return ConfigError(f"config.{e}")


def specs(cfg) -> RunConfig:
  """Builds every section's spec from the tree; absent sections take their defaults.

  Args:
    cfg: the config tree (``ConfigDict`` or nested dict) of ``configs/*.py``.

  Returns:
    The ``RunConfig`` (no cross-section rule checked yet: ``validate`` does).

  Raises:
    ConfigError: an unknown top-level key or section field, or a bad value (one line).
  """
  if isinstance(cfg, RunConfig):
    return cfg
  known = list(SECTIONS) + list(TOP_LEVEL)
  for key in cfg.keys():
    if key not in known:
      match = difflib.get_close_matches(str(key), known, n=1)
      raise ConfigError(f"config.{key} is not a section of the config"
                        + (f" (did you mean config.{match[0]}?)" if match else "")
                        + f"; the sections are {', '.join(known)}")
  built = {}
  for name, spec_cls in SECTIONS.items():
    try:
      built[name] = spec_cls.from_config(cfg.get(name))
    except ValueError as e:
      raise _prefixed(e) from None
  seed, workdir = cfg.get("seed", 0), cfg.get("workdir", "runs/default")
  if isinstance(seed, bool) or not isinstance(seed, int):
    _fail("seed", seed, "must be an int")
  if not isinstance(workdir, str) or not workdir:
    _fail("workdir", workdir, "must be a non-empty path or URL string")
  to_json = getattr(cfg, "to_json_best_effort", None)
  tree_json = to_json() if callable(to_json) else json.dumps(cfg, default=str)
  return RunConfig(seed=seed, workdir=workdir, tree_json=tree_json, **built)


def derived(cfg) -> dict:
  """Derived sizes: prompts per step P = R / G, replay ratio B / R, horizon N / R.

  Args:
    cfg: the config tree or a ``RunConfig``.
  """
  c = specs(cfg)
  r = c.rollout.per_step
  return {"prompts_per_step": c.rollout.prompts_per_step,
          "replay_ratio": c.train.batch_size / r, "staleness_horizon": c.buffer.capacity / r}


def rate_limiter_settings(cfg) -> dict:
  """The rate limiter's resolved settings (``RateLimiterSpec.settings``) of a tree or
  ``RunConfig``."""
  c = specs(cfg)
  return c.rate_limiter.settings(c.train.batch_size, c.rollout.per_step)


def mesh_shape(cfg, device_count: int | None = None) -> tuple[int, int, int]:
  """The resolved mesh sizes (data, fsdp, tensor) on ``device_count`` devices
  (``MeshSpec.shape``; default ``jax.device_count()``).

  Args:
    cfg: the config tree, a ``RunConfig`` or a ``MeshSpec``.

  Raises:
    ConfigError: bad sizes, or sizes whose product does not divide the device count.
  """
  if device_count is None:
    import jax
    device_count = jax.device_count()
  if isinstance(cfg, MeshSpec):
    mesh = cfg
  elif isinstance(cfg, RunConfig):
    mesh = cfg.mesh
  else:
    try:
      mesh = MeshSpec.from_config(cfg.get("mesh"))
    except ValueError as e:
      raise _prefixed(e) from None
  try:
    return mesh.shape(device_count)
  except ValueError as e:
    raise _prefixed(e) from None


def distributed_settings(cfg) -> dict | None:
  """The ``jax.distributed.initialize`` arguments of the ``distributed`` section, checked;
  None for a one-process job (``DistributedSpec.settings``). Reads no JAX state: call it
  before JAX starts.

  Args:
    cfg: the config tree or a ``RunConfig``.

  Raises:
    ConfigError: a bad ``distributed`` field.
  """
  if isinstance(cfg, RunConfig):
    return cfg.distributed.settings()
  try:
    return DistributedSpec.from_config(cfg.get("distributed")).settings()
  except ValueError as e:
    raise _prefixed(e) from None


def policy_lag(cfg) -> int:
  """Policy versions between the learner and the generating policy (``TrainSpec.policy_lag``)."""
  return specs(cfg).train.policy_lag


def _check_multiprocess(c: RunConfig, process_count: int, device_count: int) -> None:
  """What a job of several processes needs: a mesh over every device (each process must
  own part of it), and a strategy whose collectives run in the same order everywhere
  (``async`` interleaves a generator thread with the learner by timing)."""
  if process_count <= 1:
    return
  if c.train.mode == "async" and not c.mesh.generator_devices:
    _fail("train.mode", "async", f"on one mesh is one-process only ({process_count} processes "
          "here): its generator thread interleaves with the learner by timing, which differs "
          "between processes; set mesh.generator_devices (the actor–learner split, which "
          "agrees on every decision over the meshes), or use 'sync' or 'simulated_async'")
  sizes = c.mesh.sizes
  if -1 not in sizes and sizes[0] * sizes[1] * sizes[2] != device_count:
    _fail("mesh", dict(zip(("data", "fsdp", "tensor"), sizes)),
          f"must use all {device_count} devices of the {process_count} processes (or set one "
          "size to -1)")


def _check_eligible_supply(c: RunConfig) -> None:
  """Rejects eviction rules that keep fewer than B items drawable at every learner step.

  In the lagged modes (``sync``: lag L = 0; ``simulated_async``: L = ``train.lag``) the
  rollouts of step u carry version u − L, so at step t an age cut-off s
  (``buffer.max_staleness``) keeps the last s − L + 1 rounds of R: min(N, (s − L + 1)·R)
  items, none at all when s < L. A use cap k (``buffer.max_times_sampled``) supplies k·R
  draws per step against B consumed. Either below B, every step would need extra
  generation to fill its batch (see ``train.lagged.generate_and_insert``), so the config is
  refused. Positive-bias sampling draws from the freshest round((1 − δ)·size) items plus the
  freshest correct ones: with fewer than B of the former, the batch waits on correct
  rollouts a weak policy may never produce. ``async`` has no fixed lag: its learner waits
  for B drawable items, which never come when the age cut-off is below the weight-sync
  interval (the generator's weights are up to that interval minus one old when a round
  starts, and the learner moves on while the round is generated and queued).
  """
  mode, buf = c.train.mode, c.buffer
  b, r, n = c.train.batch_size, c.rollout.per_step, buf.capacity
  s, k = buf.max_staleness, buf.max_times_sampled
  if buf.sampler == "positive_bias" and buf.positive_bias_size:
    fresh_any = buf.num_fresh_any
    if fresh_any < b:
      _fail("buffer.positive_bias_size", buf.positive_bias_size,
            f"keeps round((1 - positive_bias_delta) * positive_bias_size) = {fresh_any} of the "
            f"freshest items whatever their reward, fewer than train.batch_size={b}: raise it "
            "or lower buffer.positive_bias_delta")
  if mode == "async":
    wse = c.train.weight_sync_every
    if s is not None and s < wse:
      _fail("buffer.max_staleness", s, f"must be >= train.weight_sync_every = {wse} in "
            "train.mode='async': the generator's weights are up to weight_sync_every - 1 "
            "versions old when a round starts and the learner moves on while it is generated "
            "and queued, so a tighter cut-off can evict every round before its first draw "
            "(both sides then wait for ever)")
    return
  lag = c.train.policy_lag
  if s is not None and min(n, (s - lag + 1) * r) < b:
    _fail("buffer.max_staleness", s,
          f"keeps min(buffer.capacity, (max_staleness - lag + 1) * rollout.per_step) = "
          f"{max(min(n, (s - lag + 1) * r), 0)} items drawable (lag {lag} in train.mode="
          f"{mode!r}), fewer than train.batch_size={b}: raise it or lower the batch size")
  if k is not None and k * r < b:
    _fail("buffer.max_times_sampled", k,
          f"supplies max_times_sampled * rollout.per_step = {k * r} draws per step, fewer than "
          f"train.batch_size={b}: raise it or lower the batch size")


def _check_split(c: RunConfig, device_count: int, process_count: int) -> None:
  """The actor–learner split (``mesh.generator_devices`` W > 0): the async strategy, at least
  one learner device per process, a generator tensor size that divides the W·processes
  generator devices, and behaviour log-probs and rewards that need no learner-side pass
  during generation (the generator holds only its inference copy)."""
  w, local = c.mesh.generator_devices, device_count // max(process_count, 1)
  if c.train.mode != "async":
    _fail("mesh.generator_devices", w, f"needs train.mode='async' (the generator and the "
          f"learner run at once), not {c.train.mode!r}; or set it to 0")
  if w >= local:
    _fail("mesh.generator_devices", w, f"must be below the {local} device(s) of each process "
          "(the learner needs at least one)")
  if (w * process_count) % c.mesh.generator_tensor:
    _fail("mesh.generator_tensor", c.mesh.generator_tensor,
          f"must divide the {w * process_count} generator devices (mesh.generator_devices="
          f"{w} per process × {process_count} processes)")
  if c.rollout.behaviour_logprobs != "sampler":
    _fail("rollout.behaviour_logprobs", c.rollout.behaviour_logprobs,
          "must be 'sampler' with mesh.generator_devices > 0 (the generator has no learner "
          "forward to rescore with)")
  if c.algo.kl_mode == "reward" and c.algo.kl_coef > 0 and c.algo.advantage != "gae":
    _fail("algo.kl_mode", "reward", "needs the frozen reference during generation, which the "
          "generator mesh does not hold: use algo.kl_mode='loss' with mesh.generator_devices")


def _check_auto_replay(c: RunConfig, shards: int) -> None:
  """What the self-tuning replay controller (``auto_replay.enabled``; ``train.self_tuning``)
  needs: the lagged strategy (it retunes R and the age cut-off between learner steps), a
  policy-gradient loss its per-item gradients can take (``rl.noise.per_item_loss_fn``: no
  critic, no KL reference), fresh items to centre on for ``center='fresh'`` (lag 0), a use
  cap that still supplies B draws at the smallest R it may pick (R >= B / y_max), and room
  in the buffer for one round of the smallest R that splits over the mesh."""
  ar = c.auto_replay
  if not ar.enabled:
    return
  if c.train.mode not in ("sync", "simulated_async"):
    _fail("auto_replay.enabled", True, f"needs train.mode 'sync' or 'simulated_async' (the "
          f"lagged strategy, which retunes R and the age cut-off between learner steps), not "
          f"{c.train.mode!r}; or set auto_replay.enabled=False")
  if c.algo.advantage == "gae":
    _fail("auto_replay.enabled", True, "needs a policy-gradient estimator without a critic "
          "(the noise estimate differentiates the policy loss alone), not "
          "algo.advantage='gae'")
  if c.algo.kl_coef > 0:
    _fail("auto_replay.enabled", True, f"needs algo.kl_coef=0 (the noise estimate "
          f"differentiates the policy loss alone), not {c.algo.kl_coef}")
  if ar.center == "fresh" and c.train.policy_lag:
    _fail("auto_replay.center", "fresh", f"needs staleness-0 items, which train.mode="
          f"{c.train.mode!r} with lag {c.train.policy_lag} never holds: use 'mean'")
  k = c.buffer.max_times_sampled
  if k is not None and k < ar.y_max:
    _fail("buffer.max_times_sampled", k, f"must be >= auto_replay.y_max={ar.y_max}: the "
          "controller may set R = B / y_max, and max_times_sampled * R draws per step must "
          "cover train.batch_size")
  unit = math.lcm(c.rollout.group_size, shards)
  if unit > c.buffer.capacity:
    _fail("buffer.capacity", c.buffer.capacity, f"must be >= lcm(rollout.group_size, mesh "
          f"data×fsdp) = {unit} with auto_replay.enabled: R moves in steps of that size")


def check_combinations(c: RunConfig, device_count: int, process_count: int) -> None:
  """The rules that read several sections.

  Args:
    c: the ``RunConfig``. device_count: devices the mesh is built on (the batch sizes and
      the buffer must split over it). process_count: processes of the job (with more than
      one the mesh must span every device and ``train.mode`` may not be ``async``).

  Raises:
    ConfigError: the first combination that cannot run, naming the field and the others.
  """
  algo, b, r, g = c.algo, c.train.batch_size, c.rollout.per_step, c.rollout.group_size
  if algo.lr_schedule == "cosine" and 0 < c.train.steps <= algo.warmup_steps:
    _fail("algo.warmup_steps", algo.warmup_steps,
          f"must be < train.steps={c.train.steps} with algo.lr_schedule='cosine'")
  if g == 1 and algo.advantage in GROUP_ESTIMATORS:
    _fail("rollout.group_size", g, f"algo.advantage={algo.advantage!r} needs groups of >= 2")
  if c.buffer.capacity < b:
    _fail("buffer.capacity", c.buffer.capacity, f"must be >= train.batch_size={b}")
  if c.buffer.capacity < r:
    _fail("buffer.capacity", c.buffer.capacity, f"must be >= rollout.per_step={r}")
  try:
    c.buffer.validate_for(c.buffer.capacity, b)
  except ValueError as e:
    raise _prefixed(e) from None
  if b % algo.num_minibatches:
    _fail("algo.num_minibatches", algo.num_minibatches, f"must divide train.batch_size={b}")
  if (b // algo.num_minibatches) % algo.grad_accum_steps:
    _fail("algo.grad_accum_steps", algo.grad_accum_steps,
          f"must divide the minibatch train.batch_size / algo.num_minibatches = "
          f"{b} / {algo.num_minibatches}")
  if c.task.chat_template and c.model.source == "builtin":
    _fail("task.chat_template", True, "needs model.source='hf' or 'gguf' (a checkpoint with a "
          "chat template)")
  if c.train.max_generated_rollouts and c.train.mode == "async":
    _fail("train.max_generated_rollouts", c.train.max_generated_rollouts,
          "(a generation budget) needs train.mode 'sync' or 'simulated_async'; or set it to 0")
  if c.train.mode == "async":
    rl = c.rate_limiter.settings(b, r)
    if rl["min_size_to_sample"] > c.buffer.capacity:
      _fail("rate_limiter.min_fill", c.rate_limiter.min_fill,
            f"must be <= buffer.capacity={c.buffer.capacity}: the buffer could never hold "
            "enough items to sample")
    need = (rl["samples_per_insert"] * r + b) / 2
    if rl["error_buffer"] < need:
      _fail("rate_limiter.error_buffer", rl["error_buffer"],
            f"must be >= (samples_per_insert*rollout.per_step + train.batch_size)/2 = {need}: "
            "a smaller tolerance can block both generation and training (deadlock)")
  _check_eligible_supply(c)
  if c.mesh.generator_devices:
    _check_split(c, device_count, process_count)
    device_count = c.mesh.learner_device_count(device_count, process_count)
  data, fsdp, _ = mesh_shape(c.mesh, device_count)
  _check_multiprocess(c, process_count, device_count)
  shards = data * fsdp
  for f, v in (("train.batch_size", b), ("rollout.per_step", r),
               ("buffer.capacity", c.buffer.capacity)):
    if v % shards:
      _fail(f, v, f"must be divisible by mesh data×fsdp = {data}×{fsdp} = {shards} "
            "(set config.mesh.data / mesh.fsdp to sizes that divide it)")
  _check_auto_replay(c, shards)


def check_files(c: RunConfig) -> None:
  """The files the run reads exist: task files, a Hugging Face checkpoint directory.

  Raises:
    ConfigError: a task path matches no file, or ``model.path`` is not a checkpoint
      directory.
  """
  try:
    c.task.check_files()
  except FileNotFoundError as e:
    raise _prefixed(e) from None
  if c.model.source == "hf":
    from jaxreplay import storage
    path = c.model.path
    missing = [f for f in ("config.json", "tokenizer.json")
               if not storage.exists(os.path.join(path or "", f))]
    if not path or missing:
      _fail("model.path", path, "must be a Hugging Face checkpoint directory (local or a URL "
            "such as gs://...) holding config.json, tokenizer.json and *.safetensors"
            + (f" (missing: {', '.join(missing)})" if path else ""))
  if c.model.source == "gguf":
    from jaxreplay import storage
    from jaxreplay.models.gguf import resolve_gguf_path
    try:
      if storage.is_remote(c.model.path):
        if not storage.exists(c.model.path):
          raise FileNotFoundError(f"model.path={c.model.path!r}: no such file")
      else:
        resolve_gguf_path(c.model.path)
    except FileNotFoundError as e:  # the message names model.path and how to install it
      raise _prefixed(e) from None


def validate(cfg, device_count: int | None = None, process_count: int | None = None
             ) -> RunConfig:
  """Checks every field the run uses and returns the ``RunConfig`` the run reads.

  Args:
    cfg: the config tree (or a ``RunConfig``, checked again). device_count: devices the
      mesh is built on (default ``jax.device_count()``). process_count: processes of the
      job (default ``jax.process_count()``).

  Returns:
    The validated ``RunConfig``.

  Raises:
    ConfigError: a value out of range, not among the valid choices, a combination of
      sections that cannot run, or a missing file (one line naming the field).
  """
  c = specs(cfg)
  if process_count is None or device_count is None:
    import jax
    process_count = jax.process_count() if process_count is None else process_count
    device_count = jax.device_count() if device_count is None else device_count
  check_combinations(c, device_count, process_count)
  check_files(c)
  return c
