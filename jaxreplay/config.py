"""Validation and derived fields of the config tree, run before any compilation."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os

from jaxreplay import replay
from jaxreplay.models.transformer import REMAT_POLICIES
from jaxreplay.rl.spec import GROUP_ESTIMATORS, AlgoSpec
from jaxreplay.tasks.spec import validate_task


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


MODEL_SOURCES = ("builtin", "hf")
DTYPES = ("float32", "bfloat16")
# Where the stored behaviour log-probs come from (train.generation.learner_behaviour_logprobs).
BEHAVIOUR_LOGPROBS = ("sampler", "learner")


class ConfigError(ValueError):
  """A config field has an invalid value; the message names field, value and what is allowed."""


def _fail(field: str, value, allowed: str):
  raise ConfigError(f"config.{field}={value!r} is invalid: {allowed}")


def _choice(cfg, field: str, choices):
  node = cfg
  for part in field.split("."):
    node = node[part]
  if node not in choices:
    near = difflib.get_close_matches(str(node), [str(c) for c in choices], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    _fail(field, node, f"must be one of {tuple(choices)}{hint}")


def derived(cfg) -> dict:
  """Derived sizes: prompts per step P = R / G, replay ratio B / R, horizon N / R."""
  r, g = cfg.rollout.per_step, cfg.rollout.group_size
  return {"prompts_per_step": r // g, "replay_ratio": cfg.train.batch_size / r,
          "staleness_horizon": cfg.buffer.capacity / r}


MODES = ("sync", "simulated_async", "async")


def rate_limiter_settings(cfg) -> dict:
  """The rate limiter's resolved settings, unset fields derived from B and R.

  Returns:
    {"samples_per_insert": ρ (default B/R), "min_size_to_sample": max(min_fill, B)
     (default B: a batch of B distinct items needs B items), "error_buffer": e (default
     ρR + B, twice the smallest deadlock-free tolerance of ``RateLimiter.check_sizes``)}.
  """
  rl = cfg.get("rate_limiter", {})
  b, r = cfg.train.batch_size, cfg.rollout.per_step
  rho = rl.get("samples_per_insert") or b / r
  min_fill = rl.get("min_fill") or b
  err = rl.get("error_buffer")
  return {"samples_per_insert": float(rho), "min_size_to_sample": int(max(min_fill, b)),
          "error_buffer": float(rho * r + b if err is None else err)}


MESH_FIELDS = ("data", "fsdp", "tensor")


def mesh_shape(cfg, device_count: int | None = None) -> tuple[int, int, int]:
  """The resolved mesh sizes (data, fsdp, tensor) of ``cfg.mesh`` on ``device_count`` devices.

  One size may be -1: it takes the remaining devices. Without a -1 the product may also
  be a divisor of the device count; the mesh then uses the first ``product`` devices.

  Args:
    cfg: the config (reads ``cfg.mesh.{data,fsdp,tensor}``, ints).
    device_count: number of devices; default ``jax.device_count()``.

  Returns:
    (data, fsdp, tensor), positive ints whose product divides ``device_count``.

  Raises:
    ConfigError: a size that is not a positive int or -1, more than one -1, or sizes whose
      product does not divide the device count.
  """
  if device_count is None:
    import jax
    device_count = jax.device_count()
  sizes = [cfg.mesh[f] for f in MESH_FIELDS]
  for f, v in zip(MESH_FIELDS, sizes):
    if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
      _fail(f"mesh.{f}", v, "must be a positive int, or -1 for the remaining devices")
  if sizes.count(-1) > 1:
    _fail("mesh", dict(zip(MESH_FIELDS, sizes)), "at most one of data, fsdp, tensor may be -1")
  known = 1
  for v in sizes:
    known *= v if v != -1 else 1
  if device_count % known:
    _fail("mesh", dict(zip(MESH_FIELDS, sizes)),
          f"the product of the sizes ({known}) must divide jax.device_count()={device_count}")
  if -1 in sizes:
    sizes[sizes.index(-1)] = device_count // known
  return tuple(sizes)


def distributed_settings(cfg) -> dict | None:
  """The ``jax.distributed.initialize`` arguments of ``cfg.distributed``, checked; None when
  ``distributed.initialize`` is False (or the section is absent): a one-process job.

  Fields left empty (``coordinator_address=""``, ``num_processes`` / ``process_id`` unset,
  ``local_device_ids=""``) are passed as None, so JAX detects them from the environment
  (TPU VM metadata, SLURM, Open MPI). Reads no JAX state: call it before JAX starts.

  Returns:
    {"coordinator_address": str | None, "num_processes": int | None,
     "process_id": int | None, "local_device_ids": tuple[int, ...] | None}, or None.

  Raises:
    ConfigError: ``initialize`` not a bool; an address not of the form ``host:port``; a
      process count < 1; a process id outside [0, num_processes) or given without the
      count; device ids that are not comma-separated non-negative ints.
  """
  d = cfg.get("distributed")
  if d is None:
    return None
  if not isinstance(d.get("initialize", False), bool):
    _fail("distributed.initialize", d.initialize, "must be True or False")
  if not d.get("initialize", False):
    return None
  addr = d.get("coordinator_address") or ""
  if addr:
    host, _, port = str(addr).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      _fail("distributed.coordinator_address", addr,
            "must be 'host:port' (port 1..65535), or '' to let JAX detect it")
  n, pid = d.get("num_processes"), d.get("process_id")
  if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
    _fail("distributed.num_processes", n, "must be an int >= 1, or unset to let JAX detect it")
  if pid is not None:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
      _fail("distributed.process_id", pid, "must be an int >= 0, or unset to let JAX detect it")
    if n is None:
      _fail("distributed.process_id", pid, "needs distributed.num_processes as well")
    if pid >= n:
      _fail("distributed.process_id", pid, f"must be < distributed.num_processes={n}")
  if (n is not None and n > 1 or pid is not None) and not addr:
    _fail("distributed.coordinator_address", addr,
          "must be set when num_processes / process_id are given (JAX detects all three "
          "together or none)")
  ids_text = str(d.get("local_device_ids") or "").strip()
  ids = None
  if ids_text:
    parts = [x.strip() for x in ids_text.split(",")]
    if not all(x.isdigit() for x in parts):
      _fail("distributed.local_device_ids", ids_text,
            "must be comma-separated device ids such as '0,1', or '' for all local devices")
    ids = tuple(int(x) for x in parts)
  return {"coordinator_address": addr or None, "num_processes": n, "process_id": pid,
          "local_device_ids": ids}


def _check_multiprocess(cfg, process_count: int, device_count: int) -> None:
  """What a job of several processes needs: a mesh over every device (each process must
  own part of it), and a strategy whose collectives run in the same order everywhere
  (``async`` interleaves a generator thread with the learner by timing)."""
  if process_count <= 1:
    return
  if cfg.train.mode == "async":
    _fail("train.mode", "async", f"is one-process only ({process_count} processes here): "
          "its generator thread interleaves with the learner by timing, which differs between "
          "processes; use 'sync' or 'simulated_async'")
  sizes = [cfg.mesh[f] for f in MESH_FIELDS]
  if -1 not in sizes and sizes[0] * sizes[1] * sizes[2] != device_count:
    _fail("mesh", dict(zip(MESH_FIELDS, sizes)),
          f"must use all {device_count} devices of the {process_count} processes (or set one "
          "size to -1)")


def policy_lag(cfg) -> int:
  """Policy versions between the learner and the generating policy in the lagged modes:
  0 for ``sync``, ``train.lag`` for ``simulated_async`` (``async``: 0, its lag is timing)."""
  return cfg.train.get("lag", 0) if cfg.train.mode == "simulated_async" else 0


def _check_eligible_supply(cfg) -> None:
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
  interval minus one (the newest weights the generator can hold are that old).
  """
  mode, buf = cfg.train.mode, cfg.buffer
  b, r, n = cfg.train.batch_size, cfg.rollout.per_step, buf.capacity
  s, k = buf.get("max_staleness"), buf.get("max_times_sampled")
  if buf.get("sampler") == "positive_bias" and buf.get("positive_bias_size"):
    fresh_any = replay.from_config(buf).num_fresh_any
    if fresh_any < b:
      _fail("buffer.positive_bias_size", buf.positive_bias_size,
            f"keeps round((1 - positive_bias_delta) * positive_bias_size) = {fresh_any} of the "
            f"freshest items whatever their reward, fewer than train.batch_size={b}: raise it "
            "or lower buffer.positive_bias_delta")
  if mode == "async":
    wse = cfg.train.get("weight_sync_every", 1)
    if s is not None and s < wse - 1:
      _fail("buffer.max_staleness", s, f"must be >= train.weight_sync_every - 1 = {wse - 1} in "
            "train.mode='async': fresh rollouts are up to that many versions old")
    return
  lag = policy_lag(cfg)
  if s is not None and min(n, (s - lag + 1) * r) < b:
    _fail("buffer.max_staleness", s,
          f"keeps min(buffer.capacity, (max_staleness - lag + 1) * rollout.per_step) = "
          f"{max(min(n, (s - lag + 1) * r), 0)} items drawable (lag {lag} in train.mode="
          f"{mode!r}), fewer than train.batch_size={b}: raise it or lower the batch size")
  if k is not None and k * r < b:
    _fail("buffer.max_times_sampled", k,
          f"supplies max_times_sampled * rollout.per_step = {k * r} draws per step, fewer than "
          f"train.batch_size={b}: raise it or lower the batch size")


def validate(cfg, device_count: int | None = None, process_count: int | None = None) -> None:
  """Checks every field the run uses; raises ``ConfigError`` naming the first bad one.

  The ``algo`` section validates itself (``AlgoSpec``); its errors are raised here as
  ``ConfigError``. The checks below are of the other sections and of ``algo`` fields
  against them.

  Args:
    cfg: the config tree. device_count: devices the mesh is built on (default
      ``jax.device_count()``); the batch sizes and the buffer must split over the mesh.
    process_count: processes of the job (default ``jax.process_count()``); with more than
      one the mesh must span every device and ``train.mode`` may not be ``async``.

  Raises:
    ConfigError: a value out of range or not among the valid choices.
  """
  try:
    spec = AlgoSpec.from_config(cfg.algo)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if spec.lr_schedule == "cosine" and 0 < cfg.train.steps <= spec.warmup_steps:
    _fail("algo.warmup_steps", spec.warmup_steps,
          f"must be < train.steps={cfg.train.steps} with algo.lr_schedule='cosine'")
  try:  # every task option is honoured by the chosen source or refused (tasks/spec.py)
    validate_task(cfg.task)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"config.{e}") from None
  r, g = cfg.rollout.per_step, cfg.rollout.group_size
  if cfg.rollout.behaviour_logprobs not in BEHAVIOUR_LOGPROBS:
    _fail("rollout.behaviour_logprobs", cfg.rollout.behaviour_logprobs,
          f"must be one of {', '.join(BEHAVIOUR_LOGPROBS)}")
  if g < 1:
    _fail("rollout.group_size", g, "must be >= 1")
  if g == 1 and spec.advantage in GROUP_ESTIMATORS:
    _fail("rollout.group_size", g, f"algo.advantage={spec.advantage!r} needs groups of >= 2")
  if r < 1 or r % g:
    _fail("rollout.per_step", r, f"must be a positive multiple of rollout.group_size={g}")
  if cfg.train.batch_size < 1:
    _fail("train.batch_size", cfg.train.batch_size, "must be >= 1")
  if cfg.buffer.capacity < cfg.train.batch_size:
    _fail("buffer.capacity", cfg.buffer.capacity,
          f"must be >= train.batch_size={cfg.train.batch_size}")
  if cfg.buffer.capacity < r:
    _fail("buffer.capacity", cfg.buffer.capacity, f"must be >= rollout.per_step={r}")
  try:
    replay.from_config(cfg.buffer).validate_for(cfg.buffer.capacity, cfg.train.batch_size)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if cfg.train.batch_size % spec.num_minibatches:
    _fail("algo.num_minibatches", spec.num_minibatches,
          f"must divide train.batch_size={cfg.train.batch_size}")
  if (cfg.train.batch_size // spec.num_minibatches) % spec.grad_accum_steps:
    _fail("algo.grad_accum_steps", spec.grad_accum_steps,
          f"must divide the minibatch train.batch_size / algo.num_minibatches = "
          f"{cfg.train.batch_size} / {spec.num_minibatches}")
  if cfg.sampler.temperature <= 0:
    _fail("sampler.temperature", cfg.sampler.temperature, "must be > 0 for training rollouts")
  if cfg.model.source not in MODEL_SOURCES:
    _fail("model.source", cfg.model.source, f"must be one of {MODEL_SOURCES}")
  if cfg.model.source == "hf":
    missing = [f for f in ("config.json", "tokenizer.json")
               if not os.path.exists(os.path.join(cfg.model.path or "", f))]
    if not cfg.model.path or missing:
      _fail("model.path", cfg.model.path, "must be a local Hugging Face checkpoint directory "
            "holding config.json, tokenizer.json and *.safetensors"
            + (f" (missing: {', '.join(missing)})" if cfg.model.path else ""))
  for f in ("model.dtype", "model.param_dtype"):
    if cfg.model[f.split(".")[1]] not in DTYPES:
      _fail(f, cfg.model[f.split(".")[1]], f"must be one of {DTYPES}")
  # optional model keys (absent = off): one lax.scan over stacked layers, block remat
  if not isinstance(cfg.model.get("scan_layers", False), bool):
    _fail("model.scan_layers", cfg.model.scan_layers, "must be a bool")
  if cfg.model.get("remat", "none") not in REMAT_POLICIES:
    _fail("model.remat", cfg.model.remat, f"must be one of {REMAT_POLICIES}")
  if cfg.task.chat_template and cfg.model.source != "hf":
    _fail("task.chat_template", True, "needs model.source='hf' (a checkpoint with a chat template)")
  if cfg.sampler.top_k < 0:
    _fail("sampler.top_k", cfg.sampler.top_k, "must be >= 0 (0 disables top-k)")
  if not 0.0 < cfg.sampler.top_p <= 1.0:
    _fail("sampler.top_p", cfg.sampler.top_p, "must be in (0, 1] (1 disables top-p)")
  if cfg.sampler.max_new_tokens < 1:
    _fail("sampler.max_new_tokens", cfg.sampler.max_new_tokens, "must be >= 1")
  if cfg.sampler.get("slots", 0) < 0:
    _fail("sampler.slots", cfg.sampler.slots, "must be >= 0 (0: one decode slot per rollout)")
  if cfg.sampler.get("chunk_steps", 16) < 1:
    _fail("sampler.chunk_steps", cfg.sampler.chunk_steps, "must be >= 1")
  if cfg.train.steps < 0:
    _fail("train.steps", cfg.train.steps, "must be >= 0")
  if cfg.eval.every < 0 or cfg.checkpoint.every < 0:
    _fail("eval.every / checkpoint.every", (cfg.eval.every, cfg.checkpoint.every), "must be >= 0")
  train = cfg.train
  _choice(cfg, "train.mode", MODES)
  if train.get("lag", 0) < 0:
    _fail("train.lag", train.lag, "must be >= 0 (learner steps)")
  if train.get("weight_sync_every", 1) < 1:
    _fail("train.weight_sync_every", train.weight_sync_every, "must be >= 1 (learner steps)")
  if train.mode == "async":
    rl = rate_limiter_settings(cfg)
    if not rl["samples_per_insert"] > 0:
      _fail("rate_limiter.samples_per_insert", rl["samples_per_insert"], "must be > 0")
    if rl["min_size_to_sample"] > cfg.buffer.capacity:
      _fail("rate_limiter.min_fill", cfg.rate_limiter.min_fill,
            f"must be <= buffer.capacity={cfg.buffer.capacity}: the buffer could never hold "
            "enough items to sample")
    need = (rl["samples_per_insert"] * r + cfg.train.batch_size) / 2
    if rl["error_buffer"] < need:
      _fail("rate_limiter.error_buffer", rl["error_buffer"],
            f"must be >= (samples_per_insert*rollout.per_step + train.batch_size)/2 = {need}: "
            "a smaller tolerance can block both generation and training (deadlock)")
  if cfg.get("drift") is not None:
    if cfg.drift.every < 0:
      _fail("drift.every", cfg.drift.every, "must be >= 0 (0 = off)")
    if cfg.drift.every and cfg.drift.num_samples < 1:
      _fail("drift.num_samples", cfg.drift.num_samples, "must be >= 1")
  if cfg.eval.batch_rows < 1:
    _fail("eval.batch_rows", cfg.eval.batch_rows, "must be >= 1 (rows per generate call)")
  if cfg.eval.num_examples < 1:
    _fail("eval.num_examples", cfg.eval.num_examples, "must be >= 1 (held-out examples scored)")
  spe = cfg.eval.samples_per_example
  if spe < 1:
    _fail("eval.samples_per_example", spe, "must be >= 1")
  if cfg.eval.get("temperature") is not None and cfg.eval.temperature <= 0:
    _fail("eval.temperature", cfg.eval.temperature, "must be > 0 (unset: sampler.temperature)")
  if cfg.eval.get("top_p") is not None and not 0.0 < cfg.eval.top_p <= 1.0:
    _fail("eval.top_p", cfg.eval.top_p, "must be in (0, 1] (unset: sampler.top_p)")
  if cfg.checkpoint.max_to_keep < 1:
    _fail("checkpoint.max_to_keep", cfg.checkpoint.max_to_keep, "must be >= 1")
  _check_eligible_supply(cfg)
  distributed_settings(cfg)
  data, fsdp, tensor = mesh_shape(cfg, device_count)
  if process_count is None or device_count is None:
    import jax
    process_count = jax.process_count() if process_count is None else process_count
    device_count = jax.device_count() if device_count is None else device_count
  _check_multiprocess(cfg, process_count, device_count)
  shards = data * fsdp
  for f in ("train.batch_size", "rollout.per_step", "buffer.capacity"):
    sec, name = f.split(".")
    if cfg[sec][name] % shards:
      _fail(f, cfg[sec][name], f"must be divisible by mesh data×fsdp = {data}×{fsdp} = {shards} "
            "(set config.mesh.data / mesh.fsdp to sizes that divide it)")
