"""The Hugging Face preset end to end: configs/qwen2_5_0_5b.py on a tiny random Qwen2
checkpoint (safetensors + tokenizer.json + ChatML template), chat-templated GSM-style
prompts, math-verify rewards, and an exact on-policy importance ratio at the first step."""

import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jaxreplay import config as config_lib  # noqa: E402
from jaxreplay.tasks.base import math_reward  # noqa: E402
from conftest import run, save_tiny_qwen2  # noqa: E402
from jaxreplay.train.metrics import read_records  # noqa: E402
from jaxreplay.train.policy import HFTextIO  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_checkpoint(directory):
  """A tiny random Qwen2 with a ChatML tokenizer trained on GSM-style text."""
  import reasoning_gym
  texts = [e["question"] + " " + str(e["answer"])
           for e in reasoning_gym.create_dataset("gsm_symbolic", size=40, seed=0)]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=512, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  save_tiny_qwen2(directory, tok)
  return tok


def test_math_reward_reads_the_final_answer():
  assert math_reward("18", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18, so \\boxed{18}.") == 1.0
  assert math_reward("18", "The answer is 18.0") == 1.0
  assert math_reward("18", "\\boxed{17}") == 0.0
  assert math_reward("18", "") == 0.0


def test_hf_preset_needs_a_checkpoint_path():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "qwen2_5_0_5b.py"))
  with pytest.raises(config_lib.ConfigError, match="model.path=''"):
    config_lib.validate(c)
  c.model.path = "/nonexistent"
  with pytest.raises(config_lib.ConfigError, match="missing: config.json, tokenizer.json"):
    config_lib.validate(c)


@pytest.mark.slow
def test_qwen_preset_runs_on_a_tiny_checkpoint(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  tok = make_checkpoint(str(ckpt))
  for name in ("qwen2_5_0_5b", "qwen2_5_7b"):  # both presets validate with a path
    c = config_lib.load_config(os.path.join(ROOT, "configs", f"{name}.py"))
    c.model.path = str(ckpt)
    config_lib.validate(c)
  c = config_lib.load_config(os.path.join(ROOT, "configs", "qwen2_5_0_5b.py"))
  c.model.path = str(ckpt)  # the preset's bf16 compute, float32 parameters
  c.workdir = str(tmp_path / "run")
  c.task.update(train_size=64, heldout_size=8)
  c.sampler.max_new_tokens = 8
  c.rollout.update(per_step=16, group_size=8)
  c.buffer.capacity = 32
  c.train.update(steps=2, batch_size=16)
  c.algo.update(num_minibatches=1, lr=1e-3)
  c.eval.update(every=0, num_examples=4, samples_per_example=2)
  c.checkpoint.every = 0
  c.log.update(progress=False, tensorboard=False)
  c.mesh.data = 1  # one device: the claim is the checkpoint's path through the loop

  # Prompts: the checkpoint's chat template with the system turn, left-padded.
  io = HFTextIO.from_pretrained(str(ckpt), c.task.prompt_width, chat=True,
                                system_prompt=c.task.system_prompt)
  from jaxreplay.tasks import make_task
  ex = make_task(c.task).train[0]
  toks, mask, keep = io.prompts([ex])
  text = tok.decode(toks[0][mask[0]].tolist(), skip_special_tokens=False)
  assert keep[0] and text.startswith("<|im_start|>system\nPlease reason step by step")
  assert text.endswith(ex.prompt.strip() + "<|im_end|>\n<|im_start|>assistant\n")
  assert io.eos_ids == (tok.token_to_id("<|im_end|>"),)

  summary = run(c, log=lambda *_: None)
  assert summary["steps"] == 2 and summary["generated_rollouts"] == 32
  rows = read_records(c.workdir)
  first = next(r for r in rows if r["step"] == 1)
  # Step 1 trains on rollouts of the unchanged policy, rescored by the learner
  # (rollout.behaviour_logprobs='learner'): the ratio is exactly 1 in bf16 too, while the
  # sampler's own log-probs differ from the learner's by bf16 rounding.
  assert (first["ratio_min"], first["ratio_max"], first["clip_frac"]) == (1.0, 1.0, 0.0)
  assert 0 < first["behaviour_max_abs_log_ratio"] < 0.5
  assert first["behaviour_kl_sampler"] > 0
  assert 0.0 <= first["reward"] <= 1.0


def test_checkpoint_text_io_reads_the_checkpoints_tokenizer(tmp_path):
  """``train.build.checkpoint_text_io`` (the trainer's and the export check's prompt encoder)
  encodes chat prompts as ``HFTextIO.from_pretrained`` of the same directory does, and names
  the field when the source has no checkpoint tokenizer."""
  import dataclasses
  from jaxreplay.models.spec import ModelSpec
  from jaxreplay.tasks.base import Example
  from jaxreplay.tasks.spec import TaskSpec
  from jaxreplay.train.build import checkpoint_text_io
  make_checkpoint(str(tmp_path))
  task = dataclasses.replace(TaskSpec(), prompt_width=48, chat_template=True,
                             system_prompt="Reason, then box the answer.")
  io = checkpoint_text_io(dataclasses.replace(ModelSpec(), source="hf", path=str(tmp_path)),
                          task)
  ref = HFTextIO.from_pretrained(str(tmp_path), 48, chat=True,
                                 system_prompt="Reason, then box the answer.")
  examples = [Example(prompt="What is 3 + 4?", answer="7"),
              Example(prompt="Tom has 2 eggs and buys 5 more. How many?", answer="7")]
  for ours, theirs in zip(io.prompts(examples), ref.prompts(examples)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  tokens, mask, _ = io.prompts(examples)
  assert np.asarray(tokens).shape == (2, 48) and np.asarray(mask).sum() > 10
  with pytest.raises(ValueError, match="model.source='builtin'"):
    checkpoint_text_io(ModelSpec(), task)
