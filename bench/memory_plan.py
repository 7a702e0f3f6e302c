"""Per-device memory of a config's learner step and sampler on a mesh, from XLA itself.

``python bench/memory_plan.py --config CONFIG --devices N --chip NAME [--mesh D,F,T]
[--processes P] [--arch NAME] [--set algo.grad_accum_steps=8 ...]``

Lowers and compiles the device programs of a run for the config at a mesh of N fake CPU
devices (``--xla_force_host_platform_device_count``): the learner step (buffer sample +
``rl.train_step``, state and buffer donated, exactly as ``train.build`` assembles it); the
sampler (``sampling.generate``'s prefill + KV-cache decode of one rollout batch); and, when
the config runs them, the learner's rescoring of the behaviour log-probs
(``rollout.behaviour_logprobs='learner'``), the drift monitor (``drift.num_samples`` buffer
items scored) and the held-out evaluation (its sampled pass's generate call of up to
``eval.batch_rows`` rows and the fresh-sample entropy of those rows) — each scoring pass in the
learner's micro-batch rows and log-prob chunks, as the run does. Every input is an abstract
``jax.ShapeDtypeStruct`` carrying its ``NamedSharding``; the model is built with
``nnx.eval_shape``, so no weight is ever allocated and a 7B plan runs on a laptop. It prints
each executable's ``memory_analysis()`` (arguments, outputs, aliased = donated,
temporaries), the per-device peak next to the chip's HBM, and whether it fits with 20%
headroom in the memory JAX may use (peak ≤ 0.8 × pool); exit status 0 if it fits, 1 if not.
On a GPU the pool is ``train.device_memory_fraction`` of HBM (JAX's allocator reserves that
much at start-up and no more; 0 means JAX's default, 0.75), on a TPU the whole HBM.

Peak per device = the largest, over the programs, of arguments + outputs − aliased +
temporaries + the train state and buffer it does not take as arguments (optimizer state,
reference, buffer), which stay in HBM while it runs (the ``+resident`` column).

What it does not see: the allocator's fragmentation and the runtime's own reservations
(the 20% headroom is for those) and GPU/TPU-specific fusion: XLA:CPU schedules and fuses
differently (it may, e.g., keep bfloat16 matmul operands in float32), so the numbers
estimate the accelerator's; they have not been checked on one.

The actor–learner split (``mesh.generator_devices`` W > 0, ``train.mode='async'``;
``jaxreplay/train/split.py``): the two sub-meshes are planned apart. On the learner mesh
(the config's data/fsdp/tensor, or ``--mesh``, over T = N − W·P devices) the learner step,
the scoring and evaluation passes and, in place of the sampler, the weight sync's gather
(``parallel.submesh.make_weight_sync``: streamed, the largest block — one leaf, or one layer
of a scan-layout leaf — replicated in ``model.dtype`` on every learner device, the rest of
the state and the buffer resident). On the generator mesh
(W·P / generator_tensor, 1, generator_tensor) the sampler on the inference copy
(``model.dtype``, ``sharding.param_shardings`` of that mesh: replicated over data, split over
tensor), plus one more copy resident: the next published version, which arrives while this
one decodes. It prints each sub-mesh's peak against the chip's HBM; exit status 0 only if
both fit. XLA:CPU runs bfloat16 dots and all-gathers in float32, so the sampler and the
weight sync carry float32 copies of the bf16 weights a GPU or TPU does not make; their size
is printed (``cpu_f32_weights``, counted in the compiled HLO) and a peak without them, for
information: the verdict keeps them.

LoRA (``model.lora.rank`` > 0): the policy carries the float32 adapters ``train.build``
adds (``abstract_policy``), so the train state's optimizer state, the gradients and the
clip cover the adapters alone, and the frozen base is in ``model.param_dtype`` (bfloat16
halves it). With the split the first publish gathers the frozen base (``first sync``),
every later one the adapters alone (``weight sync``), and the generator's next published
version is adapters sharing its one frozen copy.

Model architecture: ``model.source='builtin'`` reads ``cfg.model``; ``'hf'`` reads
``model.path/config.json`` when it exists, else ``--arch`` (or the preset file's name)
picks a published ``config.json`` from ``ARCHS``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import tempfile
import time

# Accelerator HBM per chip, bytes (vendor figures, decimal GB).
CHIPS = {"h100": 80e9, "h200": 141e9, "a100": 80e9, "a100-40": 40e9, "l4": 24e9,
         "v5p": 95e9, "v5e": 16e9, "v4": 32e9, "v6e": 32e9}
HEADROOM = 0.2
# GPUs, whose JAX allocator takes a fraction of HBM (XLA_PYTHON_CLIENT_MEM_FRACTION), and
# that fraction's default.
GPU_CHIPS = ("h100", "h200", "a100", "a100-40", "l4")
JAX_GPU_MEM_FRACTION = 0.75


def memory_pool(cfg, chip: str) -> tuple[float, float]:
  """(fraction, bytes): the share of a chip's HBM that JAX may allocate, and its size.

  GPUs: ``train.device_memory_fraction`` (0 or absent: JAX's default 0.75), which the entry
  point sets as ``XLA_PYTHON_CLIENT_MEM_FRACTION``; TPUs: 1.0, the whole HBM.

  Raises:
    KeyError: ``chip`` not in ``CHIPS``.
  """
  if chip not in GPU_CHIPS:
    return 1.0, CHIPS[chip]
  fraction = float(cfg.train.get("device_memory_fraction", 0.0) or JAX_GPU_MEM_FRACTION)
  return fraction, fraction * CHIPS[chip]

# The published config.json of the presets' checkpoints (Hugging Face Hub, Qwen org).
ARCHS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, max_position_embeddings=32768),
}
# Preset file name prefix -> architecture, for hf presets without a local checkpoint.
ARCH_OF_PRESET = (("qwen2_5_0_5b", "qwen2.5-0.5b"), ("qwen2_5_7b", "qwen2.5-7b"))


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="config file (get_config())")
  p.add_argument("--devices", type=int, required=True, help="chips in the mesh")
  p.add_argument("--chip", required=True, choices=sorted(CHIPS), help="HBM per chip")
  p.add_argument("--processes", type=int, default=1,
                 help="processes (nodes) of the job: with mesh.generator_devices W, W per "
                      "process generate")
  p.add_argument("--mesh", default="", help="data,fsdp,tensor (default: the config's mesh; "
                 "with the split, the learner's)")
  p.add_argument("--arch", default="", choices=[""] + sorted(ARCHS),
                 help="architecture of an hf config without a local checkpoint")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. algo.grad_accum_steps=8 (repeatable)")
  return p.parse_args(argv)


def model_config(cfg, config_path: str = "", arch: str = ""):
  """The ``TransformerConfig`` a run of ``cfg`` would build (see the module docstring).

  Raises:
    ValueError: an hf config with neither a checkpoint, ``arch`` nor a known preset name.
  """
  from jaxreplay.models import hf
  from jaxreplay.train.warmstart import builtin_model_config
  if cfg.model.source == "builtin":
    return builtin_model_config(cfg.model)
  path = os.path.join(cfg.model.path or "", "config.json")
  if cfg.model.path and os.path.exists(path):
    hf_cfg = hf.read_hf_config(path)
  else:
    base = os.path.basename(config_path)
    arch = arch or next((a for prefix, a in ARCH_OF_PRESET if base.startswith(prefix)), "")
    if not arch:
      raise ValueError(f"model.path={cfg.model.path!r} has no config.json: pass --arch "
                       f"(one of {sorted(ARCHS)})")
    hf_cfg = ARCHS[arch]
  return dataclasses.replace(
      hf.config_from_hf(hf_cfg, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype),
      scan_layers=cfg.model.get("scan_layers", False), remat=cfg.model.get("remat", "none"))


def abstract_policy(cfg, tcfg):
  """(graphdef, params of ``jax.ShapeDtypeStruct``) of the policy a run of ``cfg`` trains,
  allocating nothing: ``hf.abstract_model(tcfg)`` (every parameter in ``model.param_dtype``)
  and, with ``model.lora.rank`` r > 0, the LoRA adapters ``train.build`` adds on top
  (``models.lora.add_adapters``: A [.., in, r] and B [.., r, out], float32 ``nnx.LoRAParam``
  whatever the base's dtype). The train state built from it (``init_train_state``) then
  holds optimizer state for the adapters only, and the learner step differentiates only them.

  Raises:
    jaxreplay.config.ConfigError: an invalid ``model.lora`` section.
  """
  from jaxreplay.models import hf
  from jaxreplay.models import lora as lora_lib
  from jaxreplay.models.spec import LoraSpec
  graphdef, params = hf.abstract_model(tcfg)
  spec = LoraSpec.from_config(cfg.model.get("lora"))
  if not spec.enabled:
    return graphdef, params
  return lora_lib.abstract_adapters(graphdef, params, spec)


def _bytes(ma) -> dict:
  out = dict(args=ma.argument_size_in_bytes, out=ma.output_size_in_bytes,
             alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes)
  out["total"] = out["args"] + out["out"] - out["alias"] + out["temp"]
  return out


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
  import jax
  import numpy as np
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * x.dtype.itemsize
  return total


def _placed(tree, shardings):
  """Abstract arrays of ``tree`` carrying ``shardings``."""
  import jax
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _f32_weight_copies(hlo_text: str, params) -> int:
  """Bytes of float32 ``convert`` and ``all-gather`` results shaped like a whole
  (per-device) bfloat16 array of ``params`` in a compiled program: the copies XLA:CPU makes
  to run bfloat16 dots and collectives in float32, which a GPU or TPU (native bfloat16 dots,
  bfloat16 all-gathers) does not. Capped at the float32 size of ``params``.
  """
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np
  shapes = {tuple(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(params)
            if x.dtype == jnp.bfloat16}
  total = 0
  for m in re.finditer(r"= f32\[([\d,]*)\]\S* (?:convert|all-gather(?:-start)?)\(", hlo_text):
    dims = tuple(int(d) for d in m.group(1).split(",") if d)
    if dims in shapes:
      total += 4 * int(np.prod(dims))
  return min(total, 2 * _per_device_bytes(params))


def _engine_peak(cfg, graphdef, params, mesh, slots, requests, temperature, top_p,
                 count_f32_copies: bool = False) -> dict:
  """The decode engine's largest program (prefill-and-insert, a full-width decode chunk or a
  weight-swap re-prefill) with ``slots`` rounded up to a multiple of the mesh's batch devices, as the engine does
  (``engine.lower_programs``); with ``count_f32_copies`` its ``cpu_f32_weights`` too
  (``_f32_weight_copies``)."""
  from jaxreplay.sampling import engine
  slots = max(1, slots)
  progs = engine.lower_programs(
      graphdef, params, slots=slots, prompt_width=cfg.task.prompt_width,
      max_new_tokens=cfg.sampler.max_new_tokens, requests=requests, temperature=temperature,
      top_k=int(cfg.sampler.top_k), top_p=top_p,
      chunk_steps=cfg.sampler.get("chunk_steps", 16), mesh=mesh)
  name, out = max(((n, _bytes(c.memory_analysis())) for n, c in progs.items()),
                  key=lambda nb: nb[1]["total"])
  if count_f32_copies:
    out["cpu_f32_weights"] = min(out["temp"], _f32_weight_copies(progs[name].as_text(), params))
  return out


def _sync_programs(cfg, params, shardings, replicated, resident: int) -> dict:
  """The actor–learner split's weight sync on the learner mesh
  (``parallel.submesh.make_weight_sync``): streamed block by block, each block (a leaf, or
  one layer of a scan-layout leaf) cast to the inference dtype and gathered to a replica on
  every learner device, then copied to the generator devices before the next block. Its
  peak is the largest block's program (``submesh.publish_programs``).

  Without LoRA every publish moves the whole policy: ``weight sync``. With LoRA two moves:
  ``weight sync`` gathers the adapters alone (every publish) and ``first sync`` the frozen
  base (the first publish only; the generator keeps that copy).

  Returns:
    dict: name -> (per-device bytes of the largest block's compiled gather, with
    ``cpu_f32_weights``; ``resident``).
  """
  import jax
  import jax.numpy as jnp

  from jaxreplay.models import lora as lora_lib
  from jaxreplay.parallel import submesh
  dtype = jnp.dtype(cfg.model.dtype)
  adapters, frozen = lora_lib.split_adapters(params)
  moves = {"weight sync": (adapters, lora_lib.split_adapters(shardings)[0])}
  if frozen is not None:
    moves["first sync"] = (frozen, lora_lib.split_adapters(shardings)[1])
  out = {}
  for name, (tree, sh) in moves.items():
    best = None
    for program, args in submesh.publish_programs(tree, sh, dtype).values():
      compiled = program.lower(*args).compile()
      b = _bytes(compiled.memory_analysis())
      if best is None or b["total"] > best[0]["total"]:
        best = (b, compiled, args)
    b, compiled, args = best
    x = args[0]
    block = jax.ShapeDtypeStruct(x.shape[1:] if len(args) > 1 else x.shape,
                                 dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
                                 sharding=replicated)
    b["cpu_f32_weights"] = min(b["temp"], _f32_weight_copies(compiled.as_text(), [block]))
    out[name] = (b, resident)
  return out


def _mesh_plan(cfg, mesh, graphdef, params, sampler: bool) -> dict:
  """The learner-side programs of ``cfg`` on ``mesh`` (and the sampler when ``sampler``;
  with the actor–learner split the weight sync's gather instead).

  Returns:
    dict: one entry per program (per-device bytes: args, out, alias, temp, total),
    ``programs`` (name -> total + the resident bytes not among its arguments),
    ``state_bytes``, ``buffer_bytes``, ``params_bytes``, ``sampler_resident``, ``peak``,
    ``compile_s`` (learner, sampler or weight sync, scoring and evaluation seconds).
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxreplay import replay
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
  from jaxreplay.rollout import empty_rollout
  from jaxreplay.rl.scoring import micro_batch_rows
  from jaxreplay.train.drift import make_drift_fn
  from jaxreplay.train.evaluate import _entropy_sum
  from jaxreplay.train.generation import learner_behaviour_logprobs
  from jaxreplay.train.learner import make_learner_step

  placed = _placed
  m, p_width = cfg.sampler.max_new_tokens, cfg.task.prompt_width
  optimizer = make_optimizer(cfg.algo, cfg.train.steps)
  state = jax.eval_shape(lambda p: init_train_state(graphdef, p, optimizer, cfg.algo), params)
  state_sh = sharding_lib.param_shardings(state, mesh)
  state = placed(state, state_sh)
  sampler_cfg = replay.from_config(cfg.buffer)
  buffer = jax.eval_shape(lambda: replay.init(empty_rollout(1, p_width + m),
                                              cfg.buffer.capacity, evicts=sampler_cfg.evicts))
  buffer_sh = replay.state_sharding(buffer, mesh, "data")
  buffer = placed(buffer, buffer_sh)
  replicated = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                             sharding=replicated)

  train_step = make_train_step(graphdef, optimizer, cfg.algo, cfg.sampler.temperature,
                               cfg.sampler.top_k, cfg.sampler.top_p)
  rb = replay.make_replay_buffer(cfg.buffer.capacity, cfg.train.batch_size, sampler_cfg)
  learner_step = make_learner_step(train_step, rb, epochs=cfg.algo.update_epochs,
                                   mesh=mesh, state_sharding=state_sh, buffer_sharding=buffer_sh)
  # XLA:CPU's float32 copies of bfloat16 weights (a frozen bf16 LoRA base), counted in each
  # program so the report can show the peak without them
  bf16 = any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))

  def measured(compiled) -> dict:
    out = _bytes(compiled.memory_analysis())
    if bf16:
      out["cpu_f32_weights"] = min(out["temp"],
                                   _f32_weight_copies(compiled.as_text(), state.params))
    return out

  t0 = time.time()
  learner = learner_step.lower(state, buffer, key).compile()
  t_learner = time.time() - t0

  r = cfg.rollout.per_step
  state_bytes, buffer_bytes = _per_device_bytes(state), _per_device_bytes(buffer)
  params_bytes = _per_device_bytes(state.params)
  resident_not_in_sampler = state_bytes - params_bytes + buffer_bytes
  programs = {"learner": (measured(learner), 0)}
  t0 = time.time()
  if sampler:
    programs["sampler"] = (_engine_peak(
        cfg, graphdef, state.params, mesh, min(cfg.sampler.get("slots", 0) or r, r), r,
        float(cfg.sampler.temperature), float(cfg.sampler.top_p), count_f32_copies=bf16),
        resident_not_in_sampler)
  else:
    programs.update(_sync_programs(cfg, state.params, state_sh.params, replicated,
                                   resident_not_in_sampler))
  t_sampler = time.time() - t0

  # The passes that score rollouts without gradients, in the learner's micro-batch rows
  # and log-prob chunks; each runs while the rest of the train state and buffer stay.
  t0 = time.time()
  rows, chunk = micro_batch_rows(cfg.train.batch_size, cfg.algo), cfg.algo.logprob_chunk
  temp, top_k = float(cfg.sampler.temperature), int(cfg.sampler.top_k)
  top_p = float(cfg.sampler.top_p)
  if cfg.rollout.behaviour_logprobs == "learner":
    roll = jax.eval_shape(lambda: empty_rollout(r, p_width + m))
    roll = placed(roll, jax.tree.map(
        lambda x: sharding_lib.batch_sharding(mesh, x.ndim, r), roll))
    rescore = learner_behaviour_logprobs.lower(
        graphdef, state.params, roll, temperature=temp, top_k=top_k, top_p=top_p,
        chunk=chunk, rows=rows).compile()
    programs["rescoring"] = (measured(rescore), resident_not_in_sampler)
  if cfg.drift.every:
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    drift = make_drift_fn(graphdef, temp, cfg.drift.num_samples,
                          tuple(cfg.algo.staleness_buckets), top_k, top_p, chunk, rows)
    drift = drift.lower(state.params, buffer, key, version).compile()
    programs["drift"] = (measured(drift), state_bytes - params_bytes)
  # Held-out evaluation: the sampled pass's engine with eval.batch_rows slots, then the
  # fresh-sample entropy of as many rows.
  e = min(cfg.eval.batch_rows, cfg.eval.num_examples * cfg.eval.samples_per_example)
  if cfg.eval.every and e:
    eval_temp = float(cfg.eval.get("temperature") or cfg.sampler.temperature)
    eval_top_p = float(cfg.eval.get("top_p") or cfg.sampler.top_p)
    e_sh = sharding_lib.batch_sharding(mesh, 2, e)
    e_prompts = jax.ShapeDtypeStruct((e, p_width), jnp.int32, sharding=e_sh)
    e_mask = jax.ShapeDtypeStruct((e, p_width), jnp.bool_, sharding=e_sh)
    e_gen = _engine_peak(cfg, graphdef, state.params, mesh, e,
                         cfg.eval.num_examples * cfg.eval.samples_per_example, eval_temp,
                         eval_top_p, count_f32_copies=bf16)
    programs["eval sampler"] = (e_gen, resident_not_in_sampler)
    e_tok = jax.ShapeDtypeStruct((e, m), jnp.int32, sharding=e_sh)
    e_out = jax.ShapeDtypeStruct((e, m), jnp.bool_, sharding=e_sh)
    e_ent = _entropy_sum.lower(graphdef, state.params, e_prompts, e_mask, e_tok, e_out,
                               temperature=eval_temp, top_k=top_k, top_p=eval_top_p,
                               logprob_chunk=chunk, rows=rows).compile()
    programs["eval entropy"] = (measured(e_ent), resident_not_in_sampler)
  t_scoring = time.time() - t0

  return dict(**{name: b for name, (b, _) in programs.items()},
              programs={name: b["total"] + res for name, (b, res) in programs.items()},
              state_bytes=state_bytes, buffer_bytes=buffer_bytes,
              params_bytes=params_bytes, sampler_resident=resident_not_in_sampler,
              peak=max(b["total"] + res for b, res in programs.values()),
              compile_s=(t_learner, t_sampler, t_scoring))


def _generator_plan(cfg, mesh, graphdef, params) -> dict:
  """The actor–learner split's generator mesh: the decode engine on the inference copy
  (``model.dtype``, laid out by ``sharding.param_shardings`` on the generator mesh: replicated
  over data, split over tensor), while the next published copy arrives beside it.

  Returns:
    dict: ``sampler`` (per-device bytes), ``programs``, ``params_bytes`` (the inference
    copy per device), ``sampler_resident``, ``peak``, ``compile_s``.
  """
  import jax
  import jax.numpy as jnp

  from jaxreplay.models import lora as lora_lib
  from jaxreplay.parallel import sharding as sharding_lib

  dtype = jnp.dtype(cfg.model.dtype)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), params)
  copy_ = _placed(abstract, sharding_lib.param_shardings(abstract, mesh))
  r = cfg.rollout.per_step
  t0 = time.time()
  sampler = _engine_peak(cfg, graphdef, copy_, mesh, min(cfg.sampler.get("slots", 0) or r, r),
                         r, float(cfg.sampler.temperature), float(cfg.sampler.top_p),
                         count_f32_copies=True)
  params_bytes = _per_device_bytes(copy_)
  # One more copy: the learner publishes the next version while this one decodes; the
  # generator swaps to it between decode chunks and then drops the old one. With LoRA the
  # published versions share the one frozen base, so the next version is its adapters.
  published = _per_device_bytes(lora_lib.split_adapters(copy_)[0])
  return dict(sampler=sampler, programs={"sampler": sampler["total"] + published},
              params_bytes=params_bytes, sampler_resident=published,
              peak=sampler["total"] + published, compile_s=(time.time() - t0,))


def _peak_without_cpu_copies(part: dict) -> int:
  """A plan's peak less XLA:CPU's float32 copies of bfloat16 weights in each program
  (``cpu_f32_weights``; information only: the verdict keeps them)."""
  return max(total - part[name].get("cpu_f32_weights", 0)
             for name, total in part["programs"].items())


def plan(cfg, devices: int, chip: str, mesh_shape=None, config_path: str = "",
         arch: str = "", processes: int = 1) -> dict:
  """Compiles the learner step, the sampler and the scoring passes of ``cfg`` on N devices.

  Runs in the calling process: jax must already see ≥ ``devices`` devices (the CLI sets
  ``XLA_FLAGS`` before importing jax; the tests' conftest sets 8).

  With the actor–learner split (``mesh.generator_devices`` W > 0; one process: the last W
  of the N devices generate) the learner-side programs are planned on the learner mesh
  (the config's data/fsdp/tensor over T = N − W devices), the weight sync's gather among
  them instead of the sampler, and the sampler on the generator mesh
  (W / generator_tensor, 1, generator_tensor) with the inference copy in ``model.dtype``.

  Args:
    cfg: the config tree. devices: N. chip: a ``CHIPS`` key.
    mesh_shape: (data, fsdp, tensor), default the config's mesh on N devices (with the
      split: the learner mesh on T devices).
    config_path, arch: to pick an hf architecture (``model_config``).

  Returns:
    dict: ``learner``, ``sampler`` and, when the config runs them, ``rescoring``,
    ``drift``, ``eval sampler``, ``eval entropy`` (per-device bytes: args, out, alias, temp,
    total), ``programs`` (name -> total + the resident bytes not among its arguments),
    ``state_bytes`` / ``buffer_bytes`` (per device), ``peak``, ``hbm``,
    ``pool_fraction`` (``memory_pool``), ``fits`` (peak ≤ 0.8 × pool), ``mesh``,
    ``n_params`` (the base model's), ``n_adapter_params`` (LoRA's A and B, 0 without),
    ``compile_s``, ``model`` (the TransformerConfig).
    With the split instead: ``split`` True, ``submeshes`` {"learner": the learner mesh's
    dict as above with ``weight sync`` (and with LoRA ``first sync``, ``_sync_programs``) in
    place of ``sampler``, "generator": ``sampler``,
    ``programs``, ``params_bytes`` (the inference copy), ``peak``}, each with ``mesh``,
    ``devices`` and ``fits``; ``fits`` (both), ``peak`` (the larger), ``hbm``,
    ``pool_fraction``, ``mesh``
    (the learner's), ``generator_mesh``, ``n_params``, ``model``.

  Raises:
    jaxreplay.config.ConfigError: an invalid config (the checkpoint directory of an hf
      config is not required). ValueError: unknown chip or architecture, too few devices.
  """
  import jax
  import numpy as np

  from jaxreplay import config as config_lib
  from jaxreplay.models import lora as lora_lib
  from jaxreplay.parallel import sharding as sharding_lib

  if chip not in CHIPS:
    raise ValueError(f"chip={chip!r} is not one of {sorted(CHIPS)}")
  if jax.device_count() < devices:
    raise ValueError(f"{devices} devices asked, jax sees {jax.device_count()}")
  if cfg.model.source == "hf" and not os.path.exists(os.path.join(cfg.model.path or "",
                                                                   "config.json")):
    # a plan needs no checkpoint: validate everything else against a stand-in directory
    with tempfile.TemporaryDirectory() as stand_in:
      for name in ("config.json", "tokenizer.json"):
        open(os.path.join(stand_in, name), "w").close()
      checked = copy.deepcopy(cfg)
      checked.model.path = stand_in
      config_lib.validate(checked, device_count=devices, process_count=processes)
  else:
    config_lib.validate(cfg, device_count=devices, process_count=processes)
  tcfg = model_config(cfg, config_path, arch)
  graphdef, params = abstract_policy(cfg, tcfg)
  adapters, frozen = lora_lib.split_adapters(params)
  base = params if frozen is None else frozen
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(base))
  n_adapter_params = (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
                      if frozen is not None else 0)
  hbm = CHIPS[chip]
  fraction, pool = memory_pool(cfg, chip)
  limit = (1 - HEADROOM) * pool
  w = int(cfg.mesh.get("generator_devices", 0) or 0) * processes  # generator devices in all
  if not w:
    mesh_shape = tuple(mesh_shape or config_lib.mesh_shape(cfg, devices))
    mesh = sharding_lib.make_mesh(*mesh_shape,
                                  devices=jax.devices()[:int(np.prod(mesh_shape))])
    part = _mesh_plan(cfg, mesh, graphdef, params, sampler=True)
    part["peak_without_cpu_copies"] = _peak_without_cpu_copies(part)
    return dict(**part, hbm=hbm, pool_fraction=fraction, fits=part["peak"] <= limit,
                mesh=mesh_shape,
                n_params=n_params, n_adapter_params=n_adapter_params, model=tcfg)

  # The actor–learner split: the learner mesh on the first T devices, the generator's on
  # the last W (``parallel.submesh.make_meshes`` takes W per process; per-device bytes do
  # not depend on which devices).
  t = devices - w
  mesh_shape = tuple(mesh_shape or config_lib.mesh_shape(cfg, t))
  if int(np.prod(mesh_shape)) > t:
    raise ValueError(f"learner mesh {mesh_shape} needs more than the T={t} learner devices")
  gt = int(cfg.mesh.generator_tensor)
  gen_shape = (w // gt, 1, gt)
  learner_mesh = sharding_lib.make_mesh(*mesh_shape,
                                        devices=jax.devices()[:int(np.prod(mesh_shape))])
  gen_mesh = sharding_lib.make_mesh(*gen_shape, devices=jax.devices()[t:devices])
  learner = _mesh_plan(cfg, learner_mesh, graphdef, params, sampler=False)
  generator = _generator_plan(cfg, gen_mesh, graphdef, params)
  for part, shape, n in ((learner, mesh_shape, t), (generator, gen_shape, w)):
    part.update(mesh=shape, devices=n, fits=part["peak"] <= limit,
                peak_without_cpu_copies=_peak_without_cpu_copies(part))
  return dict(split=True, submeshes={"learner": learner, "generator": generator},
              processes=processes,
              fits=learner["fits"] and generator["fits"],
              peak=max(learner["peak"], generator["peak"]), hbm=hbm,
              pool_fraction=fraction, mesh=mesh_shape,
              generator_mesh=gen_shape, n_params=n_params,
              n_adapter_params=n_adapter_params, model=tcfg,
              compile_s=learner["compile_s"] + generator["compile_s"])


def _program_rows(part: dict) -> list[str]:
  gb = lambda b: f"{b / 1e9:8.2f}"  # noqa: E731
  lines = ["per device, GB        args      out  aliased     temp    total   +resident"]
  for name, with_resident in part["programs"].items():
    r = part[name]
    lines.append(f"  {name:<12} {gb(r['args'])} {gb(r['out'])} {gb(r['alias'])} "
                 f"{gb(r['temp'])} {gb(r['total'])}   {gb(with_resident)}")
  return lines


def _peak_line(prefix: str, peak: float, hbm: float, fits: bool, fraction: float) -> str:
  pool = fraction * hbm
  where = (f"JAX's pool {fraction:g} x {hbm / 1e9:.0f} = {pool / 1e9:.1f} GB" if fraction < 1
           else f"{hbm / 1e9:.0f} GB")
  return (f"{prefix}: {peak / 1e9:.2f} GB of {hbm / 1e9:.0f} GB ({100 * peak / hbm:.0f}%); "
          f"fits {where} with {HEADROOM:.0%} headroom (<= {(1 - HEADROOM) * pool / 1e9:.1f} "
          f"GB): {'yes' if fits else 'NO'}")


def report(result: dict, cfg, config_path: str, devices: int, chip: str) -> str:
  """The plan as text (what the CLI prints; the presets' docstrings quote it)."""
  gb = lambda b: f"{b / 1e9:8.2f}"  # noqa: E731
  t = result["model"]
  d, f, tn = result["mesh"]
  split = result.get("split", False)
  if split:
    lp, gp = result["submeshes"]["learner"], result["submeshes"]["generator"]
    n_proc = result["processes"]
    per = (f" ({gp['devices'] // n_proc}/{lp['devices'] // n_proc} per process)"
           if n_proc > 1 else "")
    head = (f"actor–learner split W/T = {gp['devices']}/{lp['devices']}{per}: learner mesh "
            f"data={d} fsdp={f} tensor={tn}, generator mesh data={result['generator_mesh'][0]} "
            f"tensor={result['generator_mesh'][2]}")
  else:
    head = f"mesh data={d} fsdp={f} tensor={tn}"
  lines = [
      f"memory plan: {config_path} on {devices} x {chip} ({result['hbm'] / 1e9:.0f} GB HBM), "
      + head,
      f"model: {result['n_params'] / 1e9:.3f}B params ({t.param_dtype} params, {t.dtype} "
      f"compute), {t.n_layers} layers, scan_layers={t.scan_layers}, remat={t.remat}"
      + (f"; LoRA rank {cfg.model.lora.rank}: {result['n_adapter_params'] / 1e6:.2f}M float32 "
         f"adapter params, the only ones trained" if result["n_adapter_params"] else ""),
      f"learner: B={cfg.train.batch_size} rows x "
      f"T={cfg.task.prompt_width + cfg.sampler.max_new_tokens}, "
      f"num_minibatches={cfg.algo.num_minibatches}, grad_accum_steps="
      f"{cfg.algo.get('grad_accum_steps', 1)}, logprob_chunk={cfg.algo.get('logprob_chunk', 0)}; "
      f"sampler: {cfg.rollout.per_step} rollouts",
  ]
  if not split:
    lines += _program_rows(result)
    lines += [
        f"  train state {gb(result['state_bytes']).strip()} GB (parameters "
        f"{gb(result['params_bytes']).strip()}), buffer {gb(result['buffer_bytes']).strip()} GB",
        f"  +resident: total + the state and buffer not among the program's arguments "
        f"(sampler: {gb(result['sampler_resident']).strip()} GB)",
        _peak_line("peak per device", result["peak"], result["hbm"], result["fits"],
                   result["pool_fraction"]),
    ]
    if result["peak_without_cpu_copies"] < result["peak"]:
      lines.append(
          f"without XLA:CPU's float32 copies of the bf16 weights for its dots (a GPU/TPU runs "
          f"bf16 dots natively; information only): {result['peak_without_cpu_copies'] / 1e9:.2f}"
          f" GB")
    lines += [
        f"compile on CPU: learner {result['compile_s'][0]:.0f}s, sampler "
        f"{result['compile_s'][1]:.0f}s, scoring and evaluation {result['compile_s'][2]:.0f}s",
    ]
    return "\n".join(lines)
  # with LoRA the whole (frozen) replica is gathered once, by the first publish
  sync = "first sync" if "first sync" in lp["programs"] else "weight sync"
  lines.append(f"learner mesh ({lp['devices']} devices):")
  lines += _program_rows(lp)
  lines += [
      f"  train state {gb(lp['state_bytes']).strip()} GB (parameters "
      f"{gb(lp['params_bytes']).strip()}), buffer {gb(lp['buffer_bytes']).strip()} GB",
      f"  +resident: total + the state and buffer not among the program's arguments "
      f"(weight sync: {gb(lp['sampler_resident']).strip()} GB)",
      f"  of the {sync}'s temp, {gb(lp[sync]['cpu_f32_weights']).strip()} GB are "
      f"XLA:CPU's float32 all-gather of the largest bf16 block (a GPU/TPU gathers bf16)",
      _peak_line("  learner mesh peak per device", lp["peak"], result["hbm"], lp["fits"],
                 result["pool_fraction"]),
      f"generator mesh ({gp['devices']} devices; inference copy in {cfg.model.dtype}, "
      f"{gb(gp['params_bytes']).strip()} GB per device):",
  ]
  lines += _program_rows(gp)
  lines += [
      f"  +resident: total + the next published "
      f"{'adapters' if result['n_adapter_params'] else 'copy'} "
      f"({gb(gp['sampler_resident']).strip()} GB), "
      f"which arrives while this one decodes",
      f"  of the sampler's temp, {gb(gp['sampler']['cpu_f32_weights']).strip()} GB are XLA:CPU's "
      f"float32 copies of the bf16 weights for its dots (a GPU/TPU runs bf16 dots natively)",
      _peak_line("  generator mesh peak per device", gp["peak"], result["hbm"], gp["fits"],
                 result["pool_fraction"]),
      f"without XLA:CPU's float32 weight copies (information only): learner mesh "
      f"{lp['peak_without_cpu_copies'] / 1e9:.2f} GB, generator mesh "
      f"{gp['peak_without_cpu_copies'] / 1e9:.2f} GB",
      f"both sub-meshes fit: {'yes' if result['fits'] else 'NO'}",
      f"compile on CPU: learner {lp['compile_s'][0]:.0f}s, weight sync "
      f"{lp['compile_s'][1]:.0f}s, scoring and evaluation {lp['compile_s'][2]:.0f}s, sampler "
      f"{gp['compile_s'][0]:.0f}s",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={args.devices}"
                             ).strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxreplay.config import apply_overrides, load_config
  cfg = load_config(args.config)
  apply_overrides(cfg, args.set)
  mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
  result = plan(cfg, args.devices, args.chip, mesh, args.config, args.arch, args.processes)
  print(report(result, cfg, args.config, args.devices, args.chip))
  return 0 if result["fits"] else 1


if __name__ == "__main__":
  sys.exit(main())
