"""Invariants of the compiled programs at Qwen2.5-7B widths, read from their HLO.

``python bench/compiled_invariants.py [--config configs/qwen2_5_7b_h100x8.py] [--layers 2]
[--seed 0]``

Compiles (``jax.jit(...).lower(abstract shapes).compile()``; no weight is allocated, nothing
runs) the learner's packed update step of a 7B preset on 8 fake CPU devices
(``--xla_force_host_platform_device_count=8``), at the preset's mesh, batch, micro-batches
and log-prob chunks, Qwen2.5-7B widths with ``--layers`` layers, its packing plan drawn
from a lognormal batch (``lognormal_mask``). It reads the collectives of the compiled HLO
(``jaxreplay.parallel.hlo``: bytes × executions per step, bytes as XLA:CPU moves them,
bfloat16 as float32) and prints, as its last line::

  learner_activation_allreduce_ratio=F learner_collectives_vs_fsdp=F
  packed_padding_accum8=F generator_ops_on_learner_devices=N
  decode_collectives_per_token=N refresh_temp_gb_64x4k=F publish_extra_gb=F

(one line). Measured here:

* ``learner_activation_allreduce_ratio``: bytes of all-reduces of non-parameter shape
  (activations, norm statistics, partial logits) ÷ bytes of all-gathers of parameter
  shape, per step (``inf`` when nothing is all-gathered but activations are all-reduced).
  Goal ≤ 0.05.
* ``learner_collectives_vs_fsdp``: all collective bytes of the step ÷ the FSDP analytic
  ``fsdp_bytes``: per micro-batch every parameter gathered twice (forward, and again for
  the rematerialised backward) and its gradient reduce-scattered once, in the parameter
  dtype. Goal ≤ 1.5.
* ``packed_padding_accum8``: empty ÷ all slots of the packed rows of the learner's plan
  for the lognormal batch at 8 micro-batches (``train_step.plan_batch``, rows a multiple
  of the batch devices, narrower than T where that holds them in fewer slots:
  ``packing.pack_width``). Goal ≤ 0.15. Beside it, the same over 20 lognormal batches
  (seeds 0–19) and at width T alone.

* ``generator_ops_on_learner_devices``: implicit host-to-device transfers the generator
  thread of an actor–learner split made onto a learner device, in a short run
  (``generator_placement``: configs/small.py shrunk to a 1-layer d = 32 decoder, W = 4
  generator and T = 4 learner devices, 3 learner steps) read from JAX's transfer guard log
  (``jaxreplay.parallel.transfers``). Each is an eager op that ran on a learner device.
  JAX writes a destination only for the process's first transfer of each shape, dtype and
  destination; the repeats, logged bare, are printed beside it. Goal 0. ``--no-generator`` skips it (``na``).

* ``publish_extra_gb``: a publish's extra memory on a learner device of the actor–learner
  preset (``--publish-config``, default configs/qwen2_5_7b_h200x8_split.py: W/T = 6/2, all
  28 layers), in GB: the largest of the streamed publish's block programs
  (``parallel.submesh.publish_programs``: a block replicated in bfloat16 on every learner
  device), output plus temporaries less XLA:CPU's float32 copy of the gathered bf16 block
  (``memory_plan._f32_weight_copies``; a GPU or TPU gathers bf16). Goal ≤ 2.

* ``refresh_temp_gb_64x4k``: the temporaries of a weight swap's re-prefill
  (``sampling.engine._refresh``) of 64 slots × 4,096 positions on one device, Qwen2.5-7B
  widths and all 28 layers, bfloat16 weights, at the slot block the engine picks
  (``refresh_slot_block``), in GB: XLA:CPU's memory analysis less its float32 copies of the
  bf16 weights (``memory_plan._f32_weight_copies``). Goal ≤ 14.

* ``decode_collectives_per_token``: collectives one decoded token runs on the generator
  mesh of the actor–learner preset (``--publish-config``; W = 6 devices, its
  ``mesh.generator_tensor``), from the compiled decode chunk (``engine.lower_programs``,
  parameters placed as a publish places them, 66 slots, one step per chunk, the preset's
  prompt width and new-token limit) at 2 and 3 layers of 7B width, extrapolated to the
  preset's layers (the count is linear in layers: per-step plus per-layer collectives).
  With ``generator_tensor = 1`` every device runs its own engine replica
  (``engine.engine_replicas``). Goal 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIELDS = ("learner_activation_allreduce_ratio", "learner_collectives_vs_fsdp",
          "packed_padding_accum8", "generator_ops_on_learner_devices",
          "decode_collectives_per_token", "refresh_temp_gb_64x4k", "publish_extra_gb")


def lognormal_mask(batch: int, prompt_width: int, max_new: int, seed: int = 0):
  """A [B, P + M] bool attention mask of a ragged rollout batch (host numpy).

  Prompts left-padded with lognormal lengths (median 120, σ 0.4, in [8, P]); completions
  right-padded with lognormal lengths (median 300, σ 0.8, in [1, M]): the long tail
  of reasoning completions that packing is for.
  """
  import numpy as np
  rng = np.random.default_rng(seed)
  p = np.clip(rng.lognormal(np.log(120), 0.4, batch), 8, prompt_width).astype(int)
  c = np.clip(rng.lognormal(np.log(300), 0.8, batch), 1, max_new).astype(int)
  cols = np.arange(prompt_width + max_new)
  return ((cols >= prompt_width - p[:, None]) & (cols < prompt_width + c[:, None]))


def padding_summary(cfg, batch: int, multiple: int, plan) -> str:
  """One line: the learner plan's (S, R, W) and padding, and the padding over 20 lognormal
  batches (seeds 0–19) with the chosen widths and at width T alone (host numpy, < 1 s)."""
  import numpy as np

  from jaxreplay.rl import packing
  from jaxreplay.rl.spec import AlgoSpec
  spec = AlgoSpec.from_config(cfg.algo)
  n_mb, n_acc = spec.num_minibatches, spec.grad_accum_steps
  chosen, at_t = [], []
  for seed in range(20):
    mask = lognormal_mask(batch, cfg.task.prompt_width, cfg.sampler.max_new_tokens, seed)
    chosen.append(packing.padding_fraction(packing.plan_batch(mask, n_mb, n_acc, multiple)))
    at_t.append(packing.padding_fraction(packing.plan_batch(mask, n_mb, n_acc, multiple,
                                                            quantum=mask.shape[1])))
  s, r, w = plan.src.shape[1:]
  return (f"packing: {n_acc} micro-batches, rows a multiple of {multiple}: {s} steps x {r} "
          f"rows x {w} tokens, padding {packing.padding_fraction(plan):.3f}; 20 batches: "
          f"mean {np.mean(chosen):.3f} (max {np.max(chosen):.3f}), at width T alone "
          f"{np.mean(at_t):.3f} (max {np.max(at_t):.3f})")


def learner_ratios(hlo_text: str, params, fsdp_bytes: int) -> dict:
  """The two learner fields from a compiled update step's HLO.

  Args:
    hlo_text: the optimized HLO. params: the abstract parameters (shapes only).
    fsdp_bytes: the FSDP analytic bytes of one step (``fsdp_bytes``).

  Returns:
    ``hlo.learner_traffic``'s dict plus ``learner_activation_allreduce_ratio`` (``inf``
    when no parameter is gathered but activations are all-reduced) and
    ``learner_collectives_vs_fsdp``.
  """
  from jaxreplay.parallel import hlo
  r = hlo.learner_traffic(hlo_text, hlo.param_sizes(params))
  act, gathered = r["activation_allreduce"], r["param_allgather"]
  r["learner_activation_allreduce_ratio"] = (act / gathered if gathered
                                             else (float("inf") if act else 0.0))
  r["learner_collectives_vs_fsdp"] = r["total"] / fsdp_bytes
  return r


def fsdp_bytes(params, micro_batches: int, updates: int = 1) -> int:
  """The FSDP analytic of one learner step: (2 gathers + 1 reduce-scatter) × parameter
  bytes, per micro-batch and optimizer update."""
  import jax
  import numpy as np
  p = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
  return 3 * p * micro_batches * updates


def compile_learner_update(cfg, tcfg, mesh, mask):
  """The compiled packed update of ``cfg``'s learner on ``mesh`` for the batch ``mask``.

  Returns:
    (compiled executable, abstract params, the packing plan, compile seconds).
  """
  import jax
  import numpy as np

  from jaxreplay import replay
  from jaxreplay.models import hf
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.rl.train_step import init_train_state, make_optimizer, make_train_step
  from jaxreplay.rollout import empty_rollout
  from jaxreplay.train.learner import make_learner_step
  from memory_plan import _placed

  graphdef, params = hf.abstract_model(tcfg)
  optimizer = make_optimizer(cfg.algo, cfg.train.steps)
  state = jax.eval_shape(lambda p: init_train_state(graphdef, p, optimizer, cfg.algo), params)
  state_sh = sharding_lib.param_shardings(state, mesh)
  state = _placed(state, state_sh)
  b, t = mask.shape
  sample = jax.eval_shape(lambda: replay.SampleResult(
      items=empty_rollout(b, t), per_item=np.zeros((b, 4), np.int32),
      sampling=np.zeros((b, 2), np.float32)))
  sample = _placed(sample, jax.tree.map(
      lambda x: sharding_lib.batch_sharding(mesh, x.ndim, b), sample))
  train_step = make_train_step(graphdef, optimizer, cfg.algo, cfg.sampler.temperature,
                               cfg.sampler.top_k, cfg.sampler.top_p)
  rb = replay.make_replay_buffer(cfg.buffer.capacity, b, replay.from_config(cfg.buffer))
  step = make_learner_step(train_step, rb, mesh=mesh, state_sharding=state_sh)
  plan = train_step.plan_batch(mask, multiple=sharding_lib.batch_shards(mesh))
  placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        sharding_lib.place_rows(plan, mesh))
  t0 = time.time()
  compiled = step.lower_update(state, sample, placed).compile()
  return compiled, params, plan, time.time() - t0


def publish_extra(config_path: str) -> tuple[float, float, float, str]:
  """The streamed publish's extra memory on a learner device, from compiled programs.

  Args:
    config_path: an actor–learner preset (``mesh.generator_devices`` > 0) of 8 devices.

  Returns:
    (GB without XLA:CPU's float32 copies, GB with them, GB of a whole bfloat16 replica —
     what a publish gathered at once before streaming —, the largest block's path).
  """
  import jax
  import jax.numpy as jnp

  from jaxreplay import config as config_lib
  from jaxreplay.models import hf
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.parallel import submesh
  from memory_plan import _bytes, _f32_weight_copies, model_config

  cfg = config_lib.load_config(config_path)
  tcfg = model_config(cfg, config_path)
  _, params = hf.abstract_model(tcfg)
  w = int(cfg.mesh.generator_devices)
  learner_mesh, _ = submesh.make_meshes(config_lib.mesh_shape(cfg, jax.device_count() - w), w,
                                        int(cfg.mesh.get("generator_tensor", 1) or 1))
  dtype = jnp.dtype(cfg.model.dtype)
  shardings = sharding_lib.param_shardings(params, learner_mesh)
  worst = (0, 0, "")
  for path, (program, args) in submesh.publish_programs(params, shardings, dtype).items():
    compiled = program.lower(*args).compile()
    b = _bytes(compiled.memory_analysis())
    x = args[0]
    block = jax.ShapeDtypeStruct(x.shape[1:] if len(args) > 1 else x.shape, dtype,
                                 sharding=sharding_lib.NamedSharding(learner_mesh,
                                                                     sharding_lib.P()))
    f32 = min(b["temp"], _f32_weight_copies(compiled.as_text(), [block]))
    with_copies = b["out"] + b["temp"]
    if with_copies - f32 > worst[0]:
      worst = (with_copies - f32, with_copies, path)
  return (worst[0] / 1e9, worst[1] / 1e9, submesh.publish_bytes(params, dtype) / 1e9,
          worst[2])


def refresh_temp(config_path: str, slots: int = 64, width: int = 4096,
                 slot_block: int | None = None) -> tuple[float, float, int]:
  """Temporaries of the weight-swap re-prefill at 7B widths, from its compiled program.

  Args:
    config_path: a 7B preset (its architecture, all its layers; weights in ``model.dtype``).
    slots, width: the engine state's slots and the re-prefill width (= cache capacity).
    slot_block: slots re-prefilled together (None: ``engine.refresh_slot_block``'s pick; 0:
      all at once).

  Returns:
    (GB without XLA:CPU's float32 weight copies, GB with them, the slot block).
  """
  import dataclasses

  import jax
  import jax.numpy as jnp

  from jaxreplay import config as config_lib
  from jaxreplay.models import hf
  from jaxreplay.sampling import engine
  from memory_plan import _f32_weight_copies, model_config

  cfg = config_lib.load_config(config_path)
  dtype = jnp.dtype(cfg.model.dtype)
  tcfg = dataclasses.replace(model_config(cfg, config_path), param_dtype=dtype)
  graphdef, params = hf.abstract_model(tcfg)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), params)
  state = jax.eval_shape(lambda: engine.init_state(tcfg, slots, width, slots, 1, 0))
  block = engine.refresh_slot_block(tcfg, slots, width) if slot_block is None else slot_block
  compiled = engine._refresh.lower(graphdef, params, state, width=width, mesh=None,
                                   slot_block=block).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  f32 = min(temp, _f32_weight_copies(compiled.as_text(), params))
  return (temp - f32) / 1e9, temp / 1e9, block


def decode_collectives(config_path: str, slots: int = 66) -> tuple[int, int, int, int]:
  """Collectives per decoded token on an actor–learner preset's generator mesh.

  Args:
    config_path: an actor–learner preset (``mesh.generator_devices`` > 0) of 8 devices.
    slots: engine slots (a multiple of the generator mesh's data devices).

  Returns:
    (collectives per token at the preset's layers, per step outside the layers, per layer,
     the preset's layers), counted as executions in the compiled decode chunk of one step.
  """
  import dataclasses

  import jax
  import jax.numpy as jnp

  from jaxreplay import config as config_lib
  from jaxreplay.models import hf
  from jaxreplay.parallel import hlo
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.parallel import submesh
  from jaxreplay.sampling import engine
  from memory_plan import model_config

  cfg = config_lib.load_config(config_path)
  w = int(cfg.mesh.generator_devices)
  _, gen_mesh = submesh.make_meshes(config_lib.mesh_shape(cfg, jax.device_count() - w), w,
                                    int(cfg.mesh.get("generator_tensor", 1) or 1))
  full = model_config(cfg, config_path)
  counts = {}
  for layers in (2, 3):
    tcfg = dataclasses.replace(full, n_layers=layers, param_dtype=cfg.model.dtype)
    graphdef, params = hf.abstract_model(tcfg)
    shardings = sharding_lib.param_shardings(params, gen_mesh)
    placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          params, shardings)
    progs = engine.lower_programs(
        graphdef, placed, slots=slots, prompt_width=cfg.task.prompt_width,
        max_new_tokens=cfg.sampler.max_new_tokens, requests=slots,
        temperature=float(cfg.sampler.temperature) or 1.0, chunk_steps=1, mesh=gen_mesh)
    counts[layers] = sum(op.count for op in hlo.collectives(progs["decode"].as_text()))
  per_layer = counts[3] - counts[2]
  per_step = counts[2] - 2 * per_layer
  return per_step + full.n_layers * per_layer, per_step, per_layer, full.n_layers


def generator_placement(workdir: str, steps: int = 3) -> tuple[int, int, int, int]:
  """A short actor–learner run with the generator thread's transfers audited.

  Args:
    workdir: an empty directory (the run's checkpoints, its warm-start cache).
    steps: learner steps.

  Returns:
    (implicit transfers onto a learner device, onto the generator devices as one device,
     all implicit transfers, repeats logged without a destination) of the generator thread
     over the whole run (``parallel.transfers``).

  Raises:
    RuntimeError: the generator thread never ran.
  """
  import jax

  from jaxreplay import config as config_lib
  from jaxreplay.parallel import transfers
  from jaxreplay.train import loop, split

  c = config_lib.load_config(os.path.join(ROOT, "configs", "small.py"))
  c.workdir = os.path.join(workdir, "run")
  c.warmstart.update(cache_dir=os.path.join(workdir, "base"), steps=20, batch_size=32)
  c.task.update(train_size=400, heldout_size=60)
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  c.rollout.update(per_step=16, group_size=4)
  c.buffer.update(capacity=32, max_staleness=3)
  c.train.update(steps=steps, batch_size=16, mode="async", weight_sync_every=1)
  c.mesh.update(data=4, fsdp=1, tensor=1, generator_devices=4)
  c.sampler.chunk_steps = 2
  c.algo.warmup_steps = 1
  c.eval.every = c.drift.every = 0
  c.checkpoint.update(every=steps, keep_best=False)
  c.log.update(progress=False, tensorboard=False)
  audits = []
  real_loop = split.Generator._loop

  def audited(self):
    with transfers.implicit_transfers() as seen:
      real_loop(self)
    audits.append((seen, {d.id for d in self._mesh.devices.flat}))

  split.Generator._loop = audited
  try:
    loop.run(config_lib.validate(c), log=lambda *_: None)
  finally:
    split.Generator._loop = real_loop
  if not audits:
    raise RuntimeError("the split run started no generator thread")
  seen, gen_ids = audits[0]
  learner_ids = {d.id for d in jax.devices()} - gen_ids
  return seen.onto(learner_ids), seen.onto(gen_ids), seen.total, seen.repeated


def format_line(values: dict) -> str:
  """The result line: every ``FIELDS`` key, ``na`` where not in ``values``."""
  def fmt(v):
    if v is None:
      return "na"
    return str(v) if isinstance(v, int) else f"{v:.3f}"
  return " ".join(f"{k}={fmt(values.get(k))}" for k in FIELDS)


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/qwen2_5_7b_h100x8.py")
  p.add_argument("--layers", type=int, default=2, help="layers of the 7B-width model")
  p.add_argument("--seed", type=int, default=0, help="seed of the lognormal batch")
  p.add_argument("--publish-config", default="configs/qwen2_5_7b_h200x8_split.py",
                 help="the actor-learner preset whose publish is planned")
  p.add_argument("--no-generator", action="store_true",
                 help="skip the actor-learner run that audits the generator's placement")
  return p.parse_args(argv)


def main(argv=None) -> int:
  """Compiles the preset's packed update (``--config``, ``--layers``) on 8 fake CPU devices,
  prints its collective traffic and, last, ``format_line``'s result line; returns the exit
  status (0)."""
  args = _parse(argv)
  import dataclasses

  import jax
  import numpy as np

  from jaxreplay import config as config_lib
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.rl import packing
  from jaxreplay.rl.spec import AlgoSpec
  from memory_plan import model_config

  cfg = config_lib.load_config(args.config)
  tcfg = dataclasses.replace(model_config(cfg, args.config), n_layers=args.layers)
  devices = jax.device_count()
  w = int(cfg.mesh.get("generator_devices", 0) or 0)
  shape = config_lib.mesh_shape(cfg, devices - w)
  mesh = sharding_lib.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
  mask = lognormal_mask(cfg.train.batch_size, cfg.task.prompt_width,
                        cfg.sampler.max_new_tokens, args.seed)
  compiled, params, plan, secs = compile_learner_update(cfg, tcfg, mesh, mask)
  spec = AlgoSpec.from_config(cfg.algo)
  analytic = fsdp_bytes(params, spec.num_minibatches * spec.grad_accum_steps,
                        spec.update_epochs)
  r = learner_ratios(compiled.as_text(), params, analytic)
  print(f"learner: mesh (data, fsdp, tensor) = {shape}, {tcfg.n_layers} layers of 7B width, "
        f"batch {mask.shape}, {spec.grad_accum_steps} micro-batches, compiled in {secs:.0f} s")
  print("  collective GB per step: " + ", ".join(
      f"{k} {v / 1e9:.2f}" for k, v in r["by_kind"].items()) +
        f"; activation all-reduce {r['activation_allreduce'] / 1e9:.2f}, parameter "
        f"all-gather {r['param_allgather'] / 1e9:.2f}, gradient reduction "
        f"{r['grad_reduce'] / 1e9:.2f}, FSDP analytic {analytic / 1e9:.2f}")
  values = {k: r[k] for k in ("learner_activation_allreduce_ratio",
                              "learner_collectives_vs_fsdp")}
  values["packed_padding_accum8"] = packing.padding_fraction(plan)
  print(padding_summary(cfg, mask.shape[0], sharding_lib.batch_shards(mesh), plan))
  extra, extra_cpu, replica, path = publish_extra(args.publish_config)
  print(f"publish ({args.publish_config}): largest block {path}, {extra:.2f} GB per learner "
        f"device ({extra_cpu:.2f} GB with XLA:CPU's float32 gather); a whole bf16 replica "
        f"is {replica:.2f} GB")
  values["publish_extra_gb"] = extra
  refresh, refresh_cpu, block = refresh_temp(args.publish_config)
  print(f"weight-swap re-prefill (64 slots x 4,096, 28 layers of 7B width, {block} slot(s) "
        f"at a time): {refresh:.2f} GB of temporaries ({refresh_cpu:.2f} GB with XLA:CPU's "
        f"float32 weight copies)")
  values["refresh_temp_gb_64x4k"] = refresh
  per_token, per_step, per_layer, layers = decode_collectives(args.publish_config)
  print(f"decode on the generator mesh ({args.publish_config}): {per_step} collectives per "
        f"step + {per_layer} per layer, {per_token} per decoded token at {layers} layers")
  values["decode_collectives_per_token"] = per_token
  if not args.no_generator:
    import tempfile
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
      on_learner, on_gen, total, repeated = generator_placement(tmp)
    print(f"generator thread (split W/T = 4/4, tiny decoder, {time.time() - t0:.0f} s): "
          f"{total} implicit host-to-device transfers, {on_gen} onto a generator device "
          f"alone, {on_learner} onto a learner device, {repeated} repeats logged without "
          f"a destination")
    values["generator_ops_on_learner_devices"] = on_learner
  print(format_line(values))
  return 0


if __name__ == "__main__":
  sys.exit(main())
