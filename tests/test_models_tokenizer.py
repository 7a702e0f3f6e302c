"""Checkpoint tokenizers: tokenizer.json, special/stop ids, chat templates against transformers."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxreplay.models.hf_tokenizer import HFTokenizer

# A ChatML template in the style of Qwen2.5 (default system prompt, generation prompt).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if not (message.role == 'system' and loop.first) %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
# A Llama-3-style template: bos_token variable, raise_exception, tojson, whitespace control.
LLAMA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{# meta {{ {'a': 'é<b>'} | tojson }} #}")

SPECIALS = {
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "  Natalia sold 48 clips in April.  "},
     {"role": "assistant", "content": "48"}, {"role": "user", "content": "And in May?"}],
]


def write_checkpoint_tokenizer(directory, kind):
  specials = SPECIALS[kind]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([c["content"] for conv in CONVERSATIONS for c in conv] * 5, trainer)
  tok.save(str(directory / "tokenizer.json"))
  if kind == "chatml":
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
  else:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA,
           "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    gen = {"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
  (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
  (directory / "generation_config.json").write_text(json.dumps(gen))
  return tok


@pytest.mark.parametrize("kind", ["chatml", "llama"])
def test_special_ids_and_stop_ids(tmp_path, kind):
  raw = write_checkpoint_tokenizer(tmp_path, kind)
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  if kind == "chatml":
    assert tok.stop_ids == (raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>"))
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
  else:  # no pad token: the first stop id pads
    assert tok.stop_ids == (raw.token_to_id("<|end_of_text|>"), raw.token_to_id("<|eot_id|>"))
    assert tok.pad_id == raw.token_to_id("<|end_of_text|>")
    assert tok.bos_id == raw.token_to_id("<|begin_of_text|>")


@pytest.mark.parametrize("kind", ["chatml", "llama"])
def test_chat_template_matches_transformers(tmp_path, kind):
  transformers = pytest.importorskip("transformers")
  write_checkpoint_tokenizer(tmp_path, kind)
  ours = HFTokenizer.from_pretrained(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for conv in CONVERSATIONS:
    for gen_prompt in (True, False):
      text = ours.apply_chat_template(conv, add_generation_prompt=gen_prompt)
      assert text == ref.apply_chat_template(conv, add_generation_prompt=gen_prompt, tokenize=False)
  toks, mask, keep = ours.encode_chats(CONVERSATIONS, width=256)
  for i, conv in enumerate(CONVERSATIONS):
    want = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert toks[i][mask[i]].tolist() == list(want)
  assert keep.all()


def test_encode_prompts_left_pads_and_truncates(tmp_path):
  write_checkpoint_tokenizer(tmp_path, "chatml")
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  ids = tok.tokenizer.encode("What is 12 + 30?", add_special_tokens=False).ids
  n = len(ids)
  toks, mask, keep = tok.encode_prompts(["What is 12 + 30?", "What"], width=n + 2)
  assert toks[0, 2:].tolist() == ids and not mask[0, :2].any() and mask[0, 2:].all()
  assert (toks[0, :2] == tok.pad_id).all()
  assert mask[1].sum() == len(tok.tokenizer.encode("What").ids)
  toks, mask, keep = tok.encode_prompts(["What is 12 + 30?"], width=n - 2)
  assert toks[0].tolist() == ids[2:] and keep.all()
  _, mask, keep = tok.encode_prompts(["What is 12 + 30?"], width=n - 2, on_too_long="skip")
  assert not keep[0] and not mask.any()
  assert tok.decode_completions(np.asarray([ids + [tok.pad_id]]), np.asarray([[True] * n + [False]])) == [
      "What is 12 + 30?"]
  with pytest.raises(ValueError, match="on_too_long"):
    tok.encode_prompts(["x"], 4, on_too_long="drop")
