"""The actor–learner split: how busy each sub-mesh is, and the generator's decode HLO.

Protocol (issue 25): one process with 8 fake CPU devices
(``--xla_force_host_platform_device_count=8``) runs ``train.mode='async'`` with
``mesh.generator_devices`` W = 6, 4, 2 (the paper's W/T per node: 6/2, 4/4, 2/6; the
learner mesh is data = T over the other devices), each W/T in a fresh subprocess, one at a
time (so device counts and compile caches do not carry over). The config is
``configs/small.py`` shrunk to seconds (a 1-layer d=32 decoder on chain sums, R = 24
rollouts per round, B = 24 from a buffer of 48, replay ratio ρ = B/R = 1 held by the rate
limiter), with the weights published every learner step (``train.weight_sync_every=1``) and
decode chunks of 2 steps (``sampler.chunk_steps=2``), so new weights can swap in between
the chunks of a round. From each run it reads the last step's metrics record and
``summary.json``'s ledger:

* ``generator_idle`` / ``learner_idle``: the fraction of the wall time (from the first
  learner step's start) that the generator thread / the learner was not working (waiting
  for the rate limiter, for rollouts, or for the other thread's agreements);
* ``overlap``: the fraction of the wall time both worked at the same moment — what the
  split buys over alternating generate-then-train (``sync``, overlap 0);
* ``replay_ratio`` ρ (trained sequences ÷ generated rollouts), ``mu_time`` / ``mu_flops``
  (the ledger's μ: cost of one generated rollout ÷ one trained sequence, from each side's
  busy seconds or from FLOP estimates), printed next to W/T: the paper's downtime-free
  ratio without a buffer is W/T = μ (Arnal et al. 2026, §3; NOTES: "cost per update ≈
  C(1+μ), and the downtime-free ratio is W/T = μ"), μ in device cost — μ_flops here;
* ``weight_swaps`` (new weights the generator took, between rounds or in flight),
  ``version_span`` (the mean, over the steps that inserted rounds, of newest − oldest policy
  version per rollout: > 0 when a swap landed inside a rollout), ``lost_in_flight_rollouts``
  (generated, or being generated, when the run stopped; never inserted), wall seconds.

Then, for the model of that config on the 6/2 split, the decode chunk of the engine (64
slots) is compiled twice — with the parameters in the learner's FSDP layout (learner mesh
data=1, fsdp=2 over the T = 2 devices) and in the generator's own layout (replicated over
its 6 devices, ``parallel.submesh``) — and the collectives on parameter-shaped arrays are
counted (``submesh.param_collectives``): a generator that holds its inference copy gathers
no weight per decode step.

What it cannot show: the 8 fake CPU devices share the machine's two cores (and one Python
process), so the sub-meshes cannot run in parallel here and no wall-time speedup over
``sync`` is expected: each side's busy seconds include time it only waited for a core, the
two mostly take turns (small ``overlap``), and W/T barely changes the fractions. The tiny
model also makes generation cheap (μ_flops ≈ 0.3), so the 6/2 and 4/4 generators are
oversized for it. The figures are the fractions (the bookkeeping of who waits for whom, and
that both sides do work at once), the ledger, and the HLO count; throughput and the
W/T = μ balance need real accelerators.

With ``--lora R`` the runs train rank-R adapters (``model.lora.rank``) and the bench reports
the bytes one publish moves (``submesh.WeightSync.bytes_moved``): the first publish copies
the frozen base to the generator once, every later one only the adapters, cast to bfloat16
like the presets' inference copy. They are counted for the bench's own model (a real
``WeightSync`` on the 6/2 meshes, publishing twice) and for Qwen2.5-7B's widths (d 3584,
28 layers, 28/4 heads of 128, d_ff 18944, vocab 152064, all seven projections targeted),
where ``submesh.publish_bytes`` counts the abstract parameters of ``jax.eval_shape`` (no 7B
array is allocated), next to the whole bf16 replica a publish moves without LoRA.

Usage: python bench/actor_learner.py [--steps 16] [--lora 8]  (last line: ``generator_idle=F
learner_idle=F overlap=F decode_param_collectives=N``, the fractions of the 6/2 run and N
the generator layout's count; with ``--lora``: ``publish_bytes_lora=N publish_bytes_full=M
publish_fraction=F``, a later publish's bytes at 7B, the whole replica's, and N/M)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, ROOT)

SPLITS = (6, 4, 2)  # W; T = DEVICES − W


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=16, help="learner steps per W/T")
  p.add_argument("--slots", type=int, default=64, help="decode slots of the HLO comparison")
  p.add_argument("--lora", type=int, default=0,
                 help="LoRA rank of the runs (0: full fine-tuning); reports publish bytes")
  p.add_argument("--workdir", default="", help="runs go here (default: a temporary dir)")
  p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # W of one run
  return p.parse_args(argv)


def make_config(w: int, workdir: str, cache_dir: str, steps: int, lora: int = 0):
  """``configs/small.py`` shrunk (a 1-layer d=32 decoder), async with W generator devices,
  rank-``lora`` adapters when ``lora`` > 0."""
  from jaxreplay.config import load_config
  t = DEVICES - w
  c = load_config(os.path.join(ROOT, "configs", "small.py"))
  c.workdir = workdir
  c.warmstart.update(cache_dir=cache_dir, steps=20, batch_size=32)
  c.task.update(train_size=400, heldout_size=60)
  c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
  c.rollout.update(per_step=24, group_size=4)  # divisible by every W and T here
  c.buffer.update(capacity=48, max_staleness=4)
  c.train.update(steps=steps, batch_size=24, mode="async", weight_sync_every=1)
  c.sampler.chunk_steps = 2
  c.algo.warmup_steps = 1
  c.eval.update(every=0, num_examples=8, samples_per_example=2)
  c.drift.every = 0
  c.checkpoint.update(every=0, keep_best=False)
  c.log.update(progress=False, tensorboard=False)
  c.mesh.update(data=t, fsdp=1, tensor=1, generator_devices=w, generator_tensor=1)
  c.model.lora.rank = lora
  return c


def child(args) -> int:
  """One run (in its own process): W = ``args.child``."""
  from jaxreplay import config as config_lib
  from jaxreplay.train import loop
  w = args.child
  c = make_config(w, os.path.join(args.workdir, f"w{w}"), os.path.join(args.workdir, "cache"),
                  args.steps, args.lora)
  loop.run(config_lib.validate(c), log=lambda *a: None)
  return 0


def run_split(w: int, args) -> dict:
  """Runs W/T in a subprocess; its last metrics record and ledger."""
  from jaxreplay.train.metrics import read_metrics
  cmd = [sys.executable, os.path.abspath(__file__), "--child", str(w), "--steps",
         str(args.steps), "--workdir", args.workdir, "--lora", str(args.lora)]
  t0 = time.time()
  out = subprocess.run(cmd, capture_output=True, text=True)
  wall = time.time() - t0
  if out.returncode:
    sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
    raise SystemExit(f"the W={w} run failed (exit {out.returncode})")
  workdir = os.path.join(args.workdir, f"w{w}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  records = [r for r in read_metrics(workdir) if "generator_idle" in r]
  last = records[-1]
  spans = [r["version_span"] for r in records if r.get("version_span") is not None]
  ledger = summary["ledger"]
  return dict(w=w, t=DEVICES - w, generator_idle=last["generator_idle"],
              learner_idle=last["learner_idle"], overlap=last["overlap"],
              replay_ratio=ledger["replay_ratio"], mu_time=ledger["mu_time"],
              mu_flops=ledger["mu_flops"], weight_swaps=last["weight_swaps"],
              version_span=sum(spans) / len(spans) if spans else float("nan"),
              lost=ledger.get("lost_in_flight_rollouts", 0),
              run_s=summary["wall_seconds"], process_s=wall)


def decode_collectives(args) -> dict:
  """Parameter collectives of the engine's decode chunk on the 6/2 split: learner FSDP
  layout (data=1, fsdp=T) vs the generator's layout (its own mesh, ``model.dtype``)."""
  import jax
  import jax.numpy as jnp

  from jaxreplay.models import hf
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.parallel import submesh
  from jaxreplay.sampling import engine
  from jaxreplay.train.warmstart import builtin_model_config

  w = SPLITS[0]
  c = make_config(w, "", "", args.steps)
  tcfg = builtin_model_config(c.model)
  graphdef, params = hf.abstract_model(tcfg)
  learner_mesh, gen_mesh = submesh.make_meshes((1, DEVICES - w, 1), w, 1)
  dtype = jnp.dtype(c.model.dtype)
  inference = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), params)

  def placed(tree, mesh):
    shardings = sharding_lib.param_shardings(tree, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)

  out = {}
  for name, mesh, p in (("learner", learner_mesh, placed(params, learner_mesh)),
                        ("generator", gen_mesh, placed(inference, gen_mesh))):
    progs = engine.lower_programs(
        graphdef, p, slots=args.slots, prompt_width=c.task.prompt_width,
        max_new_tokens=c.sampler.max_new_tokens, requests=args.slots,
        temperature=float(c.sampler.temperature), chunk_steps=c.sampler.chunk_steps, mesh=mesh)
    out[name] = submesh.param_collectives(progs["decode"].as_text(), params)
  return out


def abstract_with_adapters(tcfg, rank: int):
  """(base params, params with rank-``rank`` adapters on every target) of ``Transformer(tcfg)``,
  both ``jax.ShapeDtypeStruct`` pytrees (``nnx.State``): nothing is allocated."""
  from jaxreplay.models import hf, lora
  from jaxreplay.models.spec import LoraSpec
  graphdef, params = hf.abstract_model(tcfg)
  return params, lora.abstract_adapters(graphdef, params, LoraSpec(rank=rank))[1]


def qwen7b_config():
  """Qwen2.5-7B's ``TransformerConfig`` (its published config.json, ``memory_plan.ARCHS``)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from memory_plan import ARCHS

  from jaxreplay.models import hf
  return hf.config_from_hf(ARCHS["qwen2.5-7b"], dtype="bfloat16", param_dtype="bfloat16")


def publish_sizes(args) -> dict:
  """Bytes a publish moves in bfloat16 with rank-``args.lora`` adapters and without.

  Returns:
    {"tiny": (first, later, full), "7b": (later, full)}: for the bench's model, what a real
    ``WeightSync`` on the 6/2 meshes moved at its first and second publish and the whole
    replica; for Qwen2.5-7B, ``publish_bytes`` of the adapters and of the base.
  """
  import jax
  import jax.numpy as jnp

  from jaxreplay.models import lora
  from jaxreplay.parallel import sharding as sharding_lib
  from jaxreplay.parallel import submesh
  from jaxreplay.train.warmstart import builtin_model_config

  w = SPLITS[0]
  base, abstract = abstract_with_adapters(
      builtin_model_config(make_config(w, "", "", args.steps).model), args.lora)
  learner_mesh, gen_mesh = submesh.make_meshes((DEVICES - w, 1, 1), w, 1)
  learner_sh = sharding_lib.param_shardings(abstract, learner_mesh)
  sync = submesh.make_weight_sync(learner_sh, sharding_lib.param_shardings(abstract, gen_mesh),
                                  jnp.bfloat16)
  params = jax.jit(lambda: jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), abstract),
                   out_shardings=learner_sh)()
  sync(params)
  first = sync.bytes_moved
  adapters, frozen = lora.split_adapters(params)
  sync(lora.join_adapters(jax.tree.map(lambda x: x + 1, adapters), frozen))
  tiny = (first, sync.bytes_moved, submesh.publish_bytes(base, jnp.bfloat16))
  base7, abstract7 = abstract_with_adapters(qwen7b_config(), args.lora)
  big = (submesh.publish_bytes(abstract7, jnp.bfloat16, adapters_only=True),
         submesh.publish_bytes(base7, jnp.bfloat16))
  return {"tiny": tiny, "7b": big}


def main(argv=None) -> int:
  args = parse(argv)
  if args.child:
    return child(args)
  tmp = None
  if not args.workdir:
    tmp = tempfile.TemporaryDirectory(prefix="actor_learner_")
    args.workdir = tmp.name
  rows = []
  for w in SPLITS:
    rows.append(run_split(w, args))
    r = rows[-1]
    print(f"ran W/T={r['w']}/{r['t']}: {args.steps} steps in {r['process_s']:.0f} s", flush=True)
  hlo = decode_collectives(args)
  sizes = publish_sizes(args) if args.lora else None

  print()
  print(f"actor–learner split on {DEVICES} fake CPU devices (2 shared cores), {args.steps} "
        f"learner steps each, R=24, B=24, N=48, weight_sync_every=1, chunk_steps=2"
        + (f", LoRA rank {args.lora}" if args.lora else ""))
  head = (f"{'W/T':>5} {'gen_idle':>9} {'lrn_idle':>9} {'overlap':>8} {'replay':>7} "
          f"{'W/T=':>6} {'mu_time':>8} {'mu_flops':>9} {'swaps':>6} {'v_span':>7} "
          f"{'lost':>5} {'wall_s':>7}")
  print(head)
  for r in rows:
    print(f"{r['w']}/{r['t']:<3} {r['generator_idle']:9.3f} {r['learner_idle']:9.3f} "
          f"{r['overlap']:8.3f} {r['replay_ratio']:7.3f} {r['w'] / r['t']:6.2f} "
          f"{r['mu_time']:8.3f} {r['mu_flops']:9.3f} {r['weight_swaps']:6d} "
          f"{r['version_span']:7.3f} {r['lost']:5d} {r['run_s']:7.1f}")
  print("  (W/T= next to μ: the downtime-free ratio without a buffer is W/T = μ in device cost;"
        " wall_s: the run's wall time, compile and start-up included)")
  print(f"decode chunk ({args.slots} slots), collectives on parameter-shaped arrays, 6/2 "
        f"split: learner FSDP layout (data=1, fsdp=2) {hlo['learner']}, generator layout "
        f"(replicated over 6) {hlo['generator']}")
  six = rows[0]
  print(f"generator_idle={six['generator_idle']:.3f} learner_idle={six['learner_idle']:.3f} "
        f"overlap={six['overlap']:.3f} decode_param_collectives={hlo['generator']}")
  if sizes is not None:
    first, later, full = sizes["tiny"]
    print(f"publish bytes, bf16, LoRA rank {args.lora} on q,k,v,o,gate,up,down: this bench's "
          f"model first publish {first} (base + adapters), later publishes {later} "
          f"(adapters), full replica {full} ({later / full:.4f}); Qwen2.5-7B widths: adapters "
          f"{sizes['7b'][0] / 1e6:.1f} MB, full replica {sizes['7b'][1] / 1e9:.2f} GB")
    lora_b, full_b = sizes["7b"]
    print(f"publish_bytes_lora={lora_b} publish_bytes_full={full_b} "
          f"publish_fraction={lora_b / full_b:.4f}")
  if tmp is not None:
    tmp.cleanup()
  return 0


if __name__ == "__main__":
  sys.exit(main())
