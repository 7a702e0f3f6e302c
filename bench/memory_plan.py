"""Per-device memory of a config's learner step and sampler on a mesh, from XLA itself.

``python bench/memory_plan.py --config CONFIG --devices N --chip NAME [--mesh D,F,T]
[--arch NAME] [--set algo.grad_accum_steps=8 ...]``

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
headroom (peak ≤ 0.8 × HBM); exit status 0 if it fits, 1 if not.

Peak per device = the largest, over the programs, of arguments + outputs − aliased +
temporaries + the train state and buffer it does not take as arguments (optimizer state,
reference, buffer), which stay in HBM while it runs (the ``+resident`` column).

What it does not see: the allocator's fragmentation and the runtime's own reservations
(the 20% headroom is for those) and GPU/TPU-specific fusion: XLA:CPU schedules and fuses
differently (it may, e.g., keep bfloat16 matmul operands in float32), so the numbers
estimate the accelerator's; they have not been checked on one.

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
CHIPS = {"h100": 80e9, "h200": 141e9, "a100": 80e9, "a100-40": 40e9, "v5p": 95e9,
         "v5e": 16e9, "v4": 32e9, "v6e": 32e9}
HEADROOM = 0.2

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
  p.add_argument("--mesh", default="", help="data,fsdp,tensor (default: the config's mesh)")
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


def plan(cfg, devices: int, chip: str, mesh_shape=None, config_path: str = "",
         arch: str = "") -> dict:
  """Compiles the learner step, the sampler and the scoring passes of ``cfg`` on ``devices`` devices.

  Runs in the calling process: jax must already see ≥ ``devices`` devices (the CLI sets
  ``XLA_FLAGS`` before importing jax; the tests' conftest sets 8).

  Args:
    cfg: the config tree. devices: N. chip: a ``CHIPS`` key.
    mesh_shape: (data, fsdp, tensor), default the config's mesh on N devices.
    config_path, arch: to pick an hf architecture (``model_config``).

  Returns:
    dict: ``learner``, ``sampler`` and, when the config runs them, ``rescoring``,
    ``drift``, ``eval sampler``, ``eval entropy`` (per-device bytes: args, out, alias, temp,
    total), ``programs`` (name -> total + the resident bytes not among its arguments),
    ``state_bytes`` / ``buffer_bytes`` (per device), ``peak``, ``hbm``, ``fits``,
    ``mesh``, ``n_params``, ``compile_s``, ``model`` (the TransformerConfig).

  Raises:
    jaxreplay.config.ConfigError: an invalid config (the checkpoint directory of an hf
      config is not required). ValueError: unknown chip or architecture, too few devices.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxreplay import config as config_lib
  from jaxreplay import replay
  from jaxreplay.models import hf
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
  from jaxreplay.rollout import empty_rollout
  from jaxreplay.rl.scoring import micro_batch_rows
  from jaxreplay.sampling import engine
  from jaxreplay.train.drift import make_drift_fn
  from jaxreplay.train.evaluate import _entropy_sum
  from jaxreplay.train.generation import learner_behaviour_logprobs
  from jaxreplay.train.learner import make_learner_step

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
      config_lib.validate(checked, device_count=devices)
  else:
    config_lib.validate(cfg, device_count=devices)
  mesh_shape = tuple(mesh_shape or config_lib.mesh_shape(cfg, devices))
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  tcfg = model_config(cfg, config_path, arch)
  graphdef, params = hf.abstract_model(tcfg)

  def placed(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)

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
  learner_step = make_learner_step(train_step, rb,
                                   prompt_len=p_width, epochs=cfg.algo.update_epochs,
                                   mesh=mesh, state_sharding=state_sh, buffer_sharding=buffer_sh)
  t0 = time.time()
  learner = learner_step.lower(state, buffer, key).compile()
  t_learner = time.time() - t0

  r = cfg.rollout.per_step
  t0 = time.time()

  def engine_peak(slots, requests, temperature, top_p):
    """The decode engine's larger program (prefill-and-insert or a full-width decode chunk)."""
    progs = engine.lower_programs(
        graphdef, state.params, slots=slots, prompt_width=p_width, max_new_tokens=m,
        requests=requests, temperature=temperature, top_k=int(cfg.sampler.top_k), top_p=top_p,
        chunk_steps=cfg.sampler.get("chunk_steps", 16), mesh=mesh)
    return max((_bytes(c.memory_analysis()) for c in progs.values()), key=lambda b: b["total"])

  sampler = engine_peak(min(cfg.sampler.get("slots", 0) or r, r), r,
                        float(cfg.sampler.temperature), float(cfg.sampler.top_p))
  t_sampler = time.time() - t0

  state_bytes, buffer_bytes = _per_device_bytes(state), _per_device_bytes(buffer)
  params_bytes = _per_device_bytes(state.params)
  resident_not_in_sampler = state_bytes - params_bytes + buffer_bytes
  programs = {"learner": (_bytes(learner.memory_analysis()), 0),
              "sampler": (sampler, resident_not_in_sampler)}

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
    programs["rescoring"] = (_bytes(rescore.memory_analysis()), resident_not_in_sampler)
  if cfg.drift.every:
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    drift = make_drift_fn(graphdef, temp, cfg.drift.num_samples,
                          tuple(cfg.algo.staleness_buckets), top_k, top_p, chunk, rows)
    drift = drift.lower(state.params, buffer, key, version).compile()
    programs["drift"] = (_bytes(drift.memory_analysis()), state_bytes - params_bytes)
  # Held-out evaluation: the sampled pass's engine with eval.batch_rows slots, then the
  # fresh-sample entropy of as many rows.
  e = min(cfg.eval.batch_rows, cfg.eval.num_examples * cfg.eval.samples_per_example)
  if cfg.eval.every and e:
    eval_temp = float(cfg.eval.get("temperature") or cfg.sampler.temperature)
    eval_top_p = float(cfg.eval.get("top_p") or cfg.sampler.top_p)
    e_sh = sharding_lib.batch_sharding(mesh, 2, e)
    e_prompts = jax.ShapeDtypeStruct((e, p_width), jnp.int32, sharding=e_sh)
    e_mask = jax.ShapeDtypeStruct((e, p_width), jnp.bool_, sharding=e_sh)
    e_gen = engine_peak(e, cfg.eval.num_examples * cfg.eval.samples_per_example, eval_temp,
                        eval_top_p)
    programs["eval sampler"] = (e_gen, resident_not_in_sampler)
    e_tok = jax.ShapeDtypeStruct((e, m), jnp.int32, sharding=e_sh)
    e_out = jax.ShapeDtypeStruct((e, m), jnp.bool_, sharding=e_sh)
    e_ent = _entropy_sum.lower(graphdef, state.params, e_prompts, e_mask, e_tok, e_out,
                               temperature=eval_temp, top_k=top_k, top_p=eval_top_p,
                               logprob_chunk=chunk, rows=rows).compile()
    programs["eval entropy"] = (_bytes(e_ent.memory_analysis()), resident_not_in_sampler)
  t_scoring = time.time() - t0

  peak = max(b["total"] + resident for b, resident in programs.values())
  hbm = CHIPS[chip]
  return dict(**{name: b for name, (b, _) in programs.items()},
              programs={name: b["total"] + res for name, (b, res) in programs.items()},
              state_bytes=state_bytes, buffer_bytes=buffer_bytes,
              params_bytes=params_bytes, sampler_resident=resident_not_in_sampler,
              peak=peak, hbm=hbm, fits=peak <= (1 - HEADROOM) * hbm, mesh=mesh_shape,
              n_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
              compile_s=(t_learner, t_sampler, t_scoring), model=tcfg)


def report(result: dict, cfg, config_path: str, devices: int, chip: str) -> str:
  """The plan as text (what the CLI prints; the presets' docstrings quote it)."""
  gb = lambda b: f"{b / 1e9:8.2f}"
  t = result["model"]
  d, f, tn = result["mesh"]
  lines = [
      f"memory plan: {config_path} on {devices} x {chip} ({result['hbm'] / 1e9:.0f} GB HBM), "
      f"mesh data={d} fsdp={f} tensor={tn}",
      f"model: {result['n_params'] / 1e9:.3f}B params ({t.param_dtype} params, {t.dtype} "
      f"compute), {t.n_layers} layers, scan_layers={t.scan_layers}, remat={t.remat}",
      f"learner: B={cfg.train.batch_size} rows x "
      f"T={cfg.task.prompt_width + cfg.sampler.max_new_tokens}, "
      f"num_minibatches={cfg.algo.num_minibatches}, grad_accum_steps="
      f"{cfg.algo.get('grad_accum_steps', 1)}, logprob_chunk={cfg.algo.get('logprob_chunk', 0)}; "
      f"sampler: {cfg.rollout.per_step} rollouts",
      "per device, GB        args      out  aliased     temp    total   +resident",
  ]
  for name, with_resident in result["programs"].items():
    r = result[name]
    lines.append(f"  {name:<12} {gb(r['args'])} {gb(r['out'])} {gb(r['alias'])} "
                 f"{gb(r['temp'])} {gb(r['total'])}   {gb(with_resident)}")
  lines += [
      f"  train state {gb(result['state_bytes']).strip()} GB (parameters "
      f"{gb(result['params_bytes']).strip()}), buffer {gb(result['buffer_bytes']).strip()} GB",
      f"  +resident: total + the state and buffer not among the program's arguments "
      f"(sampler: {gb(result['sampler_resident']).strip()} GB)",
      f"peak per device: {result['peak'] / 1e9:.2f} GB of {result['hbm'] / 1e9:.0f} GB "
      f"({100 * result['peak'] / result['hbm']:.0f}%); fits with {HEADROOM:.0%} headroom "
      f"(<= {(1 - HEADROOM) * result['hbm'] / 1e9:.1f} GB): {'yes' if result['fits'] else 'NO'}",
      f"compile on CPU: learner {result['compile_s'][0]:.0f}s, sampler "
      f"{result['compile_s'][1]:.0f}s, scoring and evaluation {result['compile_s'][2]:.0f}s",
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
  result = plan(cfg, args.devices, args.chip, mesh, args.config, args.arch)
  print(report(result, cfg, args.config, args.devices, args.chip))
  return 0 if result["fits"] else 1


if __name__ == "__main__":
  sys.exit(main())
