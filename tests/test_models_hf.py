"""Parity with Hugging Face transformers (PyTorch CPU) on tiny random Qwen2, Qwen3 and Llama
models: logits, greedy continuations, safetensors loading (single and sharded), export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import forward_terms, reorder_tol  # noqa: E402
from jaxreplay.models import hf, safetensors_io  # noqa: E402
from jaxreplay.parallel import make_mesh  # noqa: E402
from jaxreplay.sampling import generate  # noqa: E402

V = 160
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    # Qwen2: q/k/v biases, tied embeddings, YaRN scaling.
    "qwen2": (transformers.Qwen2Config, dict(
        tie_word_embeddings=True, rope_theta=1e6,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    # Qwen3: QK-norm, head_dim != hidden/heads, untied.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
    # Llama 3.1-style rope scaling, attention biases (q/k/v and o), untied.
    "llama": (transformers.LlamaConfig, dict(
        tie_word_embeddings=False, rope_theta=5e5, attention_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
}


def make_hf_model(family, directory, dtype=None):
  cls, extra = FAMILIES[family]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cls(**COMMON, **extra)).eval()
  with torch.no_grad():  # larger than the default init so logits are far from uniform
    for p in model.parameters():
      p.normal_(0.0, 0.15)
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp(request.param))
  model = make_hf_model(request.param, path)
  cfg, graphdef, params = hf.from_pretrained(path)
  return request.param, path, model, cfg, graphdef, params


def left_padded_batch(rng, lengths, width):
  toks = np.zeros((len(lengths), width), np.int64)
  mask = np.zeros((len(lengths), width), bool)
  for i, n in enumerate(lengths):
    toks[i, width - n:] = rng.randint(1, V, n)
    mask[i, width - n:] = True
  return toks, mask


def hf_logits(model, toks, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.tensor(pos))
  return out.logits.numpy()


def test_config_from_hf(family):
  name, path, model, cfg, _, _ = family
  assert cfg.qk_norm == (name == "qwen3")
  assert cfg.qkv_bias == (name in ("qwen2", "llama"))
  assert cfg.o_bias == (name == "llama")
  assert cfg.tie_embeddings == (name == "qwen2")
  assert cfg.head_dim == (32 if name == "qwen3" else 16)
  assert cfg.rope_type == {"qwen2": "yarn", "qwen3": "default", "llama": "llama3"}[name]
  assert not cfg.scale_tied_logits


@pytest.mark.numerics
def test_logits_match_transformers(family):
  _, _, model, cfg, graphdef, params = family
  toks, mask = left_padded_batch(np.random.RandomState(0), [40, 17, 1], 40)
  ours = np.asarray(jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, m))(
      params, jnp.asarray(toks, jnp.int32), jnp.asarray(mask)))
  ref = hf_logits(model, toks, mask)
  diff = np.abs(ours - ref)[mask]
  # PyTorch and XLA round the forward chain each their own way (conftest.reorder_tol), its
  # terms about the size of the largest |logit| (conftest.logprob_tol)
  tol = reorder_tol(forward_terms(cfg, 40), scale=np.abs(ref[mask]).max())
  assert diff.max() <= tol, (diff.max(), tol)
  assert np.abs(ref[mask]).max() > 0.5  # non-trivial logits


def test_greedy_continuations_match_transformers(family):
  _, _, model, _, graphdef, params = family
  toks, mask = left_padded_batch(np.random.RandomState(1), [9, 4, 6], 9)
  g = generate(graphdef, params, jnp.asarray(toks, jnp.int32), jnp.asarray(mask),
               jax.random.key(0), max_new_tokens=32, temperature=0.0, eos_ids=(), pad_id=0)
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask.astype(np.int64)),
                         max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
  ref = out[:, toks.shape[1]:].numpy()
  assert ref.shape == (3, 32)
  np.testing.assert_array_equal(np.asarray(g.tokens), ref)
  assert np.asarray(g.mask).all() and np.asarray(g.truncated).all()
  assert len(set(ref.ravel().tolist())) > 5  # not a constant sequence


def test_export_roundtrip_sharded_index(family, tmp_path):
  _, _, model, cfg, graphdef, params = family
  out = str(tmp_path / "export")
  names = hf.save_pretrained(out, cfg, params, max_shard_bytes=60_000)
  assert "model.safetensors.index.json" in names and len(names) > 3
  # Our sharded checkpoint reloads bit-exactly ...
  cfg2, _, params2 = hf.from_pretrained(out)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # ... and opens in transformers with the same logits.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  toks, mask = left_padded_batch(np.random.RandomState(2), [12, 5], 12)
  np.testing.assert_allclose(hf_logits(reloaded, toks, mask)[mask], hf_logits(model, toks, mask)[mask],
                             atol=1e-6)


def test_safetensors_writer_is_read_by_the_reference_library(tmp_path):
  import ml_dtypes
  safetensors = pytest.importorskip("safetensors.numpy")
  arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, -2], np.int64),
            "c": np.array([0.5, 1.5], ml_dtypes.bfloat16)}
  safetensors_io.write_file(str(tmp_path / "x.safetensors"), {k: arrays[k] for k in "ab"}, {"format": "pt"})
  back = safetensors.load_file(str(tmp_path / "x.safetensors"))
  for k in "ab":
    np.testing.assert_array_equal(back[k], arrays[k])
  safetensors_io.write_file(str(tmp_path / "y.safetensors"), arrays)
  f = safetensors_io.SafetensorsFile(str(tmp_path / "y.safetensors"))
  assert f.dtype("c") == np.dtype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(f.get("c")[...].astype(np.float32), [0.5, 1.5])


def test_safetensors_roundtrip_and_sliced_reads(tmp_path):
  import ml_dtypes
  rng = np.random.RandomState(0)
  arrays = {"f32": rng.randn(6, 5).astype(np.float32),
            "bf16": rng.randn(4, 7).astype(ml_dtypes.bfloat16),
            "i32": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
            "big_endian": np.arange(5, dtype=">f4"),
            "strided": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
            "scalar": np.array(3.5, np.float32)}
  path = str(tmp_path / "t.safetensors")
  nbytes = safetensors_io.write_file(path, arrays, {"format": "pt"})
  assert nbytes == sum(a.nbytes for a in arrays.values())
  with safetensors_io.SafetensorsFile(path) as f:
    assert f.metadata == {"format": "pt"} and sorted(f.keys()) == sorted(arrays)
    for k, a in arrays.items():
      assert f.shape(k) == a.shape and f.dtype(k) == a.dtype.newbyteorder("=")
      np.testing.assert_array_equal(f.get(k)[...], a)
    idx = (slice(1, 3), slice(2, 5))
    for k in ("f32", "bf16"):
      block = f.get(k)[idx]
      assert block.dtype == arrays[k].dtype and block.shape == (2, 3)
      np.testing.assert_array_equal(block, arrays[k][idx])
    np.testing.assert_array_equal(f.get("i32")[1, :, 1:3], arrays["i32"][1, :, 1:3])
    # hf.load_params reads a transposed kernel block as view[reversed index].T
    np.testing.assert_array_equal(f.get("f32")[tuple(reversed(idx))].T, arrays["f32"].T[idx])


def test_safetensors_errors_name_the_file(tmp_path):
  import struct

  def one_tensor(dtype, nbytes, data_bytes):
    h = json.dumps({"x": {"dtype": dtype, "shape": [1], "data_offsets": [0, nbytes]}}).encode()
    return struct.pack("<Q", len(h)) + h + b"\0" * data_bytes

  bad = {"long": struct.pack("<Q", 10**9) + b"{}", "json": struct.pack("<Q", 5) + b"{abc}",
         "short": b"\1\2", "truncated": one_tensor("F32", 4, 2), "code": one_tensor("XYZ", 4, 4)}
  for name, content in bad.items():
    p = tmp_path / f"{name}.safetensors"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="not a readable safetensors file") as e:
      safetensors_io.SafetensorsFile(str(p))
    assert str(p) in str(e.value)
  (tmp_path / "f8.safetensors").write_bytes(one_tensor("F8_E4M3", 1, 1))
  with pytest.raises(ValueError, match="f8.safetensors: tensor 'x' has unsupported dtype F8_E4M3"):
    safetensors_io.open_checkpoint(str(tmp_path / "f8.safetensors"))
  with pytest.raises(ValueError, match="'c'.*cannot be written"):
    safetensors_io.write_file(str(tmp_path / "w.safetensors"), {"c": np.zeros(2, np.complex64)})
  with pytest.raises(FileNotFoundError):
    safetensors_io.open_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_mode_of_the_umask(tmp_path, umask, mode):
  """safetensors writes 0o600 whatever the umask; an exported model must be readable by
  whoever the user's umask lets read their other files."""
  old = os.umask(umask)
  try:
    safetensors_io.write_file(str(tmp_path / "m.safetensors"), {"a": np.ones(2, np.float32)})
  finally:
    os.umask(old)
  assert os.stat(tmp_path / "m.safetensors").st_mode & 0o777 == mode


def test_bf16_checkpoint_loads_exactly(tmp_path):
  model = make_hf_model("qwen3", str(tmp_path), dtype=torch.bfloat16)
  cfg, _, params = hf.from_pretrained(str(tmp_path), param_dtype="bfloat16")
  q = params["blocks"][1]["attn"]["q"]["kernel"][...]
  assert q.dtype == jnp.bfloat16
  ref = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(q, np.float32), ref)


def test_mismatched_checkpoint_lists_every_bad_tensor(family, tmp_path):
  name, path, _, cfg, _, _ = family
  src = safetensors_io.open_checkpoint(path)
  tensors = {k: f.get(k)[...] for k, f in src.items()}
  del tensors["model.layers.1.mlp.up_proj.weight"]
  del tensors["model.norm.weight"]
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
  tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2,), np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)  # ignored
  safetensors_io.write_file(str(tmp_path / "model.safetensors"), tensors)
  with open(os.path.join(path, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  with pytest.raises(hf.CheckpointMismatchError) as err:
    hf.from_pretrained(str(tmp_path))
  e = err.value
  assert sorted(e.missing) == ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
  kv = (cfg.n_kv_heads * cfg.head_dim, 64)
  assert e.mismatched == [("model.layers.0.self_attn.k_proj.weight", kv, (8, 64))]
  assert e.unexpected == ["model.layers.0.self_attn.extra.weight"]
  for bad in ("up_proj", "model.norm.weight", "k_proj", str(kv), "extra.weight"):
    assert bad in str(e)


def test_unsupported_configs_name_the_field(tmp_path):
  base = dict(COMMON, model_type="qwen2", hidden_act="silu")
  with pytest.raises(ValueError, match="model_type='gpt2'"):
    hf.config_from_hf(dict(base, model_type="gpt2"))
  with pytest.raises(ValueError, match="use_sliding_window"):
    hf.config_from_hf(dict(base, use_sliding_window=True))
  with pytest.raises(ValueError, match="rope_type='dynamic'"):
    hf.config_from_hf(dict(base, rope_scaling={"type": "dynamic", "factor": 2.0}))
  with pytest.raises(ValueError, match="hidden_act"):
    hf.config_from_hf(dict(base, hidden_act="gelu"))


def test_load_onto_mesh_shards_by_rules(family):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  name, path, _, cfg, _, params = family
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  _, sharded = hf.load_params(path, cfg, mesh=mesh)
  q = sharded["blocks"][0]["attn"]["q"]["kernel"][...]  # [64, H * E]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert q.addressable_shards[0].data.shape == (32, cfg.n_heads * cfg.head_dim // 2)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
