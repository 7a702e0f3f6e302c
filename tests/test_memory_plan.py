"""``bench/memory_plan.py`` on a tiny config (so it cannot rot): it compiles the learner
step, the sampler, the rescoring, drift and evaluation passes on a fake 8-device mesh from
abstract inputs, its per-device argument bytes are the sharded train state and buffer, and
the fit verdict follows the chip's HBM."""

import os

import jax
import numpy as np
import pytest
from conftest import load_bench

from jaxreplay.config import load_config
from jaxreplay.models import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def largest_block(params, itemsize: int) -> int:
  """Bytes of the streamed publish's largest block (``submesh._Move``): one layer of a
  scan-layout block parameter ``blocks/<name>/...`` [L, ...], else a whole leaf."""
  from jaxreplay.parallel.sharding import path_str
  sizes = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    parts = path_str(path).split("/")
    stacked = parts[0] == "blocks" and not parts[1].isdigit()
    sizes.append(int(np.prod(x.shape[1:] if stacked else x.shape)) * itemsize)
  return max(sizes)


def _module():
  return load_bench("memory_plan")


def tiny_config():
  c = load_config(os.path.join(ROOT, "configs", "default.py"))
  c.model.update(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                 d_ff=64)
  c.model.scan_layers = True
  c.model.remat = "full"
  c.sampler.max_new_tokens = 4
  c.task.prompt_width = 8
  c.rollout.update(per_step=16, group_size=8)
  c.buffer.capacity = 32
  c.train.update(batch_size=16, steps=100)
  c.algo.update(grad_accum_steps=2, logprob_chunk=4, staleness_buckets=(0,))
  c.rollout.behaviour_logprobs = "learner"
  c.eval.batch_rows = 32
  return c


@pytest.mark.slow
def test_plan_of_a_tiny_config_on_eight_devices():
  mp = _module()
  cfg = tiny_config()
  result = mp.plan(cfg, 8, "v5e", mesh_shape=(2, 2, 2))
  assert result["mesh"] == (2, 2, 2) and result["model"].scan_layers
  learner, sampler = result["learner"], result["sampler"]
  # Per device: the learner's arguments are its shard of the state and the buffer (and a
  # key), all donated; one device holds a fraction of the whole state.
  state = result["state_bytes"] + result["buffer_bytes"]
  assert state <= learner["args"] <= state + 64
  assert learner["alias"] >= result["state_bytes"]
  whole = sum(int(np.prod(x.shape)) * x.dtype.itemsize
              for x in jax.tree.leaves(hf.abstract_model(result["model"])[1]))
  assert result["params_bytes"] < whole / 3  # fsdp × tensor = 4 ways, norms replicated
  assert sampler["args"] >= result["params_bytes"] and sampler["temp"] > 0
  assert result["programs"]["sampler"] == sampler["total"] + result["sampler_resident"]
  # Every program the config runs is compiled, its scoring passes in the learner's rows.
  assert set(result["programs"]) == {"learner", "sampler", "rescoring", "drift",
                                     "eval sampler", "eval entropy"}
  assert result["peak"] == max(result["programs"].values())
  assert result["fits"] and result["peak"] < 0.8 * 16e9
  text = mp.report(result, cfg, "tiny", 8, "v5e")
  assert "fits 16 GB with 20% headroom (<= 12.8 GB): yes" in text.splitlines()[-2]  # a TPU: all HBM


def test_unknown_chip_and_architecture_fail_clearly():
  mp = _module()
  with pytest.raises(ValueError, match="chip='tpu9'"):
    mp.plan(tiny_config(), 8, "tpu9")
  cfg = tiny_config()
  cfg.model.source = "hf"
  with pytest.raises(ValueError, match="pass --arch"):
    mp.model_config(cfg, "configs/mine.py")
  assert mp.model_config(cfg, "configs/qwen2_5_7b_v5p.py").n_layers == 28


@pytest.mark.slow
def test_plan_of_the_actor_learner_split_reports_both_sub_meshes():
  """mesh.generator_devices W = 4 of 8: the learner programs (the weight sync's gather in
  place of the sampler) on the learner mesh over T = 4 devices, the sampler on the generator
  mesh (W / generator_tensor, 1, generator_tensor) with the inference copy in model.dtype."""
  mp = _module()
  cfg = tiny_config()
  cfg.train.mode = "async"
  cfg.rollout.behaviour_logprobs = "sampler"  # the split has no learner-side rescoring
  cfg.mesh.update(generator_devices=4, generator_tensor=2)
  cfg.eval.every = 0  # (its programs are the W = 0 plan's, on the learner mesh; saves ~8 s)
  result = mp.plan(cfg, 8, "v5e", mesh_shape=(2, 2, 1))
  assert result["split"] and result["mesh"] == (2, 2, 1) and result["generator_mesh"] == (2, 1, 2)
  learner, generator = result["submeshes"]["learner"], result["submeshes"]["generator"]
  assert (learner["devices"], generator["devices"]) == (4, 4)
  assert set(learner["programs"]) == {"learner", "weight sync", "drift"}
  assert set(generator["programs"]) == {"sampler"}
  # The weight sync streams: its largest block replicated per learner device, in the
  # inference dtype, not a whole replica.
  params = hf.abstract_model(result["model"])[1]
  itemsize = np.dtype(cfg.model.dtype).itemsize
  whole = sum(int(np.prod(x.shape)) * itemsize for x in jax.tree.leaves(params))
  assert learner["weight sync"]["out"] == largest_block(params, itemsize) < whole / 4
  # The generator's copy is split over its tensor axis only: about half the model.
  assert whole / 2 <= generator["params_bytes"] < whole
  assert generator["sampler"]["args"] >= generator["params_bytes"]
  assert generator["peak"] == generator["sampler"]["total"] + generator["params_bytes"]
  assert result["peak"] == max(learner["peak"], generator["peak"]) and result["fits"]
  text = mp.report(result, cfg, "tiny", 8, "v5e")
  assert "W/T = 4/4" in text and text.splitlines()[-2] == "both sub-meshes fit: yes"


def test_a_gpu_plan_is_checked_against_jax_s_memory_pool():
  """On a GPU JAX allocates train.device_memory_fraction of HBM (0: its default 0.75); on a
  TPU the whole HBM. The split preset's learner mesh peaks at 90.31 GB (its docstring's
  plan): above 0.8 x 0.75 x 141 GB = 84.6 GB, within 0.8 x 0.9 x 141 GB = 101.5 GB."""
  mp = _module()
  cfg = tiny_config()
  assert mp.memory_pool(cfg, "h200") == (0.75, 0.75 * 141e9)
  assert mp.memory_pool(cfg, "v5p") == (1.0, 95e9)
  cfg.train.device_memory_fraction = 0.9
  assert mp.memory_pool(cfg, "h100") == (0.9, 0.9 * 80e9)
  split = load_config(os.path.join(ROOT, "configs", "qwen2_5_7b_h200x8_split.py"))
  fraction, pool = mp.memory_pool(split, "h200")
  assert fraction == 0.9 and 90.31e9 <= (1 - mp.HEADROOM) * pool
  assert 90.31e9 > (1 - mp.HEADROOM) * mp.memory_pool(tiny_config(), "h200")[1]
  assert mp._peak_line("peak", 90.31e9, 141e9, True, fraction) == (
      "peak: 90.31 GB of 141 GB (64%); fits JAX's pool 0.9 x 141 = 126.9 GB with 20% "
      "headroom (<= 101.5 GB): yes")


def lora_tiny_config():
  """``tiny_config`` with rank-4 adapters on all seven block layers and a bfloat16 base.

  Adapter parameters per layer (d_model 32, q/o out 2 x 16 = 32, k/v out 16, d_ff 64), A
  [in, 4] + B [4, out]: q 256, k 192, v 192, o 256, gate 384, up 384, down 384 = 2,048;
  3 layers: 6,144 params, 24,576 bytes in float32.
  """
  cfg = tiny_config()
  cfg.model.param_dtype = "bfloat16"
  cfg.model.lora.update(rank=4, alpha=8.0)
  return cfg


ADAPTER_PARAMS = 6144  # lora_tiny_config's, by hand


def test_lora_plan_holds_optimizer_state_for_the_adapters_only():
  """The plan's policy carries the float32 adapters train.build adds over a bfloat16 base,
  and the train state built from it (as ``_mesh_plan`` builds it) has Adam's two moments
  of the adapters alone: 2 x 24,576 bytes, plus two int32 step counts."""
  from jaxreplay.models import lora
  from jaxreplay.rl.train_step import init_train_state, make_optimizer
  mp = _module()
  cfg = lora_tiny_config()
  graphdef, params = mp.abstract_policy(cfg, mp.model_config(cfg))
  adapters, frozen = lora.split_adapters(params)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {np.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {np.dtype("bfloat16")}
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters)) == ADAPTER_PARAMS
  optimizer = make_optimizer(cfg.algo, cfg.train.steps)
  state = jax.eval_shape(lambda p: init_train_state(graphdef, p, optimizer, cfg.algo), params)
  opt_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(state.opt_state))
  assert opt_bytes == 2 * 4 * ADAPTER_PARAMS + 2 * 4
  # rank 0: the whole policy, float32 optimizer state for every parameter
  cfg.model.lora.rank = 0
  _, whole = mp.abstract_policy(cfg, mp.model_config(cfg))
  assert not lora.has_adapters(whole)
  assert jax.tree.structure(whole) == jax.tree.structure(frozen)


@pytest.mark.slow
def test_lora_split_plan_syncs_the_frozen_base_once_and_then_the_adapters():
  """W/T = 1/1 with LoRA: the learner's state is the bf16 base, the float32 adapters and
  their Adam moments; every publish gathers the adapters in bf16 (2 x 6,144 bytes), the
  first the frozen base (``first sync``); the generator keeps one next version's adapters
  beside its copy, not a second whole model."""
  mp = _module()
  cfg = lora_tiny_config()
  cfg.train.mode = "async"
  cfg.rollout.behaviour_logprobs = "sampler"  # the split has no learner-side rescoring
  cfg.mesh.update(generator_devices=1, generator_tensor=1)
  cfg.model.dtype = "bfloat16"
  cfg.eval.every = 0
  cfg.drift.every = 0
  result = mp.plan(cfg, 2, "v5e", mesh_shape=(1, 1, 1))
  learner, generator = result["submeshes"]["learner"], result["submeshes"]["generator"]
  assert result["n_adapter_params"] == ADAPTER_PARAMS
  base = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(
      hf.abstract_model(result["model"])[1]))
  assert learner["params_bytes"] == base + 4 * ADAPTER_PARAMS
  # Adam's mu and nu of the adapters, the two optimizer counts, step and skipped
  assert learner["state_bytes"] - learner["params_bytes"] == 2 * 4 * ADAPTER_PARAMS + 4 * 4
  assert set(learner["programs"]) == {"learner", "weight sync", "first sync"}
  # streamed: the largest adapter block (every publish) and base block (the first), bf16
  from jaxreplay.models import lora
  from jaxreplay.models.spec import LoraSpec
  g, p = hf.abstract_model(result["model"])
  adapters, _ = lora.split_adapters(lora.abstract_adapters(
      g, p, LoraSpec(**cfg.model.lora.to_dict()))[1])
  assert learner["weight sync"]["out"] == largest_block(adapters, 2) < 2 * ADAPTER_PARAMS
  assert learner["first sync"]["out"] == largest_block(p, 2) < base
  assert generator["params_bytes"] == base + 2 * ADAPTER_PARAMS
  assert generator["sampler_resident"] == 2 * ADAPTER_PARAMS
  text = mp.report(result, cfg, "tiny", 2, "v5e")
  assert "LoRA rank 4: 0.01M float32 adapter params, the only ones trained" in text
  assert "next published adapters" in text
