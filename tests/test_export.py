"""``python -m jaxreplay.export``: a run's checkpoint as a Hugging Face directory that
transformers opens alone, whose greedy continuations and logits are jaxreplay's own; one-line
errors for a missing step, an empty workdir and a model with no Hugging Face equivalent."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx  # noqa: E402

from jaxreplay import export  # noqa: E402
from jaxreplay.models.transformer import TransformerConfig  # noqa: E402
from jaxreplay.sampling import generate  # noqa: E402
from conftest import (load_bench, logprob_tol, restore, run, save_tiny_qwen2,  # noqa: E402
                      tiny_run_config)

verify_export = load_bench("verify_export", folder="tools")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 6  # tiny_run_config's sampler.max_new_tokens (configs/default.py)


def _quiet(*_):
  pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_policy_cache):
  """A two-step run of the tiny default-model config, checkpointed at steps 1 and 2."""
  wd = tmp_path_factory.mktemp("run")
  c = tiny_run_config(wd, base_policy_cache, **{"train.steps": 2, "checkpoint.every": 1,
                                                "eval.every": 2})
  run(c, log=_quiet)
  return c


@pytest.mark.slow
def test_export_matches_jaxreplay_greedy_and_logits(trained, tmp_path, capsys):
  out = str(tmp_path / "hf")
  r = export.export(trained.workdir, out)
  assert r["step"] == 2 and r["source"] == "builtin"
  # the run keeps its tokenizer beside its checkpoints: the export needs no warm-start cache
  assert os.path.exists(os.path.join(trained.workdir, "tokenizer.json"))
  assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} == set(os.listdir(out)) == set(r["files"])
  assert r["bytes"] == sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert model.config.model_type == "llama" and not model.config.tie_word_embeddings

  # jaxreplay's own greedy continuation, from the trainer's restore of the same checkpoint
  job, carry = restore(trained, log=_quiet)
  assert carry.step == 2
  examples = job.task.heldout[:8]
  toks, mask, _ = job.io.prompts(examples)
  g = generate(job.graphdef, carry.state.params, toks, mask, jax.random.key(0),
               max_new_tokens=M, temperature=0.0, eos_ids=job.io.eos_ids, pad_id=job.io.pad_id)
  gen_tokens, gen_mask = np.asarray(g.tokens), np.asarray(g.mask)
  texts = job.io.decode(gen_tokens, gen_mask)
  # tools/verify_export.py --n 3: the check a user runs on an export
  v = verify_export.main(["--workdir", trained.workdir, "--export", out, "--n", "3"])
  assert v["step"] == 2 and v["n"] == 3 == v["equal"]
  for row, e, text in zip(v["rows"], examples, texts):
    assert (row["question"], row["gold"], row["jaxreplay"]) == (e.prompt, e.answer, text)
    assert row["reward"] == job.task.reward(text, e) and row["first_diff"] is None
  assert capsys.readouterr().out.splitlines()[-1] == (
      "verify: 3 of 3 greedy continuations equal token for token")
  ours_model = nnx.merge(job.graphdef, carry.state.params)
  for i, e in enumerate(examples):
    prompt = [int(t) for t, m in zip(toks[i], mask[i]) if m]
    # the exported chat template renders the trained prompt: <bos> + the question
    chat = tok.apply_chat_template([{"role": "user", "content": e.prompt}],
                                   add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if not isinstance(chat, list) else chat)
    assert chat == prompt == tok(e.prompt)["input_ids"], e.prompt
    theirs = model.generate(torch.tensor([chat]), max_new_tokens=M, do_sample=False,
                            attention_mask=torch.ones(1, len(chat), dtype=torch.long))
    theirs = theirs[0, len(chat):].tolist()
    ours = [int(t) for t, m in zip(gen_tokens[i], gen_mask[i]) if m]
    assert theirs[:len(ours)] == ours, (e.prompt, ours, theirs)
    # logits of prompt + completion agree to the float32 reordering bound
    full = np.array([prompt + ours], np.int32)
    with torch.no_grad():
      t_logits = model(torch.tensor(full, dtype=torch.long)).logits.numpy()
    o_logits = np.asarray(ours_model(jax.numpy.asarray(full), jax.numpy.ones(full.shape, bool)))
    cfg = ours_model.cfg
    np.testing.assert_allclose(t_logits, o_logits, rtol=0, atol=logprob_tol(cfg, o_logits))
  gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
  assert gen_cfg["eos_token_id"] == list(job.io.eos_ids) and gen_cfg["max_new_tokens"] == M


@pytest.mark.slow
def test_export_bfloat16_sharded_and_a_chosen_step(trained, tmp_path):
  out32, out16 = str(tmp_path / "f32"), str(tmp_path / "bf16")
  export.export(trained.workdir, out32, step=1)
  r = export.export(trained.workdir, out16, step=1, dtype="bfloat16", max_shard_mb=0.05)
  assert r["step"] == 1
  shards = sorted(f for f in os.listdir(out16) if f.endswith(".safetensors"))
  assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(out16)
  # exporting again into a directory that held shards leaves only the new weights
  export.export(trained.workdir, str(tmp_path / "again"), step=1, max_shard_mb=0.05)
  export.export(trained.workdir, str(tmp_path / "again"), step=1)
  assert sorted(f for f in os.listdir(tmp_path / "again") if f.startswith("model")) == [
      "model.safetensors"]
  m32 = transformers.AutoModelForCausalLM.from_pretrained(out32)
  m16 = transformers.AutoModelForCausalLM.from_pretrained(out16, dtype=torch.bfloat16)
  s32, s16 = m32.state_dict(), m16.state_dict()
  assert set(s32) == set(s16)
  for k in s32:
    assert s16[k].dtype == torch.bfloat16
    assert torch.equal(s16[k], s32[k].to(torch.bfloat16)), k


@pytest.mark.slow
def test_best_checkpoint_exports(trained, tmp_path):
  r = export.export(trained.workdir, str(tmp_path / "best"), best=True)
  best = json.load(open(os.path.join(trained.workdir, "summary.json")))["best_checkpoint"]
  assert r["step"] == best["step"]


@pytest.mark.slow
def test_a_relative_workdir_exports_as_the_readme_writes_it(trained, tmp_path, monkeypatch):
  # README: python -m jaxreplay.export --workdir runs/default --out exported/default
  monkeypatch.chdir(os.path.dirname(trained.workdir))
  rel = os.path.basename(trained.workdir)
  export.main(["--workdir", rel, "--step", "2", "--out", "exported"])
  absolute = export.export(trained.workdir, str(tmp_path / "abs"), step=2)
  assert absolute["step"] == 2
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    with open(os.path.join("exported", name), "rb") as a, open(tmp_path / "abs" / name,
                                                                "rb") as b:
      assert a.read() == b.read(), name


@pytest.mark.slow
def test_bad_step_and_empty_workdir_stop_with_one_line(trained, tmp_path):
  with pytest.raises(SystemExit) as e:
    export.main(["--workdir", trained.workdir, "--step", "7", "--out", str(tmp_path / "x")])
  msg = str(e.value)
  assert msg == (f"jaxreplay.export: --step 7: no checkpoint at that step in "
                 f"{trained.workdir}/checkpoints; steps there: 1, 2")
  assert not os.path.exists(tmp_path / "x")
  empty = tmp_path / "empty"
  empty.mkdir()
  p = subprocess.run([sys.executable, "-m", "jaxreplay.export", "--workdir", str(empty),
                      "--out", str(tmp_path / "y")], capture_output=True, text=True, cwd=ROOT)
  assert p.returncode == 1 and p.stdout == ""
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"jaxreplay.export: no checkpoint in {empty}")


def test_a_model_without_hugging_face_equivalent_names_the_field():
  cfg = TransformerConfig(vocab_size=16, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4,
                          d_ff=8, qk_norm=True, mlp_bias=True)
  with pytest.raises(export.ExportError, match=r"no Hugging Face equivalent: .*mlp_bias"):
    export.hf_weights(cfg, params=None)


def qwen_checkpoint(directory):
  """A tiny random Qwen2 with a ChatML byte-level BPE whose normalizer and pre-tokenizer are
  Qwen2.5's (transformers 5 rebuilds them for any qwen2 checkpoint, whatever tokenizer.json
  says, so a checkpoint that transformers and ``tokenizers`` read alike needs Qwen's own)."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  rng = np.random.default_rng(0)
  texts = [" + ".join(map(str, rng.integers(0, 10, 3))) + f" = {i}" for i in range(200)]
  tok.train_from_iterator(texts + ["You are a helpful assistant."] * 5, trainers.BpeTrainer(
      vocab_size=320, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  save_tiny_qwen2(directory, tok)


@pytest.mark.slow
def test_hf_checkpoint_trained_two_steps_exports(base_policy_cache, tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  qwen_checkpoint(str(ckpt))
  c = tiny_run_config(tmp_path / "run", base_policy_cache, **{
      "model.source": "hf", "model.path": str(ckpt), "task.chat_template": True,
      "task.prompt_width": 64, "train.steps": 2, "checkpoint.every": 2, "eval.every": 2})
  run(c, log=_quiet)
  out = str(tmp_path / "hf")
  r = export.export(c.workdir, out)
  assert r["source"] == "hf" and r["step"] == 2
  assert json.load(open(os.path.join(out, "tokenizer_config.json")))["chat_template"]
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert model.config.model_type == "qwen2"
  job, carry = restore(c, log=_quiet)
  for ours, theirs in verify_export.greedy_pairs(job.graphdef, carry.state.params, job.io,
                                          job.task.heldout[:6], tok, model, M):
    assert ours == theirs


def test_an_hf_run_whose_starting_checkpoint_is_gone_names_model_path(tmp_path):
  c = export.run_specs({"model": {"source": "hf", "path": str(tmp_path / "gone")}})
  with pytest.raises(export.ExportError, match=r"^model\.path='.*gone': the run's starting "):
    export.policy_config(c)
  (tmp_path / "empty").mkdir()
  c = export.run_specs({"model": {"source": "hf", "path": str(tmp_path / "empty")}})
  with pytest.raises(export.ExportError, match=r"^model\.path=.*must still hold its tokenizer"):
    export.write_tokenizer(c, str(tmp_path), str(tmp_path / "out"))
